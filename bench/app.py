"""What the benchmarks run in their worker processes (``--app bench.app``).

- :class:`Holder` (takeover): sleeps on the first delivery of a message, so a worker can be
  killed with the message in hand.
- :class:`Counter` (kernel step): handles a message by appending one event, nothing else; the
  like-for-like peer of a DBOS no-op step.
- :class:`Pacer` (sizing): the same step, chained until a wall-clock instant instead of a count,
  so that actors spread over several workers stay busy for one window whatever their rate.
- the ``bench`` agent (agent step, replay, parked runs): calls the scripted model, which asks
  for the no-op ``lookup`` tool until the run's step budget is spent (see :mod:`bench.model`).
  ``bench_approve`` needs an approval for its tool call: its runs park.
"""

from __future__ import annotations

import os
import time
from typing import Any

import anyio
import attrs

from toren import Actor, Agent, Context, ToolContext, message, tool


@message("bench.hold")
@attrs.frozen(kw_only=True)
class Hold:
    """Handled by sleeping on first delivery (a message in hand at the kill), at once after."""

    seconds: float
    marker: str


@message("bench.held")
@attrs.frozen(kw_only=True)
class Held:
    pid: int
    deliveries: int


class Holder(Actor[int]):
    kind = "bench.holder"
    idle_seconds = 60.0

    def initial_state(self) -> int:
        return 0

    def apply(self, state: int, event: Any) -> int:
        return state + 1

    async def handle(self, ctx: Context[int], msg: Any) -> None:
        if ctx.envelope is None:
            raise RuntimeError("handle() without an envelope")
        if ctx.envelope.deliveries == 1:
            await anyio.Path(msg.marker).write_text(str(os.getpid()))
            await anyio.sleep(msg.seconds)
        ctx.emit(Held(pid=os.getpid(), deliveries=ctx.envelope.deliveries))


@message("bench.tick")
@attrs.frozen(kw_only=True)
class Tick:
    n: int
    last: int  # the actor sends itself the next tick until this one


@message("bench.ticked")
@attrs.frozen(kw_only=True)
class Ticked:
    n: int


class Counter(Actor[int]):
    """One message in, one event out, and the next tick sent to itself (as a run sends itself
    ``Continue``): a chain of kernel steps with nothing else in them."""

    kind = "bench.counter"
    idle_seconds = 5.0

    def initial_state(self) -> int:
        return 0

    def apply(self, state: int, event: Any) -> int:
        return state + 1

    async def handle(self, ctx: Context[int], msg: Any) -> None:
        ctx.emit(Ticked(n=msg.n))
        if msg.n < msg.last:
            ctx.send(ctx.actor_id, Tick(n=msg.n + 1, last=msg.last))


@message("bench.pace")
@attrs.frozen(kw_only=True)
class Pace:
    n: int
    until: float  # the actor sends itself the next one until this instant (time.time())


class Pacer(Actor[int]):
    """:class:`Counter`'s step, chained until ``until`` has passed."""

    kind = "bench.pacer"
    idle_seconds = 5.0

    def initial_state(self) -> int:
        return 0

    def apply(self, state: int, event: Any) -> int:
        return state + 1

    async def handle(self, ctx: Context[int], msg: Any) -> None:
        ctx.emit(Ticked(n=msg.n))
        if time.time() < msg.until:
            ctx.send(ctx.actor_id, Pace(n=msg.n + 1, until=msg.until))


@tool(effects="read")
async def lookup(ctx: ToolContext, key: str) -> str:
    """Look a key up (returns at once)."""
    return f"value of {key}"


@tool(effects="external", idempotency="keyed", approval=lambda args: True)
async def transfer(ctx: ToolContext, amount: float) -> str:
    """Move money (a person approves every transfer)."""
    return f"moved {amount:g}"


bench = Agent(name="bench", model="anthropic/claude-sonnet-4-6", tools=[lookup])
bench_approve = Agent(name="bench_approve", model="anthropic/claude-sonnet-4-6", tools=[transfer])
