"""Supervisors: OTP restart strategies, restart types, intensity, backoff and ordered shutdown.

Children record ("start", id), ("crash", id) and ("stop", id) into a shared log, so each test can
state the exact sequence of starts and stops it expects. Backoff sleeps are recorded, not slept,
and restart windows are kept on a clock the test moves.
"""

from __future__ import annotations

import ast
import pathlib

import anyio
import anyio.lowlevel
import pytest

import toren
import toren.supervisors as supervisors
from toren import SupervisorEscalation
from toren.supervisors import (
    Backoff,
    ChildAlreadyRunning,
    ChildContext,
    ChildSpec,
    ChildStartFailed,
    DynamicSupervisor,
    Ready,
    Restart,
    Strategy,
    Supervisor,
    SupervisorNotRunning,
    TooManyChildren,
)

pytestmark = pytest.mark.anyio

Entry = tuple[str, str]


class BoomError(Exception):
    """A child's failure."""


class Log:
    """What the children did, in order; waiters wake on every new entry."""

    def __init__(self) -> None:
        self.entries: list[Entry] = []
        self._changed = anyio.Event()

    def add(self, what: str, child_id: str) -> None:
        self.entries.append((what, child_id))
        self._changed.set()
        self._changed = anyio.Event()

    async def wait_for(self, what: str, child_id: str, *, count: int = 1) -> None:
        while self.entries.count((what, child_id)) < count:
            await self._changed.wait()


class ClockStore:
    """A RestartStore whose clock only moves when the test (or its sleep) moves it."""

    def __init__(self) -> None:
        self.now = 0.0
        self.recorded: list[tuple[str, float]] = []

    async def record_restart(self, key: str, period: float) -> int:
        self.recorded.append((key, self.now))
        return sum(1 for k, t in self.recorded if k == key and t > self.now - period)

    async def reset(self, key: str) -> None:
        raise AssertionError(f"supervisors must not reset restart windows ({key})")


class Sleeps:
    """An injectable sleep that records each delay and moves a ClockStore's clock instead."""

    def __init__(self, clock: ClockStore | None = None, *, advance: float = 0.0) -> None:
        self.delays: list[float] = []
        self._clock = clock
        self._advance = advance

    async def __call__(self, delay: float) -> None:
        self.delays.append(delay)
        if self._clock is not None:
            self._clock.now += self._advance
        await anyio.lowlevel.checkpoint()


def child(
    log: Log,
    child_id: str,
    *,
    crash: anyio.Event | None = None,
    crashes: int = 0,
    restart: Restart = Restart.PERMANENT,
) -> ChildSpec:
    """A child that starts, then waits to be stopped.

    With ``crash``, its first incarnation raises once the event is set. With ``crashes``, its
    first ``crashes`` incarnations raise right after signalling started().
    """

    async def run(ctx: ChildContext) -> None:
        log.add("start", child_id)
        ctx.started()
        try:
            if ctx.restarts < crashes or (crash is not None and ctx.restarts == 0):
                if crash is not None:
                    await crash.wait()
                log.add("crash", child_id)
                raise BoomError(child_id)
            await anyio.sleep_forever()
        except anyio.get_cancelled_exc_class():
            log.add("stop", child_id)
            raise

    return ChildSpec(id=child_id, run=run, restart=restart)


def started(*ids: str) -> list[Entry]:
    return [("start", i) for i in ids]


def stopped(*ids: str) -> list[Entry]:
    return [("stop", i) for i in ids]


async def test_public_api_is_sorted_and_exported() -> None:
    assert supervisors.__all__ == sorted(supervisors.__all__)
    assert all(hasattr(supervisors, name) for name in supervisors.__all__)


async def test_supervisors_never_import_toren_internals() -> None:
    root = pathlib.Path(supervisors.__file__).parent
    for path in sorted(root.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                modules = [node.module]
                if node.module == "toren":
                    assert {a.name for a in node.names} <= set(toren.__all__), path
            elif isinstance(node, ast.Import):
                modules = [a.name for a in node.names]
            else:
                continue
            for module in modules:
                parts = module.split(".")
                own = parts[:2] in (["toren", "supervisors"], ["toren", "actors"])
                assert own or not (parts[0] == "toren" and any(p.startswith("_") for p in parts)), (
                    f"{path.name} imports {module}"
                )


# Strategies -------------------------------------------------------------------------------------


async def test_one_for_one_restarts_only_the_crashed_child() -> None:
    with anyio.fail_after(5):
        log, crash = Log(), anyio.Event()
        specs = [child(log, "a"), child(log, "b", crash=crash), child(log, "c")]
        sup = Supervisor("sup", specs, strategy=Strategy.ONE_FOR_ONE, sleep=Sleeps())
        async with anyio.create_task_group() as tg:
            await tg.start(sup.run)
            crash.set()
            await log.wait_for("start", "b", count=2)
            assert sup.child_ids() == ["a", "b", "c"]
            await sup.stop()
        assert log.entries == [
            *started("a", "b", "c"),
            ("crash", "b"),
            *started("b"),
            *stopped("c", "b", "a"),
        ]


async def test_one_for_all_stops_siblings_in_reverse_and_restarts_all_in_order() -> None:
    with anyio.fail_after(5):
        log, crash = Log(), anyio.Event()
        specs = [child(log, "a"), child(log, "b", crash=crash), child(log, "c")]
        sup = Supervisor("sup", specs, strategy=Strategy.ONE_FOR_ALL, sleep=Sleeps())
        async with anyio.create_task_group() as tg:
            await tg.start(sup.run)
            crash.set()
            await log.wait_for("start", "c", count=2)
            assert sup.child_ids() == ["a", "b", "c"]
            await sup.stop()
        assert log.entries == [
            *started("a", "b", "c"),
            ("crash", "b"),
            *stopped("c", "a"),
            *started("a", "b", "c"),
            *stopped("c", "b", "a"),
        ]


async def test_rest_for_one_restarts_the_crashed_child_and_those_after_it() -> None:
    with anyio.fail_after(5):
        log, crash = Log(), anyio.Event()
        specs = [child(log, "a"), child(log, "b", crash=crash), child(log, "c")]
        sup = Supervisor("sup", specs, strategy=Strategy.REST_FOR_ONE, sleep=Sleeps())
        async with anyio.create_task_group() as tg:
            await tg.start(sup.run)
            crash.set()
            await log.wait_for("start", "c", count=2)
            assert sup.child_ids() == ["a", "b", "c"]
            await sup.stop()
        assert log.entries == [
            *started("a", "b", "c"),
            ("crash", "b"),
            *stopped("c"),
            *started("b", "c"),
            *stopped("c", "b", "a"),
        ]


async def test_simple_one_for_one_restarts_only_the_crashed_child() -> None:
    with anyio.fail_after(5):
        log, crash = Log(), anyio.Event()
        dyn = DynamicSupervisor("dyn", sleep=Sleeps())
        async with anyio.create_task_group() as tg:
            await tg.start(dyn.run)
            for spec in [child(log, "a"), child(log, "b", crash=crash), child(log, "c")]:
                await dyn.start_child(spec)
            crash.set()
            await log.wait_for("start", "b", count=2)
            assert dyn.child_ids() == ["a", "b", "c"]
            await dyn.stop()
        assert log.entries == [
            *started("a", "b", "c"),
            ("crash", "b"),
            *started("b"),
            *stopped("c", "b", "a"),
        ]


async def test_one_for_all_does_not_restart_a_temporary_sibling() -> None:
    with anyio.fail_after(5):
        log, crash = Log(), anyio.Event()
        specs = [child(log, "a", restart=Restart.TEMPORARY), child(log, "b", crash=crash)]
        sup = Supervisor("sup", specs, strategy=Strategy.ONE_FOR_ALL, sleep=Sleeps())
        async with anyio.create_task_group() as tg:
            await tg.start(sup.run)
            crash.set()
            await log.wait_for("start", "b", count=2)
            assert sup.child_ids() == ["b"]
            await sup.stop()
        assert log.entries == [
            *started("a", "b"),
            ("crash", "b"),
            *stopped("a"),
            *started("b"),
            *stopped("b"),
        ]


# Restart types ----------------------------------------------------------------------------------


def exits_once(log: Log, restart: Restart, *, error: bool) -> ChildSpec:
    """A child whose first incarnation returns (or raises); later ones keep running."""

    async def run(ctx: ChildContext) -> None:
        log.add("start", "x")
        ctx.started()
        if ctx.restarts == 0:
            if error:
                raise BoomError("x")
            return
        await anyio.sleep_forever()

    return ChildSpec(id="x", run=run, restart=restart)


@pytest.mark.parametrize(
    ("restart", "restarted"),
    [(Restart.PERMANENT, True), (Restart.TRANSIENT, False), (Restart.TEMPORARY, False)],
)
async def test_normal_return_restarts_only_permanent_children(
    restart: Restart, restarted: bool
) -> None:
    with anyio.fail_after(5):
        log = Log()
        sup = Supervisor("sup", [exits_once(log, restart, error=False)], sleep=Sleeps())
        async with anyio.create_task_group() as tg:
            await tg.start(sup.run)
            await anyio.wait_all_tasks_blocked()
            assert log.entries.count(("start", "x")) == (2 if restarted else 1)
            assert sup.child_ids() == (["x"] if restarted else [])
            await sup.stop()


@pytest.mark.parametrize(
    ("restart", "restarted"),
    [(Restart.PERMANENT, True), (Restart.TRANSIENT, True), (Restart.TEMPORARY, False)],
)
async def test_exception_restarts_permanent_and_transient_children(
    restart: Restart, restarted: bool
) -> None:
    with anyio.fail_after(5):
        log = Log()
        sup = Supervisor("sup", [exits_once(log, restart, error=True)], sleep=Sleeps())
        async with anyio.create_task_group() as tg:
            await tg.start(sup.run)
            await anyio.wait_all_tasks_blocked()
            assert log.entries.count(("start", "x")) == (2 if restarted else 1)
            assert sup.child_ids() == (["x"] if restarted else [])
            await sup.stop()


async def test_context_counts_restarts_of_the_child() -> None:
    with anyio.fail_after(5):
        seen: list[int] = []

        async def run(ctx: ChildContext) -> None:
            seen.append(ctx.restarts)
            ctx.started()
            if ctx.restarts < 2:
                raise BoomError("x")
            await anyio.sleep_forever()

        sup = Supervisor("sup", [ChildSpec(id="x", run=run)], sleep=Sleeps())
        async with anyio.create_task_group() as tg:
            await tg.start(sup.run)
            await anyio.wait_all_tasks_blocked()
            await sup.stop()
        assert seen == [0, 1, 2]


# Intensity --------------------------------------------------------------------------------------


async def test_exceeding_intensity_stops_children_in_reverse_and_escalates() -> None:
    with anyio.fail_after(5):
        log, store = Log(), ClockStore()
        specs = [child(log, "a"), child(log, "b", crashes=100), child(log, "c")]
        sup = Supervisor("sup", specs, intensity=2, period=5.0, store=store, sleep=Sleeps())
        with pytest.raises(SupervisorEscalation) as raised:
            await sup.run()
        error = raised.value
        assert (error.supervisor, error.child, error.restarts, error.period) == ("sup", "b", 3, 5.0)
        assert isinstance(error.__cause__, BoomError)
        assert log.entries == [
            *started("a", "b"),
            ("crash", "b"),
            *started("c", "b"),
            ("crash", "b"),
            *started("b"),
            ("crash", "b"),
            *stopped("c", "a"),
        ]
        assert sup.child_ids() == []


async def test_restarts_spread_beyond_the_period_do_not_escalate() -> None:
    with anyio.fail_after(5):
        log, store = Log(), ClockStore()
        # Each backoff moves the clock past the period, so every window holds one restart.
        sleeps = Sleeps(store, advance=6.0)
        specs = [child(log, "a", crashes=6)]
        sup = Supervisor("sup", specs, intensity=2, period=5.0, store=store, sleep=sleeps)
        async with anyio.create_task_group() as tg:
            await tg.start(sup.run)
            await log.wait_for("start", "a", count=7)
            await anyio.wait_all_tasks_blocked()
            assert sup.child_ids() == ["a"]
            await sup.stop()
        assert len(store.recorded) == 6
        assert log.entries[-1] == ("stop", "a")


async def test_escalation_makes_the_parent_restart_the_child_supervisor() -> None:
    with anyio.fail_after(5):
        log, store = Log(), ClockStore()
        incarnations = 0

        async def crashes_once_ever(ctx: ChildContext) -> None:
            # Counted here, not by ctx.restarts, which starts from 0 in each inner incarnation.
            nonlocal incarnations
            incarnations += 1
            log.add("start", "x")
            ctx.started()
            if incarnations == 1:
                log.add("crash", "x")
                raise BoomError("x")
            try:
                await anyio.sleep_forever()
            except anyio.get_cancelled_exc_class():
                log.add("stop", "x")
                raise

        inner = Supervisor(
            "inner",
            [child(log, "w"), ChildSpec(id="x", run=crashes_once_ever)],
            intensity=0,
            store=store,
            sleep=Sleeps(),
        )
        outer = Supervisor("outer", [inner.child_spec()], store=store, sleep=Sleeps())
        async with anyio.create_task_group() as tg:
            await tg.start(outer.run)
            await log.wait_for("start", "x", count=2)
            assert [key for key, _ in store.recorded] == ["inner/x", "outer/inner"]
            assert inner.child_ids() == ["w", "x"]
            await outer.stop()
        # The inner tree never restarted x by itself (intensity 0): it gave up, stopping w, and
        # the outer supervisor started it afresh; the outer stop reached it in order.
        assert log.entries == [
            *started("w", "x"),
            ("crash", "x"),
            *stopped("w"),
            *started("w"),
            *started("x"),
            *stopped("x", "w"),
        ]


# Backoff ----------------------------------------------------------------------------------------


async def test_backoff_delay_doubles_per_attempt() -> None:
    backoff = Backoff(base=0.1, cap=100.0, jitter=0.2)
    delays = [backoff.delay(n, lambda: 0.5) for n in range(1, 5)]
    assert delays == pytest.approx([0.1, 0.2, 0.4, 0.8])


async def test_backoff_delay_is_capped() -> None:
    backoff = Backoff(base=1.0, cap=5.0, jitter=0.0)
    assert [backoff.delay(n, lambda: 0.5) for n in range(1, 6)] == [1.0, 2.0, 4.0, 5.0, 5.0]
    assert backoff.delay(10_000, lambda: 0.5) == 5.0


async def test_backoff_jitter_spreads_delay_around_nominal() -> None:
    backoff = Backoff(base=1.0, cap=5.0, jitter=0.2)
    assert backoff.delay(2, lambda: 0.0) == pytest.approx(1.6)
    assert backoff.delay(2, lambda: 0.999999) == pytest.approx(2.4, rel=1e-5)
    assert backoff.delay(9, lambda: 0.999999) == pytest.approx(6.0, rel=1e-5)


async def test_backoff_rejects_cap_below_base_and_attempt_zero() -> None:
    with pytest.raises(ValueError, match="cap"):
        Backoff(base=1.0, cap=0.5)
    with pytest.raises(ValueError, match="attempt"):
        Backoff().delay(0, lambda: 0.5)


async def test_supervisor_sleeps_the_jittered_backoff_before_each_restart() -> None:
    with anyio.fail_after(5):
        log, sleeps = Log(), Sleeps()
        sup = Supervisor(
            "sup",
            [child(log, "a", crashes=4)],
            intensity=10,
            backoff=Backoff(base=0.1, cap=0.3, jitter=0.2),
            store=ClockStore(),
            sleep=sleeps,
            random=lambda: 0.0,
        )
        async with anyio.create_task_group() as tg:
            await tg.start(sup.run)
            await log.wait_for("start", "a", count=5)
            await sup.stop()
        assert sleeps.delays == pytest.approx([0.08, 0.16, 0.24, 0.24])


# Ordered start and shutdown ---------------------------------------------------------------------


async def test_next_child_starts_only_after_the_previous_signals_started() -> None:
    with anyio.fail_after(5):
        log, gate = Log(), anyio.Event()

        async def slow(ctx: ChildContext) -> None:
            log.add("start", "a")
            await gate.wait()
            ctx.started()
            await anyio.sleep_forever()

        sup = Supervisor("sup", [ChildSpec(id="a", run=slow), child(log, "b")])
        async with anyio.create_task_group() as tg:
            tg.start_soon(sup.run)
            await anyio.wait_all_tasks_blocked()
            assert log.entries == started("a")
            gate.set()
            await log.wait_for("start", "b")
            await sup.stop()


async def test_run_reports_started_once_every_child_is_ready() -> None:
    with anyio.fail_after(5):
        log = Log()
        sup = Supervisor("sup", [child(log, "a"), child(log, "b")])
        async with anyio.create_task_group() as tg:
            assert await tg.start(sup.run) is sup
            assert log.entries == started("a", "b")
            await sup.stop()


async def test_immediate_child_counts_as_started_without_calling_started() -> None:
    with anyio.fail_after(5):
        log = Log()

        async def silent(ctx: ChildContext) -> None:
            log.add("start", "a")
            await anyio.sleep_forever()

        spec = ChildSpec(id="a", run=silent, ready=Ready.IMMEDIATE)
        sup = Supervisor("sup", [spec, child(log, "b")])
        async with anyio.create_task_group() as tg:
            await tg.start(sup.run)
            assert log.entries == started("a", "b")
            await sup.stop()


async def test_child_failing_before_started_is_restarted_before_later_children_start() -> None:
    with anyio.fail_after(5):
        log = Log()

        async def flaky(ctx: ChildContext) -> None:
            log.add("start", "b")
            if ctx.restarts == 0:
                log.add("crash", "b")
                raise BoomError("b")
            ctx.started()
            await anyio.sleep_forever()

        specs = [child(log, "a"), ChildSpec(id="b", run=flaky), child(log, "c")]
        sup = Supervisor("sup", specs, sleep=Sleeps())
        async with anyio.create_task_group() as tg:
            await tg.start(sup.run)
            assert log.entries == [*started("a", "b"), ("crash", "b"), *started("b", "c")]
            await sup.stop()


async def test_stop_stops_children_in_reverse_start_order() -> None:
    with anyio.fail_after(5):
        log = Log()
        sup = Supervisor("sup", [child(log, "a"), child(log, "b"), child(log, "c")])
        async with anyio.create_task_group() as tg:
            await tg.start(sup.run)
            await sup.stop()
        assert log.entries == [*started("a", "b", "c"), *stopped("c", "b", "a")]
        assert sup.child_ids() == []


async def test_graceful_child_returns_on_stopping_without_being_cancelled() -> None:
    with anyio.fail_after(5):
        log = Log()

        async def polite(ctx: ChildContext) -> None:
            ctx.started()
            try:
                await ctx.stopping.wait()
                log.add("finished", "a")
            except anyio.get_cancelled_exc_class():
                log.add("cancelled", "a")
                raise

        spec = ChildSpec(id="a", run=polite, graceful=True, shutdown_timeout=5.0)
        sup = Supervisor("sup", [spec])
        async with anyio.create_task_group() as tg:
            await tg.start(sup.run)
            began = anyio.current_time()
            await sup.stop()
            assert anyio.current_time() - began < 1.0
        assert log.entries == [("finished", "a")]


async def test_child_ignoring_stopping_is_cancelled_after_its_shutdown_timeout() -> None:
    with anyio.fail_after(5):
        log = Log()

        async def deaf(ctx: ChildContext) -> None:
            ctx.started()
            try:
                await anyio.sleep_forever()
            except anyio.get_cancelled_exc_class():
                log.add("cancelled" if ctx.stopping.is_set() else "cancelled unasked", "a")
                raise

        spec = ChildSpec(id="a", run=deaf, graceful=True, shutdown_timeout=0.05)
        sup = Supervisor("sup", [spec])
        async with anyio.create_task_group() as tg:
            await tg.start(sup.run)
            began = anyio.current_time()
            await sup.stop()
            waited = anyio.current_time() - began
        assert 0.045 <= waited < 1.0
        assert log.entries == [("cancelled", "a")]


async def test_non_graceful_child_is_cancelled_at_once() -> None:
    with anyio.fail_after(5):
        log = Log()

        async def busy(ctx: ChildContext) -> None:
            ctx.started()
            try:
                await anyio.sleep_forever()
            except anyio.get_cancelled_exc_class():
                log.add("cancelled", "a")
                raise

        spec = ChildSpec(id="a", run=busy, graceful=False, shutdown_timeout=5.0)
        sup = Supervisor("sup", [spec])
        async with anyio.create_task_group() as tg:
            await tg.start(sup.run)
            began = anyio.current_time()
            await sup.stop()
            assert anyio.current_time() - began < 1.0
        assert log.entries == [("cancelled", "a")]


async def test_supervisor_refuses_duplicate_child_ids() -> None:
    log = Log()
    with pytest.raises(ValueError, match="duplicate"):
        Supervisor("sup", [child(log, "a"), child(log, "a")])


async def test_supervisor_refuses_to_run_twice_at_once() -> None:
    with anyio.fail_after(5):
        sup = Supervisor("sup", [child(Log(), "a")])
        async with anyio.create_task_group() as tg:
            await tg.start(sup.run)
            with pytest.raises(RuntimeError, match="already running"):
                await sup.run()
            await sup.stop()


# Dynamic supervisors ----------------------------------------------------------------------------


async def test_dynamic_gives_up_on_a_crash_looping_child_and_keeps_its_siblings() -> None:
    with anyio.fail_after(5):
        log, store = Log(), ClockStore()
        given_up: list[tuple[str, BaseException]] = []
        gave_up = anyio.Event()

        async def on_give_up(child_id: str, error: BaseException) -> None:
            given_up.append((child_id, error))
            gave_up.set()

        dyn = DynamicSupervisor(
            "dyn", intensity=2, store=store, on_give_up=on_give_up, sleep=Sleeps()
        )
        async with anyio.create_task_group() as tg:
            await tg.start(dyn.run)
            crash = anyio.Event()
            await dyn.start_child(child(log, "a"))
            await dyn.start_child(child(log, "b", crash=crash, crashes=100))
            await dyn.start_child(child(log, "c"))
            crash.set()
            await gave_up.wait()
            assert dyn.child_ids() == ["a", "c"]
            assert len(dyn) == 2
            await dyn.stop()
        [(child_id, error)] = given_up
        assert child_id == "b"
        assert isinstance(error, SupervisorEscalation)
        assert (error.supervisor, error.child, error.restarts) == ("dyn", "b", 3)
        assert isinstance(error.__cause__, BoomError)
        assert {key for key, _ in store.recorded} == {"dyn/b"}
        assert log.entries.count(("start", "b")) == 3
        assert log.entries[-2:] == stopped("c", "a")


async def test_dynamic_refuses_children_beyond_max_children() -> None:
    with anyio.fail_after(5):
        log = Log()
        dyn = DynamicSupervisor("dyn", max_children=2)
        async with anyio.create_task_group() as tg:
            await tg.start(dyn.run)
            await dyn.start_child(child(log, "a"))
            await dyn.start_child(child(log, "b"))
            with pytest.raises(TooManyChildren) as raised:
                await dyn.start_child(child(log, "c"))
            assert raised.value.retryable
            assert dyn.child_ids() == ["a", "b"]
            await dyn.stop()
        assert ("start", "c") not in log.entries


async def test_dynamic_refuses_a_duplicate_child_id() -> None:
    with anyio.fail_after(5):
        log = Log()
        dyn = DynamicSupervisor("dyn")
        async with anyio.create_task_group() as tg:
            await tg.start(dyn.run)
            await dyn.start_child(child(log, "a"))
            with pytest.raises(ChildAlreadyRunning):
                await dyn.start_child(child(log, "a"))
            await dyn.stop()
        assert log.entries == [*started("a"), *stopped("a")]


async def test_dynamic_refuses_children_when_not_running() -> None:
    dyn = DynamicSupervisor("dyn")
    with pytest.raises(SupervisorNotRunning):
        await dyn.start_child(child(Log(), "a"))


async def test_dynamic_start_child_returns_the_started_value() -> None:
    with anyio.fail_after(5):

        async def run(ctx: ChildContext) -> None:
            ctx.started(f"ref:{ctx.id}")
            await anyio.sleep_forever()

        dyn = DynamicSupervisor("dyn")
        async with anyio.create_task_group() as tg:
            await tg.start(dyn.run)
            assert await dyn.start_child(ChildSpec(id="a", run=run)) == "ref:a"
            await dyn.stop()


async def test_dynamic_stop_child_stops_it_without_restart() -> None:
    with anyio.fail_after(5):
        log = Log()
        dyn = DynamicSupervisor("dyn", sleep=Sleeps())
        async with anyio.create_task_group() as tg:
            await tg.start(dyn.run)
            await dyn.start_child(child(log, "a"))
            await dyn.start_child(child(log, "b"))
            await dyn.stop_child("a")
            await anyio.wait_all_tasks_blocked()
            assert dyn.child_ids() == ["b"]
            await dyn.stop()
        assert log.entries == [*started("a", "b"), *stopped("a", "b")]


async def test_dynamic_start_child_waits_for_a_restarted_incarnation() -> None:
    with anyio.fail_after(5):

        async def flaky(ctx: ChildContext) -> None:
            if ctx.restarts == 0:
                raise BoomError("a")
            ctx.started(ctx.restarts)
            await anyio.sleep_forever()

        dyn = DynamicSupervisor("dyn", sleep=Sleeps())
        async with anyio.create_task_group() as tg:
            await tg.start(dyn.run)
            assert await dyn.start_child(ChildSpec(id="a", run=flaky)) == 1
            await dyn.stop()


async def test_dynamic_start_child_fails_once_the_child_is_given_up_before_ready() -> None:
    with anyio.fail_after(5):
        given_up: list[str] = []

        async def on_give_up(child_id: str, error: BaseException) -> None:
            given_up.append(child_id)

        async def broken(ctx: ChildContext) -> None:
            raise BoomError("a")

        dyn = DynamicSupervisor("dyn", intensity=1, on_give_up=on_give_up, sleep=Sleeps())
        async with anyio.create_task_group() as tg:
            await tg.start(dyn.run)
            with pytest.raises(ChildStartFailed) as raised:
                await dyn.start_child(ChildSpec(id="a", run=broken))
            assert isinstance(raised.value.__cause__, BoomError)
            assert given_up == ["a"]
            assert len(dyn) == 0
            await dyn.stop()


async def test_dynamic_supervisor_runs_as_a_child_and_stops_with_its_parent() -> None:
    with anyio.fail_after(5):
        log = Log()
        dyn = DynamicSupervisor("dyn")
        # Its run serves as a child's run as it is; graceful, so the parent's stop is ordered.
        spec = ChildSpec(id="dyn", run=dyn.run, graceful=True, shutdown_timeout=5.0)
        parent = Supervisor("parent", [child(log, "before"), spec])
        async with anyio.create_task_group() as tg:
            await tg.start(parent.run)
            await dyn.start_child(child(log, "a"))
            await dyn.start_child(child(log, "b"))
            await parent.stop()
        assert log.entries == [*started("before", "a", "b"), *stopped("b", "a", "before")]


async def test_dynamic_removes_a_transient_child_that_returns() -> None:
    with anyio.fail_after(5):
        done = anyio.Event()

        async def passivates(ctx: ChildContext) -> None:
            ctx.started()
            await done.wait()

        dyn = DynamicSupervisor("dyn", store=ClockStore(), sleep=Sleeps())
        async with anyio.create_task_group() as tg:
            await tg.start(dyn.run)
            await dyn.start_child(ChildSpec(id="a", run=passivates, restart=Restart.TRANSIENT))
            assert dyn.child_ids() == ["a"]
            done.set()
            await anyio.wait_all_tasks_blocked()
            assert dyn.child_ids() == []
            await dyn.stop()
