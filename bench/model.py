"""The scripted model the agent benchmarks talk to through the real ``anthropic`` SDK.

A run's input names its length (``steps=N ...``): the model asks for the no-op ``lookup`` tool
(or ``transfer``, which needs an approval, for inputs starting ``park``) until the run's N-th
call, which answers. Answers depend only on the conversation, so any number of runs can share
the server. The server counts calls and the time it spent answering them (the "model time"
subtracted from a run's wall time).
"""

from __future__ import annotations

import re
import time
from typing import Any

from aiohttp import web

from toren.testing import AnthropicServer, Reply, Text, ToolCall


def _position(request: dict[str, Any]) -> int:
    return sum(1 for m in request.get("messages", ()) if m.get("role") == "assistant")


def _input(request: dict[str, Any]) -> str:
    first = request["messages"][0]["content"]
    return first if isinstance(first, str) else str(first[0]["text"])


def script(request: dict[str, Any], _n: int) -> Reply:
    text = _input(request)
    found = re.search(r"steps=(\d+)", text)
    steps = int(found.group(1)) if found else 1
    step = _position(request)
    if step + 1 >= steps:
        return Reply(f"Done after {steps} steps.")
    if text.startswith("park"):
        call = ToolCall(id=f"t{step}", name="transfer", arguments={"amount": 10 + step})
    else:
        call = ToolCall(id=f"t{step}", name="lookup", arguments={"key": f"k{step}"})
    return Reply([Text(text=f"Step {step}."), call])


class BenchModel(AnthropicServer):
    """The Anthropic wire protocol, answering from :func:`script`; keeps no request bodies."""

    def __init__(self) -> None:
        super().__init__(script)
        self.calls = 0
        self.busy_seconds = 0.0  # time spent answering (the model time of a call)

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        started = time.perf_counter()
        try:
            return await super()._handle(request)
        finally:
            self.calls += 1
            self.busy_seconds += time.perf_counter() - started
            self.received.clear()  # long runs send megabytes of history; count, don't keep
