"""Actors the tests run, in process and in worker processes (``toren worker --app tests.app``)."""

from __future__ import annotations

import os
import weakref
from pathlib import Path
from typing import Any

import anyio
import attrs

from toren import Actor, ChildFailed, Context, PoisonMessage, message

# --- counter -----------------------------------------------------------------------------------


@message("test.add")
@attrs.frozen(kw_only=True)
class Add:
    n: int
    tag: str


@message("test.added")
@attrs.frozen(kw_only=True)
class Added:
    n: int
    tag: str
    message_id: int


@message("test.get")
@attrs.frozen
class Get:
    pass


@attrs.frozen(kw_only=True)
class CounterState:
    total: int = 0
    tags: tuple[str, ...] = ()


class Counter(Actor[CounterState]):
    kind = "test.counter"
    idle_seconds = 1.0
    handled = 0  # handler runs in this process (committed or not)

    def initial_state(self) -> CounterState:
        return CounterState()

    def apply(self, state: CounterState, event: Any) -> CounterState:
        if isinstance(event, Added):
            return CounterState(total=state.total + event.n, tags=(*state.tags, event.tag))
        return state

    async def handle(self, ctx: Context[CounterState], msg: Any) -> None:
        Counter.handled += 1
        if isinstance(msg, Add):
            assert ctx.envelope is not None
            ctx.emit(Added(n=msg.n, tag=msg.tag, message_id=ctx.envelope.id))
        elif isinstance(msg, Get):
            ctx.reply({"total": ctx.state.total})


class SnapshotCounter(Counter):
    kind = "test.snapshot_counter"
    snapshot_every = 10
    state_type = CounterState


# --- poison ------------------------------------------------------------------------------------


@message("test.boom")
@attrs.frozen(kw_only=True)
class Boom:
    tag: str


@message("test.handled")
@attrs.frozen(kw_only=True)
class Handled:
    tag: str


class Fragile(Actor[list[str]]):
    """Raises on Boom, records everything else."""

    kind = "test.fragile"
    max_attempts = 3
    retry_base_seconds = 0.01
    idle_seconds = 0.5

    def initial_state(self) -> list[str]:
        return []

    def apply(self, state: list[str], event: Any) -> list[str]:
        return [*state, event.tag] if isinstance(event, Handled) else state

    async def handle(self, ctx: Context[list[str]], msg: Any) -> None:
        if isinstance(msg, Boom):
            raise ValueError(f"cannot handle {msg.tag}")
        ctx.emit(Handled(tag=msg.tag))


class Mourner(Fragile):
    """Raises on Boom; as a message is dead-lettered, records it and tells ``fragile/listener``
    and an actor that does not exist."""

    kind = "test.mourner"

    def on_dead_letter(self, ctx: Context[list[str]], msg: Any, error: str) -> None:
        tag = msg.tag if isinstance(msg, Boom) else "?"
        ctx.emit(Handled(tag=f"gave up on {tag}"))
        ctx.send("fragile/listener", Handled(tag=f"news of {tag}"))
        ctx.send("nobody/here", Handled(tag=f"news of {tag}"))


@message("test.forward")
@attrs.frozen(kw_only=True)
class Forward:
    to: str
    boom: bool
    tag: str


@message("test.told")
@attrs.frozen(kw_only=True)
class Told:
    kind: str
    detail: str


class Relay(Actor[list[str]]):
    """Sends on behalf of tests; records PoisonMessage and ChildFailed notices it receives."""

    kind = "test.relay"
    idle_seconds = 0.5

    def initial_state(self) -> list[str]:
        return []

    def apply(self, state: list[str], event: Any) -> list[str]:
        return [*state, f"{event.kind}:{event.detail}"] if isinstance(event, Told) else state

    async def handle(self, ctx: Context[list[str]], msg: Any) -> None:
        if isinstance(msg, Forward):
            ctx.send(msg.to, Boom(tag=msg.tag) if msg.boom else Handled(tag=msg.tag))
        elif isinstance(msg, PoisonMessage):
            ctx.emit(Told(kind="poison", detail=f"{msg.actor_id}/{msg.message_id}"))
        elif isinstance(msg, ChildFailed):
            ctx.emit(Told(kind="child_failed", detail=msg.actor_id))
        elif isinstance(msg, dict) and "spawn" in msg:
            ctx.spawn(msg["kind"], msg["spawn"])
            ctx.send(msg["spawn"], {"hello": True})


bad_starts: list[str] = []


class BadStart(Actor[int]):
    """Fails on every start (state rebuild succeeded; on_start raises)."""

    kind = "test.bad_start"

    def initial_state(self) -> int:
        return 0

    def apply(self, state: int, event: Any) -> int:
        return state

    async def on_start(self, ctx: Context[int]) -> None:
        bad_starts.append(ctx.actor_id)
        raise RuntimeError("refusing to start")

    async def handle(self, ctx: Context[int], msg: Any) -> None:
        raise AssertionError("never reached")


# --- slow work, timers, weak references ------------------------------------------------------


@message("test.work")
@attrs.frozen(kw_only=True)
class Work:
    seconds: float
    tag: str
    only_first_delivery: bool = False
    # Wait, after ``seconds``, until the file TOREN_TEST_GATE names exists: a test holds the
    # message in hand for as long as it needs (a worker's start-up under load is not bounded).
    gated: bool = False


async def _gate_opened(gate: Path, deadline: float = 120.0) -> None:
    """Wait until the test creates ``gate``; past ``deadline`` the handler fails (charged to its
    message, visible to the test) instead of holding its worker for ever."""
    with anyio.fail_after(deadline):
        while not gate.exists():
            await anyio.sleep(0.05)


@message("test.worked")
@attrs.frozen(kw_only=True)
class Worked:
    tag: str
    pid: int
    deliveries: int


class Worker(Actor[list[str]]):
    """Sleeps while handling, to give tests a message in hand."""

    kind = "test.worker"
    idle_seconds = 30.0

    def initial_state(self) -> list[str]:
        return []

    def apply(self, state: list[str], event: Any) -> list[str]:
        return [*state, event.tag] if isinstance(event, Worked) else state

    async def handle(self, ctx: Context[list[str]], msg: Any) -> None:
        assert ctx.envelope is not None
        marker = os.environ.get("TOREN_TEST_HANDLING")
        if marker:
            Path(marker).write_text(f"{os.getpid()} {msg.tag} {ctx.envelope.deliveries}\n")
        if not msg.only_first_delivery or ctx.envelope.deliveries == 1:
            await anyio.sleep(msg.seconds)
            if msg.gated:
                await _gate_opened(Path(os.environ["TOREN_TEST_GATE"]))
        ctx.emit(Worked(tag=msg.tag, pid=os.getpid(), deliveries=ctx.envelope.deliveries))


@message("test.arm")
@attrs.frozen(kw_only=True)
class Arm:
    seconds: float


@message("test.fire")
@attrs.frozen
class Fire:
    pass


@message("test.timer_event")
@attrs.frozen(kw_only=True)
class TimerEvent:
    what: str
    pid: int


class Alarm(Actor[list[str]]):
    kind = "test.alarm"
    idle_seconds = 0.3

    def initial_state(self) -> list[str]:
        return []

    def apply(self, state: list[str], event: Any) -> list[str]:
        return [*state, event.what] if isinstance(event, TimerEvent) else state

    async def handle(self, ctx: Context[list[str]], msg: Any) -> None:
        if isinstance(msg, Arm):
            ctx.set_timer("alarm", msg.seconds, Fire())
            ctx.emit(TimerEvent(what="armed", pid=os.getpid()))
        elif isinstance(msg, Fire):
            assert ctx.envelope is not None
            assert ctx.envelope.is_timer
            ctx.emit(TimerEvent(what="fired", pid=os.getpid()))


live_objects: list[weakref.ref[Any]] = []


class Tracked(Counter):
    """A counter whose instances tests can watch through weak references."""

    kind = "test.tracked"
    idle_seconds = 0.2

    def __init__(self, actor_id: str, args: Any) -> None:
        super().__init__(actor_id, args)
        live_objects.append(weakref.ref(self))
