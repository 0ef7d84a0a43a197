"""Static supervisors: a fixed, ordered list of children restarted by an OTP strategy.

Each child runs in its own task inside the supervisor's task group, wrapped so that an exception
ends only that child and is handed to the supervisor as an exit. All decisions (restart, stop
siblings, escalate) are taken by one loop, so strategies never race with each other.
"""

from __future__ import annotations

import enum
import logging
import math
import random as _random
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence

import anyio
import attrs
from anyio.abc import TaskGroup, TaskStatus
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from toren import MemoryRestartStore, RestartStore, SupervisorEscalation
from toren.supervisors._backoff import Backoff

logger = logging.getLogger(__name__)

DEFAULT_BACKOFF = Backoff()


class Strategy(enum.Enum):
    """Which siblings are restarted together with a child that exited."""

    ONE_FOR_ONE = "one_for_one"
    """Only the child that exited."""
    ONE_FOR_ALL = "one_for_all"
    """Every child: the others are stopped in reverse order, then all start again in order."""
    REST_FOR_ONE = "rest_for_one"
    """The child that exited and every child started after it."""


class Restart(enum.Enum):
    """Whether a child that exited is restarted."""

    PERMANENT = "permanent"
    """Always, whether it returned or raised."""
    TRANSIENT = "transient"
    """Only if it raised (an abnormal exit)."""
    TEMPORARY = "temporary"
    """Never; also not when a strategy stops it because a sibling failed."""


class Ready(enum.Enum):
    """When a starting child counts as started, letting the next one start."""

    EXPLICIT = "explicit"
    """When it calls :meth:`ChildContext.started` (its mailbox, socket or lease is live)."""
    IMMEDIATE = "immediate"
    """As soon as its coroutine begins; for children nobody depends on."""


@attrs.define(kw_only=True, eq=False)
class ChildContext:
    """What a child's coroutine receives from its supervisor; one per incarnation.

    Attributes:
        id: The child's id (its :attr:`ChildSpec.id`).
        restarts: How many times this child was started before this incarnation (0 at first).
        stopping: Set when the supervisor asks the child to stop. A graceful child should return
            soon after; when its shutdown timeout expires it is cancelled anyway.
    """

    id: str
    restarts: int = 0
    stopping: anyio.Event = attrs.field(factory=anyio.Event)
    _settled: anyio.Event = attrs.field(factory=anyio.Event, init=False, repr=False)
    _ready: bool = attrs.field(default=False, init=False)
    _value: object = attrs.field(default=None, init=False, repr=False)

    def started(self, value: object = None) -> None:
        """Signal that the child is ready; the supervisor then starts the next child.

        Calling it again does nothing: the first value is kept. A child that exits without
        calling it has failed to start, and its exit is handled like any other.

        Args:
            value: Handed to whoever waits for the start (``DynamicSupervisor.start_child``
                returns it).
        """
        if self._ready:
            return
        self._ready = True
        self._value = value
        self._settled.set()


@attrs.frozen(kw_only=True)
class ChildSpec:
    """How to run and restart one child.

    Attributes:
        id: Unique among the supervisor's children; also names its restart window.
        run: The child's coroutine function. Returning is a normal exit, raising an abnormal
            one; either way the :attr:`restart` type decides what follows.
        restart: Whether the child is restarted after it exits.
        ready: When the child counts as started (see :class:`Ready`).
        graceful: If true, stopping the child sets ``ctx.stopping`` and waits up to
            ``shutdown_timeout`` for it to return before cancelling it; if false it is cancelled
            at once.
        shutdown_timeout: Seconds a graceful child gets to return once asked to stop;
            ``math.inf`` to wait for as long as it takes (use it for child supervisors).

    Raises:
        ValueError: On construction, if ``id`` is empty or ``shutdown_timeout`` is negative.
    """

    id: str = attrs.field(validator=attrs.validators.min_len(1))
    run: Callable[[ChildContext], Awaitable[None]]
    restart: Restart = Restart.PERMANENT
    ready: Ready = Ready.EXPLICIT
    graceful: bool = False
    shutdown_timeout: float = attrs.field(default=5.0, validator=attrs.validators.ge(0.0))


@attrs.define(eq=False)
class _Child:
    """One incarnation of a child, as the supervisor tracks it."""

    spec: ChildSpec
    ctx: ChildContext
    scope: anyio.CancelScope = attrs.field(factory=anyio.CancelScope)
    done: anyio.Event = attrs.field(factory=anyio.Event)
    error: Exception | None = None

    @property
    def ready(self) -> bool:
        return self.ctx._ready

    @property
    def value(self) -> object:
        return self.ctx._value


def _restart_due(restart: Restart, error: Exception | None) -> bool:
    if restart is Restart.PERMANENT:
        return True
    return restart is Restart.TRANSIENT and error is not None


async def _run_child(child: _Child, on_exit: Callable[[_Child], None] | None) -> None:
    """Run one incarnation; its exception is recorded, never raised into the task group."""
    try:
        with child.scope:
            if child.spec.ready is Ready.IMMEDIATE:
                child.ctx.started()
            await child.spec.run(child.ctx)
    # The child's failure becomes its exit reason; raising it would cancel every sibling.
    except Exception as exc:  # noqa: BLE001
        child.error = exc
    finally:
        child.done.set()
        child.ctx._settled.set()
        if on_exit is not None:
            on_exit(child)


async def _start_child(
    tg: TaskGroup, child: _Child, on_exit: Callable[[_Child], None] | None = None
) -> bool:
    """Start ``child`` in ``tg`` and wait until it is ready or has exited.

    Returns:
        Whether it signalled readiness; false if it exited first (a failure to start).
    """
    tg.start_soon(_run_child, child, on_exit, name=f"child {child.spec.id}")
    await child.ctx._settled.wait()
    return child.ready


async def _stop_child(child: _Child) -> None:
    """Ask ``child`` to stop, give a graceful child its timeout, then cancel it.

    Safe to call again if interrupted, and on a child that already exited.
    """
    child.ctx.stopping.set()
    if child.spec.graceful:
        with anyio.move_on_after(child.spec.shutdown_timeout):
            await child.done.wait()
    child.scope.cancel()
    await child.done.wait()


async def _forward_stop(
    stopping: anyio.Event, request_stop: Callable[[], None], scope: anyio.CancelScope
) -> None:
    """Turn a parent's stop request into this supervisor's own (it runs as a child)."""
    with scope:
        await stopping.wait()
        request_stop()


@attrs.define(eq=False)
class _Run:
    """The state of one ``Supervisor.run`` call."""

    tg: TaskGroup
    exits: MemoryObjectSendStream[_Child]
    exited: MemoryObjectReceiveStream[_Child]
    finished: anyio.Event
    running: dict[str, _Child] = attrs.Factory(dict)
    dropped: set[str] = attrs.Factory(set)
    starts: Counter[str] = attrs.Factory(Counter)
    stop_requested: bool = False
    # The scope of the decision being taken now; stop() cancels it so that a backoff sleep or a
    # restart in progress does not delay the shutdown.
    busy: anyio.CancelScope | None = None


class Supervisor:
    """Runs a fixed list of children and restarts them by an OTP strategy.

    Children start in order, each once the previous one is ready, and stop in reverse order.
    When a child exits and its :class:`Restart` type calls for a restart, the restart is recorded
    in the store under ``f"{name}/{child_id}"``; if more than ``intensity`` restarts of that child
    fall within ``period`` seconds the supervisor gives up: it stops all children in reverse order
    and raises :class:`toren.SupervisorEscalation`. Otherwise it waits the backoff delay and applies
    its :class:`Strategy`.

    A supervisor can be the child of another: use :meth:`child_spec`, or pass :meth:`run` as a
    :class:`ChildSpec`'s ``run``. Its escalation is then the parent's abnormal child exit, and the
    parent's restart runs it afresh (restart windows live in the store and carry over, so a child
    that keeps crashing escalates again sooner). The same object may run again after ``run``
    returns, but not twice at once.
    """

    def __init__(
        self,
        name: str,
        children: Sequence[ChildSpec],
        *,
        strategy: Strategy = Strategy.ONE_FOR_ONE,
        intensity: int = 3,
        period: float = 5.0,
        backoff: Backoff = DEFAULT_BACKOFF,
        store: RestartStore | None = None,
        sleep: Callable[[float], Awaitable[None]] = anyio.sleep,
        random: Callable[[], float] = _random.random,
    ) -> None:
        """Describe the supervisor; nothing runs until :meth:`run`.

        Args:
            name: Names the supervisor in errors and prefixes its restart-window keys.
            children: The children, in start order.
            strategy: Which siblings restart with a child that exited.
            intensity: Most restarts of one child tolerated within ``period``.
            period: The restart window, in seconds.
            backoff: Delay before each restart.
            store: Where restarts are counted; an in-process store by default.
            sleep: Waits out the backoff; injectable so that tests need not wait.
            random: Source of backoff jitter in ``[0, 1)``.

        Raises:
            ValueError: If two children share an id, ``intensity`` is negative or ``period`` is
                not positive.
        """
        ids = [spec.id for spec in children]
        if duplicates := sorted({i for i in ids if ids.count(i) > 1}):
            raise ValueError(f"supervisor {name!r}: duplicate child ids {duplicates}")
        if intensity < 0:
            raise ValueError(f"supervisor {name!r}: intensity must be >= 0, got {intensity}")
        if not period > 0:
            raise ValueError(f"supervisor {name!r}: period must be > 0, got {period}")
        self.name = name
        self.strategy = strategy
        self.intensity = intensity
        self.period = period
        self._specs = list(children)
        self._backoff = backoff
        self._store: RestartStore = store if store is not None else MemoryRestartStore()
        self._sleep = sleep
        self._random = random
        self._current: _Run | None = None

    def child_spec(
        self, *, restart: Restart = Restart.PERMANENT, shutdown_timeout: float = math.inf
    ) -> ChildSpec:
        """A spec that runs this supervisor as a child of another, under its own name.

        The parent's stop request becomes an ordered shutdown of this supervisor's children,
        which by default may take as long as their own timeouts add up to.
        """
        return ChildSpec(
            id=self.name,
            run=self.run,
            restart=restart,
            graceful=True,
            shutdown_timeout=shutdown_timeout,
        )

    def child_ids(self) -> list[str]:
        """Ids of the children running now (starting, ready, or being stopped), in start order."""
        run = self._current
        if run is None:
            return []
        return [spec.id for spec in self._specs if spec.id in run.running]

    async def run(
        self,
        ctx: ChildContext | None = None,
        *,
        task_status: TaskStatus[Supervisor] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        """Start the children in order and supervise them until stopped.

        ``task_status.started(self)`` (and ``ctx.started(self)``) is called once every child
        is ready. Cancelling this call cancels all children at once, in no particular order; use
        :meth:`stop` for an ordered shutdown.

        Args:
            ctx: Given when this supervisor runs as another's child; its ``stopping`` event
                triggers :meth:`stop`.
            task_status: For ``await task_group.start(supervisor.run)``.

        Raises:
            toren.SupervisorEscalation: A child restarted more than ``intensity`` times within
                ``period``; every child has been stopped in reverse order. Its ``__cause__`` is
                the child's last exception, if it raised.
            RuntimeError: If this supervisor is already running.
            ExceptionGroup: If the restart store fails; every child has been cancelled.
        """
        if self._current is not None:
            raise RuntimeError(f"supervisor {self.name!r} is already running")

        def announce() -> None:
            task_status.started(self)
            if ctx is not None:
                ctx.started(self)

        finished = anyio.Event()
        escalation: SupervisorEscalation | None = None
        exits, exited = anyio.create_memory_object_stream[_Child](math.inf)
        try:
            with exits, exited:
                async with anyio.create_task_group() as tg:
                    run = self._current = _Run(tg, exits, exited, finished)
                    relay = anyio.CancelScope()
                    if ctx is not None:
                        tg.start_soon(_forward_stop, ctx.stopping, self._request_stop, relay)
                    escalation = await self._supervise(run, announce)
                    relay.cancel()
        finally:
            self._current = None
            finished.set()
        # Raised outside the task group, which would wrap it in an ExceptionGroup.
        if escalation is not None:
            raise escalation

    async def stop(self) -> None:
        """Stop every child, last started first, and make :meth:`run` return.

        Each child is asked to stop and, if graceful, given its ``shutdown_timeout`` before it is
        cancelled. A pending restart is abandoned. Returns once all children are down; does
        nothing if the supervisor is not running.
        """
        run = self._current
        if run is None:
            return
        self._request_stop()
        await run.finished.wait()

    def _request_stop(self) -> None:
        run = self._current
        if run is None:
            return
        run.stop_requested = True
        if run.busy is not None:
            run.busy.cancel()

    async def _supervise(
        self, run: _Run, announce: Callable[[], None]
    ) -> SupervisorEscalation | None:
        """The decision loop: start what is missing, then handle one exit at a time."""
        announced = False
        escalation: SupervisorEscalation | None = None
        while not run.stop_requested and escalation is None:
            with anyio.CancelScope() as run.busy:
                await self._start_missing(run)
                if not announced and self._all_started(run):
                    announce()
                    announced = True
                child = await run.exited.receive()
                # Children the supervisor stopped itself were already taken out of `running`.
                if run.running.get(child.spec.id) is child:
                    escalation = await self._on_exit(run, child)
            run.busy = None
        await self._shutdown(run)
        return escalation

    async def _start_missing(self, run: _Run) -> None:
        """Start, in order, every child that should run but does not.

        Stops at a child that exited before it was ready: later children may depend on it, so
        they wait until its exit has been handled.
        """
        for spec in self._specs:
            if spec.id in run.dropped:
                continue
            child = run.running.get(spec.id)
            if child is None:
                child = _Child(spec, ChildContext(id=spec.id, restarts=run.starts[spec.id]))
                run.starts[spec.id] += 1
                run.running[spec.id] = child
                await _start_child(run.tg, child, run.exits.send_nowait)
            if not child.ready:
                return

    def _all_started(self, run: _Run) -> bool:
        return all(
            spec.id in run.dropped or (spec.id in run.running and run.running[spec.id].ready)
            for spec in self._specs
        )

    async def _on_exit(self, run: _Run, child: _Child) -> SupervisorEscalation | None:
        """Decide what a child's own exit means; stop the siblings its strategy restarts."""
        spec = child.spec
        del run.running[spec.id]
        if child.error is not None:
            logger.warning(
                "child %r of supervisor %r failed", spec.id, self.name, exc_info=child.error
            )
        if not _restart_due(spec.restart, child.error):
            run.dropped.add(spec.id)
            return None
        restarts = await self._store.record_restart(f"{self.name}/{spec.id}", self.period)
        if restarts > self.intensity:
            logger.error(
                "supervisor %r gives up: child %r restarted %d times within %gs",
                self.name,
                spec.id,
                restarts,
                self.period,
            )
            escalation = SupervisorEscalation(self.name, spec.id, restarts, self.period)
            escalation.__cause__ = child.error
            return escalation
        await self._sleep(self._backoff.delay(restarts, self._random))
        for sibling in reversed(self._siblings_to_restart(run, spec)):
            await self._stop(run, sibling)
        # The next round of _start_missing restarts the child and the stopped siblings in order.
        return None

    def _siblings_to_restart(self, run: _Run, spec: ChildSpec) -> list[_Child]:
        if self.strategy is Strategy.ONE_FOR_ONE:
            return []
        order = self._specs
        if self.strategy is Strategy.REST_FOR_ONE:
            order = order[[s.id for s in order].index(spec.id) + 1 :]
        return [run.running[s.id] for s in order if s.id in run.running]

    async def _stop(self, run: _Run, child: _Child) -> None:
        await _stop_child(child)
        # Removed only once down, so an interrupted stop is finished by the shutdown.
        del run.running[child.spec.id]
        if child.spec.restart is Restart.TEMPORARY:
            run.dropped.add(child.spec.id)

    async def _shutdown(self, run: _Run) -> None:
        for spec in reversed(self._specs):
            if (child := run.running.get(spec.id)) is not None:
                await self._stop(run, child)
