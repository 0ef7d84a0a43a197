"""Dynamic supervisors (OTP's simple_one_for_one): children added and removed at run time.

Every child is independent: it has its own keeper task that restarts it, and its own restart
window, so one crash-looping child is given up on while its siblings run on.
"""

from __future__ import annotations

import logging
import math
import random as _random
from collections.abc import Awaitable, Callable

import anyio
import attrs
from anyio.abc import TaskGroup, TaskStatus

from toren import MemoryRestartStore, RestartStore, SupervisorEscalation, TorenError
from toren.supervisors._backoff import Backoff
from toren.supervisors._supervisor import (
    DEFAULT_BACKOFF,
    ChildContext,
    ChildSpec,
    Restart,
    _Child,
    _forward_stop,
    _restart_due,
    _start_child,
    _stop_child,
)

logger = logging.getLogger(__name__)


class SupervisorNotRunning(TorenError):
    """A child was offered to a dynamic supervisor that is not running or is stopping."""

    def __init__(self, supervisor: str) -> None:
        self.supervisor = supervisor
        super().__init__(
            f"supervisor {supervisor!r} is not running; start it with run() before adding children"
        )


class ChildAlreadyRunning(TorenError):
    """start_child() named an id that the supervisor already holds."""

    def __init__(self, supervisor: str, child: str) -> None:
        self.supervisor = supervisor
        self.child = child
        super().__init__(
            f"supervisor {supervisor!r} already runs a child {child!r}; "
            "stop it first or pick another id"
        )


class TooManyChildren(TorenError):
    """start_child() was refused: the supervisor holds ``max_children`` children."""

    retryable = True

    def __init__(self, supervisor: str, max_children: int) -> None:
        self.supervisor = supervisor
        self.max_children = max_children
        super().__init__(
            f"supervisor {supervisor!r} is at its limit of {max_children} children; "
            "retry once one has stopped, or raise max_children"
        )


class ChildStartFailed(TorenError):
    """The child started by start_child() was removed before any incarnation was ready.

    ``cause`` (also ``__cause__``) is the last incarnation's exception, or None if it returned or
    was stopped.
    """

    def __init__(self, supervisor: str, child: str, cause: Exception | None) -> None:
        self.supervisor = supervisor
        self.child = child
        self.cause = cause
        reason = f"raised {cause!r}" if cause is not None else "returned or was stopped"
        super().__init__(
            f"child {child!r} of supervisor {supervisor!r} was removed before it called "
            f"ctx.started(): it last {reason}"
        )


@attrs.define(eq=False)
class _Slot:
    """One child id held by the supervisor, across its incarnations."""

    spec: ChildSpec
    child: _Child
    # Set once an incarnation is ready, or once the slot is gone; start_child waits for it.
    settled: anyio.Event = attrs.Factory(anyio.Event)
    ready: bool = False
    value: object = None
    removed: anyio.Event = attrs.Factory(anyio.Event)
    stop_requested: anyio.Event = attrs.Factory(anyio.Event)
    # The scope of a restart being prepared (record, backoff), cancelled by stop_child.
    pending: anyio.CancelScope | None = None


@attrs.define(eq=False)
class _DynamicRun:
    """The state of one ``DynamicSupervisor.run`` call."""

    tg: TaskGroup
    finished: anyio.Event
    stop_requested: anyio.Event = attrs.Factory(anyio.Event)
    slots: dict[str, _Slot] = attrs.Factory(dict)


class DynamicSupervisor:
    """Runs children added at run time, each restarted on its own (simple_one_for_one).

    Restart intensity is counted per child, under ``f"{name}/{child_id}"``: a child restarted more
    than ``intensity`` times within ``period`` is removed and ``on_give_up`` is awaited, while its
    siblings go on. A child that exits without a restart being due is removed. Restart windows are
    never reset here; they expire by themselves, or the owner calls ``store.reset``.
    """

    def __init__(
        self,
        name: str,
        *,
        intensity: int = 3,
        period: float = 5.0,
        backoff: Backoff = DEFAULT_BACKOFF,
        store: RestartStore | None = None,
        max_children: int | None = None,
        on_give_up: Callable[[str, BaseException], Awaitable[None]] | None = None,
        sleep: Callable[[float], Awaitable[None]] = anyio.sleep,
        random: Callable[[], float] = _random.random,
    ) -> None:
        """Describe the supervisor; nothing runs until :meth:`run`.

        Args:
            name: Names the supervisor in errors and prefixes its restart-window keys.
            intensity: Most restarts of one child tolerated within ``period``.
            period: The restart window, in seconds.
            backoff: Delay before each restart.
            store: Where restarts are counted; an in-process store by default.
            max_children: Most children held at once (running or awaiting restart); no limit
                if None.
            on_give_up: Awaited with the child's id and a :class:`toren.SupervisorEscalation`
                (whose ``__cause__`` is the child's last exception) when a child is given up
                on. If it raises, the supervisor fails: every child is cancelled and
                :meth:`run` raises that error inside an ExceptionGroup. If None, giving up is
                logged.
            sleep: Waits out the backoff; injectable so that tests need not wait.
            random: Source of backoff jitter in ``[0, 1)``.

        Raises:
            ValueError: If ``intensity`` or ``max_children`` is negative, or ``period`` is not
                positive.
        """
        if intensity < 0:
            raise ValueError(f"supervisor {name!r}: intensity must be >= 0, got {intensity}")
        if not period > 0:
            raise ValueError(f"supervisor {name!r}: period must be > 0, got {period}")
        if max_children is not None and max_children < 0:
            raise ValueError(f"supervisor {name!r}: max_children must be >= 0")
        self.name = name
        self.intensity = intensity
        self.period = period
        self.max_children = max_children
        self._backoff = backoff
        self._store: RestartStore = store if store is not None else MemoryRestartStore()
        self._on_give_up = on_give_up
        self._sleep = sleep
        self._random = random
        self._current: _DynamicRun | None = None

    def child_spec(self, *, restart: Restart = Restart.PERMANENT) -> ChildSpec:
        """A spec that runs this supervisor as a child of another, under its own name.

        The parent's stop request becomes an ordered shutdown of this supervisor's children,
        which may take as long as their own timeouts add up to.
        """
        return ChildSpec(
            id=self.name, run=self.run, restart=restart, graceful=True, shutdown_timeout=math.inf
        )

    def child_ids(self) -> list[str]:
        """Ids of the children held (running or awaiting restart), in the order first started."""
        run = self._current
        return [] if run is None else list(run.slots)

    def __len__(self) -> int:
        run = self._current
        return 0 if run is None else len(run.slots)

    async def run(
        self,
        ctx: ChildContext | None = None,
        *,
        task_status: TaskStatus[DynamicSupervisor] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        """Supervise children added with :meth:`start_child` until :meth:`stop`.

        Cancelling this call cancels all children at once; use :meth:`stop` for an ordered
        shutdown.

        Args:
            ctx: Given when this supervisor runs as another's child; its ``stopping`` event
                triggers :meth:`stop`.
            task_status: For ``await task_group.start(supervisor.run)``.

        Raises:
            RuntimeError: If this supervisor is already running.
            ExceptionGroup: If the restart store or ``on_give_up`` fails; every child has been
                cancelled.
        """
        if self._current is not None:
            raise RuntimeError(f"supervisor {self.name!r} is already running")
        finished = anyio.Event()
        try:
            async with anyio.create_task_group() as tg:
                run = self._current = _DynamicRun(tg, finished)
                relay = anyio.CancelScope()
                if ctx is not None:
                    tg.start_soon(_forward_stop, ctx.stopping, run.stop_requested.set, relay)
                task_status.started(self)
                if ctx is not None:
                    ctx.started(self)
                await run.stop_requested.wait()
                for slot in reversed(list(run.slots.values())):
                    await self._stop_slot(slot)
                # Only the relay is cancelled: a pending on_give_up call is let finish.
                relay.cancel()
        finally:
            self._current = None
            finished.set()

    async def stop(self) -> None:
        """Stop every child, last started first, and make :meth:`run` return.

        Each child is asked to stop and, if graceful, given its ``shutdown_timeout`` before it is
        cancelled. New children are refused from now on. Returns once every child is down;
        does nothing if the supervisor is not running.
        """
        run = self._current
        if run is None:
            return
        run.stop_requested.set()
        await run.finished.wait()

    async def start_child(self, spec: ChildSpec) -> object:
        """Start a child and wait until it calls ``ctx.started()``.

        A child that exits before calling ``ctx.started()`` has failed like any other: it is
        restarted by its restart type and counted against ``intensity``, and this call keeps
        waiting for a later incarnation to be ready. If the caller is cancelled while waiting, the
        child stays supervised.

        Returns:
            The value the child passed to ``ctx.started()``.

        Raises:
            SupervisorNotRunning: The supervisor is not running, or is stopping.
            ChildAlreadyRunning: A child with this id is held (running or awaiting restart).
            TooManyChildren: ``max_children`` children are held.
            ChildStartFailed: The child was removed before any incarnation was ready: it was
                given up on (``on_give_up`` has been awaited), its restart type did not call for
                a restart, or it was stopped.
        """
        run = self._current
        if run is None or run.stop_requested.is_set():
            raise SupervisorNotRunning(self.name)
        if spec.id in run.slots:
            raise ChildAlreadyRunning(self.name, spec.id)
        if self.max_children is not None and len(run.slots) >= self.max_children:
            raise TooManyChildren(self.name, self.max_children)
        slot = _Slot(spec, _Child(spec, ChildContext(id=spec.id)))
        run.slots[spec.id] = slot
        # The keeper owns the child from the start, so that it stays supervised even if this
        # call is cancelled while waiting for readiness.
        run.tg.start_soon(self._keep, run, slot, name=f"keeper {spec.id}")
        await slot.settled.wait()
        if slot.ready:
            return slot.value
        error = slot.child.error
        raise ChildStartFailed(self.name, spec.id, error) from error

    async def stop_child(self, child_id: str) -> None:
        """Stop one child (gracefully if its spec says so) and remove it; it is not restarted.

        A pending restart of it is abandoned. Does nothing if no child has this id.
        """
        run = self._current
        slot = None if run is None else run.slots.get(child_id)
        if slot is not None:
            await self._stop_slot(slot)

    async def _stop_slot(self, slot: _Slot) -> None:
        # The flag is set before anything else: the keeper checks it before each new
        # incarnation, so it cannot start one behind our back.
        slot.stop_requested.set()
        if slot.pending is not None:
            slot.pending.cancel()
        await _stop_child(slot.child)
        await slot.removed.wait()

    async def _keep(self, run: _DynamicRun, slot: _Slot) -> None:
        """Run the slot's child, restarting it after each exit, until it is removed."""
        try:
            escalation = await self._restart_until_removed(run, slot)
            # Freed before on_give_up runs, so that the owner may start the id afresh.
            del run.slots[slot.spec.id]
            if escalation is not None:
                await self._give_up(slot.spec.id, escalation)
        finally:
            if run.slots.get(slot.spec.id) is slot:
                del run.slots[slot.spec.id]
            slot.removed.set()
            slot.settled.set()

    async def _restart_until_removed(
        self, run: _DynamicRun, slot: _Slot
    ) -> SupervisorEscalation | None:
        spec = slot.spec
        child = slot.child
        while True:
            if await _start_child(run.tg, child) and not slot.ready:
                slot.ready, slot.value = True, child.value
                slot.settled.set()
            await child.done.wait()
            if slot.stop_requested.is_set():
                return None
            if child.error is not None:
                logger.warning(
                    "child %r of supervisor %r failed", spec.id, self.name, exc_info=child.error
                )
            if not _restart_due(spec.restart, child.error):
                return None
            with anyio.CancelScope() as slot.pending:
                key = f"{self.name}/{spec.id}"
                restarts = await self._store.record_restart(key, self.period)
                if restarts > self.intensity:
                    escalation = SupervisorEscalation(self.name, spec.id, restarts, self.period)
                    escalation.__cause__ = child.error
                    return escalation
                await self._sleep(self._backoff.delay(restarts, self._random))
            slot.pending = None
            # Checked with no await before the start below, so stop_child either sees the new
            # incarnation running or has already stopped us from starting it.
            if slot.stop_requested.is_set():
                return None
            child = slot.child = _Child(
                spec, ChildContext(id=spec.id, restarts=child.ctx.restarts + 1)
            )

    async def _give_up(self, child_id: str, escalation: SupervisorEscalation) -> None:
        if self._on_give_up is not None:
            await self._on_give_up(child_id, escalation)
            return
        logger.error("supervisor %r gave up on child %r", self.name, child_id, exc_info=escalation)
