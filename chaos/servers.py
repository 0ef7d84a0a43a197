"""The outside world of a chaos run: the scripted model and a tracker that counts effects."""

from __future__ import annotations

import socket
import time
from types import TracebackType
from typing import Any, Self

import anyio
import attrs
from aiohttp import web

from toren.testing import Hold, Reply, Text, ToolCall

FINAL = "Ticket opened, refund made, and I waited for the courier."
CALLEE_FINAL = "Ticket opened for the caller."
SANDBOX_FINAL = "The steps ran; their log is in log.txt."
CALLER_SAYS = "The callee says: "
MODEL_LATENCY = 0.1  # seconds of "thinking" per model call: runs overlap lease renewals
SLEEP_SECONDS = 1.5  # the run passivates (after 0.5 s idle) well before its timer fires


def position(request: dict[str, Any]) -> int:
    """The step a model request is for: the assistant turns it carries."""
    return sum(1 for m in request.get("messages", ()) if m.get("role") == "assistant")


def case(request: dict[str, Any]) -> str:
    """The run a request belongs to: its first user message (the run's input)."""
    first = request["messages"][0]["content"]
    return first if isinstance(first, str) else first[0]["text"]


def agent_of(request: dict[str, Any]) -> str:
    """The agent a request comes from, for the call script (its system prompt starts with its
    name and a colon); ``""`` for the ``chaos`` agent."""
    name, colon, _ = system_of(request).partition(":")
    known = ("caller", "callee", "sandbox", "telegram", "schedule", "versioned")
    return name if colon and name in known else ""


def child_input(parent_input: str) -> str:
    """What the caller asks the callee, for a run whose input is ``parent_input``."""
    return f"look into {parent_input}"


def _tool_results(request: dict[str, Any]) -> list[str]:
    """The tool results the request's last turn carries."""
    content = request["messages"][-1].get("content")
    out = []
    for block in content if isinstance(content, list) else ():
        if block.get("type") == "tool_result":
            inner = block.get("content")
            if isinstance(inner, list):
                inner = "".join(c.get("text", "") for c in inner)
            out.append(str(inner))
    return out


def call_script(request: dict[str, Any]) -> Reply:
    """The cross-agent call: the caller calls the callee once and answers with what it said;
    the callee opens a ticket (a keyed external effect), then answers."""
    step = position(request)
    if agent_of(request) == "caller":
        if step == 0:
            ask = ToolCall(
                id="c0", name="call_callee", arguments={"input": child_input(case(request))}
            )
            return Reply([Text(text="Asking the callee."), ask], latency=MODEL_LATENCY)
        return Reply(f"{CALLER_SAYS}{' | '.join(_tool_results(request))}", latency=MODEL_LATENCY)
    if step == 0:
        ticket = ToolCall(id="t0", name="open_ticket", arguments={"title": case(request)})
        return Reply([Text(text="Opening a ticket."), ticket], latency=MODEL_LATENCY)
    return Reply(CALLEE_FINAL, latency=MODEL_LATENCY)


# The sandbox cells' script, written into the workspace by the model and run twice: each run
# appends a line when it starts and one when it ends, so the log counts the runs of each command
# and tells a finished one from one killed half-way.
STEP_PY = """\
import sys
import time

name = sys.argv[1]
seconds = float(sys.argv[2]) if len(sys.argv) > 2 else 0.0
with open("log.txt", "a") as log:
    log.write(name + " start\\n")
time.sleep(seconds)
with open("log.txt", "a") as log:
    log.write(name + " end\\n")
print(name, "done")
"""
LONG_SECONDS = 1.5
SANDBOX_LATENCY = 0.02  # the sandbox cells' model answers at once: their time goes to Docker
# The sandboxed calls, by model step: list the (empty) workspace, which makes the container;
# write the script; run it quickly; run it long; look for leftover processes, and for the
# records of commands (/run/toren) that the sandbox should have dropped; then answer.
SANDBOX_CALLS = (
    ToolCall(id="s0", name="list_files", arguments={"path": "."}),
    ToolCall(id="s1", name="write_file", arguments={"path": "step.py", "content": STEP_PY}),
    ToolCall(id="s2", name="bash", arguments={"command": "python3 step.py quick"}),
    ToolCall(id="s3", name="bash", arguments={"command": f"python3 step.py long {LONG_SECONDS:g}"}),
    ToolCall(id="s4", name="bash", arguments={"command": "ps -eo args"}),
    ToolCall(id="s5", name="bash", arguments={"command": "ls /run/toren"}),
)
SANDBOX_COMMANDS = ("quick", "long")  # the names step.py writes into the log


def sandbox_script(request: dict[str, Any]) -> Reply:
    """The sandbox cells: one sandboxed call per step, then the answer."""
    step = position(request)
    if step < len(SANDBOX_CALLS):
        return Reply([Text(text=f"Step {step}."), SANDBOX_CALLS[step]], latency=SANDBOX_LATENCY)
    return Reply(SANDBOX_FINAL, latency=SANDBOX_LATENCY)


# The Telegram cells' answers, one per message of the chat, by position: the second is long
# enough to go out as three Telegram messages (4096 UTF-16 units each; the emoji count two), each
# piece distinct, so that the chat shows the order they arrived in.
TELEGRAM_LATENCY = 0.05
TELEGRAM_REPLIES = (
    "First answer: the case is open.",
    "".join(
        f"{i:03d} \N{SLIGHTLY SMILING FACE} the long answer goes on, line by line, till it is cut\n"
        for i in range(155)
    ),
    "Third answer: glad to help.",
)


def telegram_script(request: dict[str, Any]) -> Reply:
    """The Telegram cells: the k-th message of the chat gets the k-th answer."""
    step = position(request)
    return Reply(TELEGRAM_REPLIES[min(step, len(TELEGRAM_REPLIES) - 1)], latency=TELEGRAM_LATENCY)


# The schedule cells' runs: one answer each, at once (their time goes to the clock).
SCHEDULE_LATENCY = 0.02


def schedule_answer(run_input: str) -> str:
    """What a run of the ``ticker`` agent answers: its input, noted."""
    return f"Noted: {run_input}."


# The version cells' run: the chaos run's ticket and refund, then the answer (no timer).
VERSIONED_FINAL = "Ticket opened and refund made."
VERSIONED_LATENCY = 0.05


def versioned_script(request: dict[str, Any]) -> Reply:
    """The version cells: a ticket (keyed, external), a refund (keyed, external, approved by a
    person), the answer; by position, whatever the system prompt's version."""
    step = position(request)
    calls = {
        0: ToolCall(id="t0", name="open_ticket", arguments={"title": case(request)}),
        1: ToolCall(id="t1", name="refund", arguments={"amount": 120}),
    }
    if step in calls:
        return Reply([Text(text=f"Step {step}."), calls[step]], latency=VERSIONED_LATENCY)
    return Reply(VERSIONED_FINAL, latency=VERSIONED_LATENCY)


def system_of(request: dict[str, Any]) -> str:
    """A request's system prompt, as text."""
    system = request.get("system") or ""
    if isinstance(system, list):
        system = "".join(b.get("text", "") for b in system)
    return str(system)


def script(request: dict[str, Any], _n: int) -> Reply:
    """Answer by conversation position, so a call repeated after a crash gets the same answer."""
    if agent_of(request) == "versioned":
        return versioned_script(request)
    if agent_of(request) == "schedule":
        return Reply(schedule_answer(case(request)), latency=SCHEDULE_LATENCY)
    if agent_of(request) == "sandbox":
        return sandbox_script(request)
    if agent_of(request) == "telegram":
        return telegram_script(request)
    if agent_of(request):
        return call_script(request)
    step = position(request)
    calls = {
        0: ToolCall(id="t0", name="open_ticket", arguments={"title": case(request)}),
        1: ToolCall(id="t1", name="refund", arguments={"amount": 120}),
        2: ToolCall(id="t2", name="sleep", arguments={"seconds": SLEEP_SECONDS}),
    }
    if step in calls:
        return Reply([Text(text=f"Step {step}."), calls[step]], latency=MODEL_LATENCY)
    return Reply(FINAL, latency=MODEL_LATENCY)


@attrs.define
class Effect:
    """One effect applied in the outside world, under one idempotency key."""

    key: str
    run: str
    kind: str
    detail: str
    applied_at: float  # wall clock, comparable with Postgres' now()
    requests: int = 1


class EffectServer:
    """A tracker: ``POST /effects`` applies the effect named by its idempotency key once; every
    request is counted. ``hold(n)`` keeps the n-th request's answer back after its effect was
    applied (the worker sees neither success nor failure)."""

    def __init__(self) -> None:
        self.effects: dict[str, Effect] = {}
        self.requests = 0
        self._holds: dict[int, Hold] = {}
        self._runner: web.AppRunner | None = None
        self.url = ""

    def hold(self, n: int) -> Hold:
        hold = self._holds[n] = Hold(n)
        return hold

    def release(self) -> None:
        for hold in self._holds.values():
            hold.release()

    async def _effect(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.requests += 1
        n = self.requests
        key = request.headers["Idempotency-Key"]
        found = self.effects.get(key)
        if found is None:
            self.effects[key] = Effect(
                key=key,
                run=body["run"],
                kind=body["kind"],
                detail=body["detail"],
                applied_at=time.time(),
            )
        else:
            found.requests += 1
        hold = self._holds.get(n)
        if hold is not None:
            hold.arrived.set()
            await hold.wait_released()
        return web.json_response({"applied": found is None})

    async def __aenter__(self) -> Self:
        app = web.Application()
        app.router.add_post("/effects", self._effect)
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await self._runner.setup()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("127.0.0.1", 0))
        await web.SockSite(self._runner, sock).start()
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.release()
        if self._runner is not None:
            with anyio.CancelScope(shield=True):
                await self._runner.cleanup()
