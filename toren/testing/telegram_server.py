"""A local Telegram Bot API server for tests: the real python-telegram-bot client talks to it.

It speaks the Bot API's wire format (``POST /bot<token>/<method>``, answered with
``{"ok": true, "result": ...}`` or ``{"ok": false, "error_code": N, "description": ...,
"parameters": ...}``) and refuses what Telegram refuses (:mod:`toren.testing._telegram_state`), so
that a client is tested against the answers it will get in production. The test plays the users
and the faults, and asserts every call::

    async with TelegramServer(token="123:ABC") as tg:
        tg.push_message(42, "/start")
        async with telegram.Bot(
            "123:ABC", base_url=tg.base_url, base_file_url=tg.base_file_url
        ) as bot:
            (update,) = await bot.get_updates(timeout=5)
            await bot.send_message(42, "hello")
        assert tg.sent(42)[0].text == "hello"

Users: ``push_message``, ``push_callback``, ``push_document``, ``push_photo``,
``push_edited_message``, ``push_raw``, ``add_chat``. Faults: :meth:`TelegramServer.fail_next`,
``block``, ``migrate``, ``limit_rate`` (with ``throttled`` and ``violations()``, to check that the
client waited as told), :meth:`TelegramServer.hold`. Records: ``sent``, ``message``, ``calls``,
``callback_answers``, ``updates_confirmed``; ``until`` waits for a condition without sleeping.
Webhooks: once the client set one, pushed updates wait for :meth:`TelegramServer.deliver`.

Served: getMe, getUpdates (long polling), setWebhook, deleteWebhook, getWebhookInfo, sendMessage,
sendDocument, sendPhoto, editMessageText, editMessageReplyMarkup, answerCallbackQuery, getFile and
``GET /file/bot<token>/<file_path>``; any other method answers 404 ``Not Found``, an unknown token
401 ``Unauthorized``.

Every scripting and inspection method may be called from another thread than the server's:
:meth:`TelegramServer.in_thread` runs the server in a thread of its own, for tests whose bots run
in other processes. ``python -m toren.testing.telegram_server --port N --token T`` runs one alone
and prints its URL; a harness in another process scripts it through ``POST /_toren/<op>`` with the
op's keyword arguments as a JSON object (``push_message``, ``sent``, ``block``, ...).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from types import TracebackType
from typing import Any, Self

import aiohttp
import anyio
import attrs
from aiohttp import web

from toren.testing._scripted import json_response, wire_json
from toren.testing._telegram_script import TelegramScript
from toren.testing._telegram_state import BotState, LongPoll
from toren.testing._telegram_wire import (
    ApiError,
    Call,
    CallbackAnswer,
    SentMessage,
    Signal,
    Throttle,
    Upload,
    arg_float,
    arg_int,
    loose_chat_id,
    read_params,
)

__all__ = [
    "Call",
    "CallbackAnswer",
    "Hold",
    "SentMessage",
    "Signal",
    "TelegramServer",
    "Throttle",
    "Upload",
]

SECRET_HEADER = "X-Telegram-Bot-Api-Secret-Token"  # noqa: S105 - a header name
_DEFAULT_ERRORS = {
    400: "Bad Request",
    401: "Unauthorized",
    403: "Forbidden: bot was blocked by the user",
    404: "Not Found",
    409: "Conflict: terminated by other getUpdates request; make sure that only one bot "
    "instance is running",
    500: "Internal Server Error",
    502: "Bad Gateway",
}
_WEBHOOK_ACTIVE = (
    "Conflict: can't use getUpdates method while webhook is active; use deleteWebhook to delete "
    "the webhook first"
)
_CONTROL_OPS = frozenset(
    {"push_message", "push_callback", "push_document", "push_raw", "add_chat", "block"}
    | {"unblock", "migrate", "fail_next", "limit_rate", "sent", "calls", "violations"}
    | {"pending_updates", "callback_answers", "throttled"}
)


class Hold:
    """Keeps the next ``n`` calls of a method waiting, recorded but unanswered, until
    :meth:`release`. ``arrived`` is set once all ``n`` arrived (``await hold.arrived``, or
    ``hold.arrived.wait(timeout)`` from another thread); ``calls`` holds them.

    With ``delivered``, a held call takes effect on arrival (the message is sent) and only its
    answer waits: a client killed meanwhile never learns that its message went out. Without it,
    the call takes effect on release, and not at all if its client left before.
    """

    def __init__(self, method: str, n: int, *, delivered: bool) -> None:
        self.method = method
        self.n = n
        self.delivered = delivered
        self.calls: list[Call] = []
        self.arrived = Signal()
        self.released = Signal()

    def release(self) -> None:
        """Let the held calls be answered."""
        self.released.set()


@attrs.define(kw_only=True)
class _Fault:
    method: str
    error: ApiError
    remaining: int
    chat_id: int | None


class TelegramServer(TelegramScript):
    """A local Bot API server for the bot of ``token`` (and those of :meth:`add_bot`).

    Use it with ``async with`` (it listens on 127.0.0.1, on ``port`` or a free one) or with
    :meth:`in_thread`. ``clock`` is the monotonic time of rate limits and records. ``control``
    adds the ``/_toren/<op>`` endpoint (for a harness in another process).
    """

    def __init__(
        self,
        token: str = "123:ABC",  # noqa: S107 - a test bot's token
        *,
        username: str = "toren_test_bot",
        port: int = 0,
        clock: Callable[[], float] = time.monotonic,
        control: bool = False,
    ) -> None:
        super().__init__(clock=clock)
        self._wanted_port = port
        self._control = control
        self._faults: list[_Fault] = []
        self._holds: list[Hold] = []
        self._stopping = False
        self._runner: web.AppRunner | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._port: int | None = None
        self.add_bot(token, username)

    # -- faults -------------------------------------------------------------------------------

    def fail_next(
        self,
        method: str,
        *,
        status: int,
        description: str | None = None,
        retry_after: int | None = None,
        migrate_to_chat_id: int | None = None,
        count: int = 1,
        chat_id: int | None = None,
    ) -> None:
        """Answer the next ``count`` calls of ``method`` (to ``chat_id`` only, if given) with
        this error instead of serving them. ``description`` defaults to Telegram's for the
        status (``Too Many Requests: retry after N`` for a 429); ``retry_after`` and
        ``migrate_to_chat_id`` go in its ``parameters``, where clients look for them."""
        if description is None:
            description = _DEFAULT_ERRORS.get(status, "Internal Server Error")
            if status == 429:
                description = f"Too Many Requests: retry after {retry_after or 1}"
        parameters: dict[str, Any] = {}
        if retry_after is not None:
            parameters["retry_after"] = retry_after
        if migrate_to_chat_id is not None:
            parameters["migrate_to_chat_id"] = migrate_to_chat_id
        fault = _Fault(
            method=method.lower(),
            error=ApiError(status, description, parameters),
            remaining=count,
            chat_id=chat_id,
        )
        with self._lock:
            self._faults.append(fault)

    def _take_fault(self, key: str, call: Call) -> None:
        for fault in self._faults:
            if (
                fault.method == key
                and fault.remaining > 0
                and fault.chat_id in (None, call.chat_id)
            ):
                fault.remaining -= 1
                error = fault.error
                raise ApiError(error.status, error.description, dict(error.parameters))

    def hold(self, method: str, n: int = 1, *, delivered: bool = False) -> Hold:
        """Hold the next ``n`` calls of ``method`` (see :class:`Hold`) until released."""
        hold = Hold(method.lower(), n, delivered=delivered)
        with self._lock:
            self._holds.append(hold)
        return hold

    def _claim_hold(self, key: str, call: Call) -> Hold | None:
        for hold in self._holds:
            if hold.method == key and len(hold.calls) < hold.n:
                hold.calls.append(call)
                if len(hold.calls) == hold.n:
                    hold.arrived.set()
                return hold
        return None

    # -- lifecycle ----------------------------------------------------------------------------

    @property
    def port(self) -> int:
        """The TCP port the server listens on.

        Raises:
            RuntimeError: the server is not running.
        """
        if self._port is None:
            raise RuntimeError("TelegramServer is not running; use it with `async with`")
        return self._port

    @property
    def url(self) -> str:
        """``http://127.0.0.1:<port>``."""
        return f"http://127.0.0.1:{self.port}"

    @property
    def base_url(self) -> str:
        """The ``base_url`` to give ``telegram.Bot`` (it appends the token)."""
        return f"{self.url}/bot"

    @property
    def base_file_url(self) -> str:
        """The ``base_file_url`` to give ``telegram.Bot``."""
        return f"{self.url}/file/bot"

    def env(self) -> dict[str, str]:
        """``TOREN_TELEGRAM_API_URL``, which points Toren's Telegram surface at this server."""
        return {"TOREN_TELEGRAM_API_URL": self.url}

    async def __aenter__(self) -> Self:
        self._loop = asyncio.get_running_loop()
        self._stopping = False
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.add_routes(
            [
                web.route("*", "/bot{token}/{method}", self._handle),
                web.get("/file/bot{token}/{path:.+}", self._serve_file),
            ]
        )
        if self._control:
            app.add_routes([web.post("/_toren/{op}", self._control_op)])
        # handler_cancellation: a client that hangs up cancels its request (a long poll, a hold).
        runner = web.AppRunner(
            app,
            access_log=None,
            handle_signals=False,
            shutdown_timeout=1.0,
            handler_cancellation=True,
        )
        await runner.setup()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(("127.0.0.1", self._wanted_port))
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
        with self._lock:
            self._stopping = True
            for bot in self._bots.values():
                if bot.poll is not None:
                    bot.poll.signal.set()
            for hold in self._holds:
                hold.release()
        if self._runner is not None:
            with anyio.CancelScope(shield=True):
                await self._runner.cleanup()
        self._runner = None
        self._port = None

    @classmethod
    @contextlib.contextmanager
    def in_thread(
        cls,
        token: str = "123:ABC",  # noqa: S107 - a test bot's token
        *,
        username: str = "toren_test_bot",
        port: int = 0,
        clock: Callable[[], float] = time.monotonic,
        control: bool = False,
    ) -> Iterator[Self]:
        """Run a server in a thread with its own event loop while inside the ``with``.

        Raises:
            OSError: the port could not be bound.
        """
        server = cls(token, username=username, port=port, clock=clock, control=control)
        ready = threading.Event()
        stop: list[asyncio.Event] = []
        failure: list[BaseException] = []

        async def serve() -> None:
            async with server:
                stop.append(asyncio.Event())
                ready.set()
                await stop[0].wait()

        def run() -> None:
            try:
                asyncio.run(serve())
            except BaseException as exc:  # noqa: BLE001 - raised again in the test's thread
                failure.append(exc)
            finally:
                ready.set()

        thread = threading.Thread(target=run, name="telegram-server", daemon=True)
        thread.start()
        ready.wait()
        if failure:
            raise failure[0]
        try:
            yield server
        finally:
            if server._loop is not None and stop:
                server._loop.call_soon_threadsafe(stop[0].set)
            thread.join()

    # -- the Bot API --------------------------------------------------------------------------

    async def _handle(self, request: web.Request) -> web.Response:
        method = request.match_info["method"]
        key = method.lower()
        params: dict[str, Any] = {}
        error: ApiError | None = None
        try:
            params = await read_params(request)
        except ApiError as exc:
            error = exc
        with self._lock:
            bot = self._bots.get(request.match_info["token"])
            call = Call(
                n=len(self._calls) + 1,
                method=method,
                params=params,
                bot_id=bot.id if bot else None,
                chat_id=loose_chat_id(params),
                at=self._clock(),
            )
            self._calls.append(call)
            self._changed()
            if bot is not None and key not in self._methods and key != "getupdates":
                error = ApiError(404, "Not Found")
            hold = self._claim_hold(key, call) if bot and not error else None
        if bot is None:
            return self._answer(call, ApiError(401, "Unauthorized"))
        if error is not None:
            return self._answer(call, error)
        if hold is None:
            return self._answer(call, await self._run(bot, key, call))
        outcome = await self._run(bot, key, call) if hold.delivered else None
        try:
            await hold.released
        except asyncio.CancelledError:  # aiohttp ends a handler whose client went away
            with self._lock:
                call.gone = not hold.delivered  # a call held before it took effect never will
                self._changed()
            raise
        if not hold.delivered:
            stopped = ApiError(502, "Bad Gateway")
            outcome = stopped if self._stopping else await self._run(bot, key, call)
        return self._answer(call, outcome)

    async def _run(self, bot: BotState, key: str, call: Call) -> Any:
        """The method's result, or the :class:`ApiError` it answers with."""
        try:
            with self._lock:
                self._take_fault(key, call)
                if key != "getupdates":
                    return self._methods[key](bot, call)
            return await self._get_updates(bot, call)
        except ApiError as exc:
            return exc

    def _answer(self, call: Call, outcome: Any) -> web.Response:
        if isinstance(outcome, ApiError):
            status, body = outcome.status, outcome.body()
        else:
            status, body = 200, {"ok": True, "result": outcome}
        with self._lock:
            call.status = status
            call.description = outcome.description if isinstance(outcome, ApiError) else None
            self._changed()
        return json_response(body, status=status)

    async def _get_updates(self, bot: BotState, call: Call) -> list[dict[str, Any]]:
        """getUpdates: answer at once when updates are pending, else wait up to ``timeout``
        seconds for one. A newer long poll ends this one with 409, as Telegram does."""
        with self._lock:
            if bot.webhook_url:
                raise ApiError(409, _WEBHOOK_ACTIVE)
            limit = min(max(arg_int(call.params, "limit") or 100, 1), 100)
            timeout = min(max(arg_float(call.params, "timeout") or 0.0, 0.0), 50.0)
            self._allow(bot, call.params)
            batch = self._take_updates(bot, arg_int(call.params, "offset") or 0, limit)
            if batch or timeout == 0 or self._stopping:
                return batch
            if bot.poll is not None:
                bot.poll.conflict = _DEFAULT_ERRORS[409]
                bot.poll.signal.set()
            poll = bot.poll = LongPoll()
        try:
            with anyio.move_on_after(timeout):
                while True:
                    await poll.signal
                    with self._lock:
                        if poll.conflict is not None:
                            raise ApiError(409, poll.conflict)
                        batch = self._take_updates(bot, 0, limit)
                        if batch or self._stopping:
                            return batch
                        poll.signal = Signal()
            with self._lock:
                return self._take_updates(bot, 0, limit)
        finally:
            with self._lock:
                if bot.poll is poll:
                    bot.poll = None
                self._changed()

    async def _serve_file(self, request: web.Request) -> web.Response:
        if request.match_info["token"] not in self._bots:
            return json_response(ApiError(401, "Unauthorized").body(), status=401)
        data = self.file_at(request.match_info["path"])
        if data is None:
            return json_response(ApiError(404, "Not Found").body(), status=404)
        return web.Response(body=data, content_type="application/octet-stream")

    # -- webhooks -----------------------------------------------------------------------------

    async def deliver(
        self,
        update: int | dict[str, Any] | None = None,
        *,
        secret: str | None = None,
        token: str | None = None,
    ) -> int:
        """POST an update to the bot's webhook as Telegram does, and return the HTTP status (0
        when the connection failed). ``update`` is a pending update's id, an update object, or
        ``None`` for the oldest pending one. A 2xx confirms it; otherwise it stays pending and
        the error shows in getWebhookInfo: deliver it again to play Telegram's redelivery.
        ``secret`` replaces the secret token header (``""`` sends none).

        Raises:
            RuntimeError: the bot has no webhook set.
            LookupError: no such update is pending.
        """
        with self._lock:
            bot = self._bot(token)
            if not bot.webhook_url:
                raise RuntimeError(f"bot {bot.id} has no webhook: its client must call setWebhook")
            if isinstance(update, dict):
                body = update
            else:
                found = [u for u in bot.queue if update in (None, u["update_id"])]
                if not found:
                    raise LookupError(f"no update {update} is pending for bot {bot.id}")
                body = found[0]
            url, header = bot.webhook_url, bot.webhook_secret if secret is None else secret
        headers = {"Content-Type": "application/json"}
        if header:
            headers[SECRET_HEADER] = header
        try:
            async with (
                aiohttp.ClientSession() as session,
                session.post(url, data=wire_json(body), headers=headers) as response,
            ):
                await response.read()
                status = response.status
                error = f"Wrong response from the webhook: {status} {response.reason}"
        except aiohttp.ClientError as exc:
            status, error = 0, f"Connection failed: {exc}"
        with self._lock:
            if 200 <= status < 300:
                done = body.get("update_id")
                bot.queue = deque(u for u in bot.queue if u["update_id"] != done)
            else:
                bot.webhook_error = (int(time.time()), error)
            self._changed()
        return status

    def deliver_sync(
        self,
        update: int | dict[str, Any] | None = None,
        *,
        secret: str | None = None,
        token: str | None = None,
        timeout: float = 30.0,
    ) -> int:
        """:meth:`deliver`, from a thread other than the server's (:meth:`in_thread`).

        Raises:
            RuntimeError: the server is not running, or this is its own thread.
            TimeoutError: the webhook did not answer within ``timeout`` seconds.
        """
        loop = self._loop
        if loop is None or self._port is None:
            raise RuntimeError("TelegramServer is not running")
        try:
            running: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            running = None  # no loop in this thread: blocking on the server's is fine
        if running is loop:
            raise RuntimeError("deliver_sync would block the server's own loop: await deliver()")
        coro = self.deliver(update, secret=secret, token=token)
        return asyncio.run_coroutine_threadsafe(coro, loop).result(timeout)

    # -- the control endpoint (python -m toren.testing.telegram_server) -----------------------

    async def _control_op(self, request: web.Request) -> web.Response:
        op = request.match_info["op"]
        if op not in _CONTROL_OPS:
            return json_response({"ok": False, "description": f"unknown op {op!r}"}, status=404)
        kwargs = await request.json() if request.can_read_body else {}
        if "data" in kwargs:
            kwargs["data"] = base64.b64decode(kwargs["data"])
        try:
            attribute = getattr(self, op)
            result = attribute(**kwargs) if callable(attribute) else attribute
        except (TypeError, ValueError, KeyError, LookupError) as exc:
            return json_response({"ok": False, "description": str(exc)}, status=400)
        return json_response({"ok": True, "result": _plain(result)})


def _plain(value: Any) -> Any:
    """``value`` as JSON for the control endpoint (records as objects, bytes as base64)."""

    def serialize(_: Any, __: Any, item: Any) -> Any:
        return base64.b64encode(item).decode() if isinstance(item, bytes) else item

    if isinstance(value, list):
        return [_plain(item) for item in value]
    if attrs.has(type(value)):
        return attrs.asdict(value, value_serializer=serialize)
    return value


def main(argv: list[str] | None = None) -> None:
    """Run a server until interrupted; print its URL first."""
    parser = argparse.ArgumentParser(
        prog="python -m toren.testing.telegram_server",
        description="A local Telegram Bot API server for tests, scripted over /_toren/<op>.",
    )
    parser.add_argument("--port", type=int, default=0, help="the port (default: a free one)")
    parser.add_argument("--token", action="append", help="a bot's token (repeat for more bots)")
    parser.add_argument("--username", default="toren_test_bot", help="the first bot's username")
    args = parser.parse_args(argv)
    tokens: list[str] = args.token or ["123:ABC"]

    async def serve() -> None:
        server = TelegramServer(tokens[0], username=args.username, port=args.port, control=True)
        for token in tokens[1:]:
            server.add_bot(token, f"bot{token.split(':')[0]}")
        async with server:
            print(server.url, flush=True)  # the harness reads the URL from stdout
            await anyio.sleep_forever()

    with contextlib.suppress(KeyboardInterrupt):
        anyio.run(serve)


if __name__ == "__main__":
    main()
