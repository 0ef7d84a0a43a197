"""Scripting a model in Toren's terms: a function from the conversation to a reply.

A *model script* receives each request as a :class:`~toren.runs.ModelRequest` (the system
prompt, the conversation as :class:`~toren.runs.Message` turns of :class:`Text`,
:class:`ToolCall` and :class:`~toren.runs.ToolResult` blocks, the tools offered) and returns a
:class:`Reply` (or a string, or a :class:`Fail` or :class:`Disconnect` step). Wrapped in a
:class:`ScriptedModel`, the same function scripts :class:`AnthropicServer`, :class:`OpenAIServer`
and :class:`BedrockServer` alike, each server reading its own wire format back into Toren's
vocabulary, and ``toren dev --model-script MODULE:FN`` runs an app's agents against it::

    def script(request: ModelRequest) -> Reply:
        if turns(request) == 0:
            return Reply([ToolCall(id="c1", name="lookup_order", arguments={"order_id": "A-17"})])
        return Reply(f"The order says: {latest_results(request)[0].content}")

    async with AnthropicServer(ScriptedModel(script)) as server: ...

A script that raises, or returns something else, is answered with a 400 in the provider's error
format naming the script and the error (not retryable: the same conversation would fail the same
way), and the traceback is logged on ``toren.testing``.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import sys
import threading
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import cast

import anyio

from toren._agent.model import Message, ModelRequest, Text, ToolResult
from toren._core.errors import ConfigError
from toren.testing._steps import Disconnect, Fail, Reply, Step

__all__ = [
    "ModelScript",
    "ScriptedModel",
    "latest_results",
    "latest_text",
    "load_script",
    "turns",
]

logger = logging.getLogger("toren.testing")

ModelScript = Callable[[ModelRequest], "Step | str | Awaitable[Step | str]"]
"""A function (or coroutine function) from a request to the model's answer."""


class ScriptedModel:
    """A model scripted by ``fn``, for any of the scripted servers.

    ``name`` is how errors name the script (default: the function's module and name).

    Raises:
        TypeError: ``fn`` is not callable.
    """

    def __init__(self, fn: ModelScript, *, name: str | None = None) -> None:
        if not callable(fn):
            raise TypeError(f"a model script must be callable, not {type(fn).__name__}")
        self.fn = fn
        self._one_at_a_time = threading.Lock()  # not bound to an event loop, unlike anyio's
        self.name = name or f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', fn)}"

    async def answer(self, request: ModelRequest) -> Step:
        """The step the script answers ``request`` with; a script that raises or returns
        something other than a step or a string is answered with a 400 saying so."""
        try:
            result: object  # a user's function: any type may come back
            if inspect.iscoroutinefunction(self.fn):
                result = await self.fn(request)
            else:
                # A plain function runs in a thread, one call at a time, so a script that
                # blocks (time.sleep, a file read) holds neither the server's nor a worker's
                # event loop sharing the process (toren dev, the harness).
                result = await anyio.to_thread.run_sync(self._call, request)
            if inspect.isawaitable(result):
                result = cast(object, await result)
        # A script that exits (sys.exit(), exit()) fails its request, not the process serving
        # it (toren dev, a test run).
        except (Exception, SystemExit) as exc:
            logger.exception("model script %s raised", self.name)
            return self.refusal(f"raised {type(exc).__name__}: {exc}")
        if isinstance(result, str):
            return Reply(result)
        if isinstance(result, Reply | Fail | Disconnect):
            return result
        return self.refusal(
            f"returned {type(result).__name__}; return a Reply, a string, a Fail or a Disconnect"
        )

    def _call(self, request: ModelRequest) -> object:
        with self._one_at_a_time:
            return self.fn(request)

    def refusal(self, what: str) -> Fail:
        """The answer to a request the script could not answer (``what`` says why)."""
        return Fail(status=400, message=f"the model script {self.name} {what}")

    def __repr__(self) -> str:
        return f"ScriptedModel({self.name})"


def load_script(spec: str) -> ScriptedModel:
    """The model script ``MODULE:FN`` names, imported as ``--app`` modules are (the current
    directory first on ``sys.path``).

    Raises:
        ConfigError: ``spec`` is not ``MODULE:FN``, the module cannot be imported (the message
            names the real cause), it has no ``FN``, or ``FN`` is not callable.
    """
    module_name, sep, attr = spec.partition(":")
    hint = "Pass --model-script as MODULE:FN, e.g. myagents.model:script."
    if not sep or not module_name or not attr:
        raise ConfigError(f"model script {spec!r} is not MODULE:FN", hint=hint)
    if str(Path.cwd()) not in sys.path:
        sys.path.insert(0, str(Path.cwd()))
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(
            f"cannot import model script module {module_name!r}: {exc}", hint=hint
        ) from exc
    except SystemExit as exc:  # a program's main() run at import: never a silent exit
        raise ConfigError(
            f"model script module {module_name!r} called sys.exit({exc.code!r}) while it was "
            "imported",
            hint='Run the program only under `if __name__ == "__main__":`.',
        ) from None
    except Exception as exc:  # noqa: BLE001  (the user's module failed while importing)
        raise ConfigError(
            f"model script module {module_name!r} failed to import: {type(exc).__name__}: {exc}",
            hint="Fix the error in that module (run `python -c 'import MODULE'` to see where).",
        ) from None
    fn = getattr(module, attr, None)
    if fn is None:
        raise ConfigError(f"model script module {module_name!r} has no {attr!r}", hint=hint)
    if not callable(fn):
        raise ConfigError(
            f"model script {spec!r} is a {type(fn).__name__}, not a function",
            hint="FN must be a function taking a toren.runs.ModelRequest and returning a Reply.",
        )
    return ScriptedModel(fn, name=spec)


def turns(request: ModelRequest) -> int:
    """How many times the model has answered in this conversation (its assistant turns)."""
    return sum(1 for m in request.messages if m.role == "assistant")


def _latest_user(request: ModelRequest) -> Message | None:
    for message in reversed(request.messages):
        if message.role == "user":
            return message
    return None


def latest_text(request: ModelRequest) -> str:
    """The text of the latest user turn ("" when it holds only tool results)."""
    message = _latest_user(request)
    if message is None:
        return ""
    return "\n".join(b.text for b in message.content if isinstance(b, Text))


def latest_results(request: ModelRequest) -> list[ToolResult]:
    """The tool results in the latest user turn, in order (empty when it holds none)."""
    message = _latest_user(request)
    if message is None:
        return []
    return [b for b in message.content if isinstance(b, ToolResult)]
