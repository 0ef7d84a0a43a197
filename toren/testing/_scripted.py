"""The scripted server core: steps, holds, call counting and the aiohttp lifecycle.

A :class:`ScriptedServer` answers each request with the next scripted step, rendered by a subclass
in its provider's wire format. Everything a test wants to assert is recorded: every request (also
those beyond the script), in arrival order, its estimated input tokens, whether it was refused as
over the model's window, and the scripted model time actually served.

Input tokens are estimated by :func:`toren._agent.estimate.estimate_tokens` (one token per
four UTF-8 bytes of the string values) over the request's system prompt, messages and tools, in
the fields the provider's wire format keeps them (:attr:`ScriptedServer.counted_fields`).
"""

from __future__ import annotations

import json
import socket
from collections import deque
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import Any, ClassVar, Self

import anyio
import attrs
import orjson
from aiohttp import web

from toren._agent.estimate import estimate_tokens
from toren._agent.model import ModelRequest
from toren.testing._script import ScriptedModel
from toren.testing._steps import Disconnect, Fail, Reply, Step

__all__ = [
    "Disconnect",
    "Fail",
    "Hold",
    "ReceivedRequest",
    "Reply",
    "ScriptedServer",
    "Step",
    "json_response",
    "wire_json",
]


Script = Sequence[Step] | Callable[[dict[str, Any], int], Step] | ScriptedModel


@attrs.frozen(kw_only=True)
class ReceivedRequest:
    """One request as the server received it. ``n`` counts from 1 over all requests.

    ``input_tokens`` is the server's estimate of the request's prompt (system, messages, tools);
    ``refused`` is true when it was over the server's window and answered with the provider's
    "too long" error instead of a scripted step.
    """

    n: int
    method: str
    path: str
    headers: dict[str, str] = attrs.field(repr=False)
    body: dict[str, Any]
    input_tokens: int = 0
    refused: bool = False


class Hold:
    """Keeps request ``n`` waiting until :meth:`release` (or until the server stops).

    ``arrived`` is set as soon as request ``n`` was received and recorded, before it waits.
    """

    def __init__(self, n: int) -> None:
        self.n = n
        self.arrived = anyio.Event()
        self._released = anyio.Event()

    def release(self) -> None:
        """Let the held request go on to its scripted step."""
        self._released.set()

    @property
    def released(self) -> bool:
        """Whether :meth:`release` was called (or the server stopped)."""
        return self._released.is_set()

    async def wait_released(self) -> None:
        """Wait until the request may go on."""
        await self._released.wait()


class ScriptedServer:
    """A local HTTP server answering from a script; subclasses speak one provider's protocol.

    Use it as an async context manager: it listens on 127.0.0.1 on a free port while inside.
    ``script`` is a sequence of steps consumed in arrival order, a callable
    ``(request_json, n) -> step``, or a :class:`~toren.testing.ScriptedModel`, which is given
    each request read back into Toren's vocabulary (:meth:`request_of`). A request beyond a
    scripted sequence is recorded and answered with a 500 in the provider's error format whose
    message says the script ran out.

    ``window`` is the model's context window in (estimated) tokens. A request whose estimated
    input tokens are over it is refused with the provider's own "prompt is too long" error
    (status and body as the provider sends them), before the script is consulted: it consumes
    no step and is not passed to a script callable. It is recorded with ``refused=True``.
    """

    provider = "scripted"
    counted_fields: ClassVar[tuple[str, ...]] = ()
    """The top-level fields of a request body that hold its prompt (system, messages, tools)."""

    def __init__(self, script: Script = (), *, window: int | None = None) -> None:
        if window is not None and window < 1:
            raise ValueError(f"window must be a positive number of tokens, not {window}")
        self.window = window
        self._steps: deque[Step] = deque()
        self._script_fn: Callable[[dict[str, Any], int], Step] | None = None
        self.model: ScriptedModel | None = None
        if isinstance(script, ScriptedModel):
            self.model = script
        elif callable(script):
            self._script_fn = script
        else:
            self._steps.extend(script)
        self._scripted = len(self._steps)
        self.received: list[ReceivedRequest] = []
        self.model_time = 0.0
        self._holds: dict[int, Hold] = {}
        self._arrivals: dict[int, anyio.Event] = {}
        self._stopping: anyio.Event | None = None
        self._runner: web.AppRunner | None = None
        self._port: int | None = None

    # -- the script ---------------------------------------------------------------------------

    def add(self, *steps: Step) -> None:
        """Append steps to a sequence script.

        Raises:
            TypeError: the server was scripted with a callable.
        """
        if self._script_fn is not None or self.model is not None:
            raise TypeError("this server is scripted by a callable; it takes no extra steps")
        self._steps.extend(steps)
        self._scripted += len(steps)

    @property
    def requests(self) -> list[dict[str, Any]]:
        """The parsed JSON bodies of every request received, in arrival order."""
        return [r.body for r in self.received]

    @property
    def served(self) -> list[ReceivedRequest]:
        """The requests not refused as over the window (each got its scripted step)."""
        return [r for r in self.received if not r.refused]

    @property
    def refused(self) -> list[ReceivedRequest]:
        """The requests refused as over the window, in arrival order."""
        return [r for r in self.received if r.refused]

    @property
    def max_input_tokens(self) -> int:
        """The largest estimated input of a request served (0 when none was): with a
        ``window``, never over it."""
        return max((r.input_tokens for r in self.served), default=0)

    def input_tokens(self, body: dict[str, Any]) -> int:
        """The estimated input tokens of a request body: :func:`estimate_tokens` over its
        :attr:`counted_fields`."""
        return estimate_tokens([body[f] for f in self.counted_fields if f in body])

    def hold(self, n: int) -> Hold:
        """Make request ``n`` (1-based, over all requests) wait until released.

        Raises:
            ValueError: request ``n`` has already arrived.
        """
        if n <= len(self.received):
            raise ValueError(f"request {n} has already arrived; hold it before it is sent")
        hold = self._holds.get(n)
        if hold is None:
            hold = self._holds[n] = Hold(n)
        return hold

    def release(self, n: int | None = None) -> None:
        """Release the hold on request ``n``, or every hold when ``n`` is ``None``."""
        for number, hold in self._holds.items():
            if n is None or number == n:
                hold.release()

    def arrived(self, n: int) -> anyio.Event:
        """An event set once request ``n`` (1-based) has been received and recorded."""
        event = self._arrivals.get(n)
        if event is None:
            event = self._arrivals[n] = anyio.Event()
            if n <= len(self.received):
                event.set()
        return event

    # -- lifecycle ----------------------------------------------------------------------------

    @property
    def port(self) -> int:
        """The TCP port the server listens on.

        Raises:
            RuntimeError: the server is not running.
        """
        if self._port is None:
            raise RuntimeError(f"{type(self).__name__} is not running; use it with `async with`")
        return self._port

    @property
    def url(self) -> str:
        """``http://127.0.0.1:<port>``, the server's root."""
        return f"http://127.0.0.1:{self.port}"

    @property
    def base_url(self) -> str:
        """The base URL to give the provider's SDK."""
        return self.url

    def env(self) -> dict[str, str]:
        """Environment variables that point Toren's provider adapter at this server."""
        return {}

    def routes(self) -> list[web.RouteDef]:
        """The routes of the provider's API that this server answers."""
        raise NotImplementedError

    async def __aenter__(self) -> Self:
        self._stopping = anyio.Event()
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.add_routes(self.routes())
        runner = web.AppRunner(app, access_log=None, handle_signals=False, shutdown_timeout=1.0)
        await runner.setup()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.bind(("127.0.0.1", 0))
            await web.SockSite(runner, sock).start()
        except BaseException:
            sock.close()
            with anyio.CancelScope(shield=True):
                await runner.cleanup()
            raise
        self._port = sock.getsockname()[1]
        self._runner = runner
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._stopping is not None:
            self._stopping.set()
        self.release()
        if self._runner is not None:
            with anyio.CancelScope(shield=True):
                await self._runner.cleanup()
        self._runner = None
        self._port = None

    # -- request handling ---------------------------------------------------------------------

    async def _receive(self, request: web.Request) -> tuple[ReceivedRequest, Step | None]:
        """Record a request, wait out its hold, and pick its step (``None``: the script ran out,
        or the request was refused as over the window)."""
        raw = await request.read()
        try:
            body = orjson.loads(raw) if raw else {}
        except orjson.JSONDecodeError:
            try:  # lone surrogates (escaped), which the standard library reads
                body = json.loads(raw)
            except ValueError:
                body = {"_unparsed": raw.decode(errors="replace")}
        if not isinstance(body, dict):
            body = {"_unparsed": body}
        n = len(self.received) + 1
        tokens = self.input_tokens(body)
        refused = self.window is not None and tokens > self.window
        received = ReceivedRequest(
            n=n,
            method=request.method,
            path=request.path,
            headers=dict(request.headers),
            body=body,
            input_tokens=tokens,
            refused=refused,
        )
        self.received.append(received)
        step: Step | None = None
        if refused:
            pass  # answered by render_too_large; no step is consumed
        elif self._script_fn is not None:
            step = self._script_fn(body, n)
        elif self.model is not None:
            step = await self._ask_model(self.model, received)
        else:
            step = self._steps.popleft() if self._steps else None
        self.arrived(n).set()
        hold = self._holds.get(n)
        if hold is not None:
            hold.arrived.set()
            await hold.wait_released()
        return received, step

    async def _ask_model(self, model: ScriptedModel, received: ReceivedRequest) -> Step:
        try:
            request = self.request_of(received)
        except (ValueError, TypeError, KeyError) as exc:
            return model.refusal(f"was not asked: the request is not a conversation ({exc})")
        return await model.answer(request)

    def request_of(self, received: ReceivedRequest) -> ModelRequest:
        """The request ``received`` carries, in Toren's vocabulary (per provider).

        Raises:
            ValueError: the body is not a conversation in the provider's format.
        """
        raise NotImplementedError

    def _ran_out(self, n: int) -> Fail:
        return Fail(
            status=500,
            message=(
                f"{type(self).__name__}: the script ran out at request {n} "
                f"({self._scripted} steps were scripted); add steps for every expected call"
            ),
        )

    async def _serve_latency(self, request: web.Request, step: Reply) -> bool:
        """Wait the step's model latency; ``False`` if the server stopped or the client left."""
        if step.latency > 0 and self._stopping is not None:
            with anyio.move_on_after(step.latency):
                await self._stopping.wait()
                return False
        return self._client_connected(request)

    def _count_served(self, request: web.Request, step: Reply) -> None:
        if self._client_connected(request):
            self.model_time += step.latency

    @staticmethod
    def _client_connected(request: web.Request) -> bool:
        transport = request.transport
        return transport is not None and not transport.is_closing()

    @property
    def stopping(self) -> bool:
        """Whether the server is shutting down."""
        return self._stopping is not None and self._stopping.is_set()

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        received, step = await self._receive(request)
        if self.stopping:
            return self.render_fail(Fail(status=503, message="the scripted server is stopping"))
        if received.refused:
            return self.render_too_large(received)
        if step is None:
            return self.render_fail(self._ran_out(received.n))
        if isinstance(step, Disconnect):
            if request.transport is not None:
                request.transport.abort()
            raise web.HTTPServiceUnavailable  # never sent: the connection is gone
        if isinstance(step, Fail):
            return self.render_fail(step)
        if not await self._serve_latency(request, step):
            return self.render_fail(Fail(status=503, message="the scripted server is stopping"))
        response = await self.render_reply(request, received, step)
        self._count_served(request, step)
        return response

    # -- rendering (per provider) -------------------------------------------------------------

    def error_headers(self, step: Fail) -> dict[str, str]:
        """``Retry-After`` (seconds) and ``retry-after-ms`` when the step names a delay."""
        if step.retry_after is None:
            return {}
        return {
            "Retry-After": format(step.retry_after, "g"),
            "retry-after-ms": format(step.retry_after * 1000, "g"),
        }

    def render_fail(self, step: Fail) -> web.Response:
        """The provider's error response for ``step``."""
        raise NotImplementedError

    def render_too_large(self, received: ReceivedRequest) -> web.Response:
        """The provider's refusal of a request over the window (status and body as it sends
        them); ``received.input_tokens`` is over :attr:`window`."""
        raise NotImplementedError

    async def render_reply(
        self, request: web.Request, received: ReceivedRequest, step: Reply
    ) -> web.StreamResponse:
        """The provider's response for ``step`` (plain JSON or a stream, as requested)."""
        raise NotImplementedError


def wire_json(value: Any) -> bytes:
    """``value`` as the JSON a provider would send: orjson's, or, for what orjson refuses (lone
    surrogates, integers past 64 bits, as hostile model output may hold), the standard
    library's (surrogates escaped, ``NaN`` and ``Infinity`` as Python's SDKs read them)."""
    try:
        return orjson.dumps(value)
    except TypeError:
        return json.dumps(value, ensure_ascii=True).encode()


def json_response(
    body: Any, *, status: int = 200, headers: dict[str, str] | None = None
) -> web.Response:
    """A JSON response serialised with :func:`wire_json`."""
    return web.Response(
        body=wire_json(body), status=status, headers=headers, content_type="application/json"
    )
