"""The schedule cells: the ``ticker`` agent's schedule fires a slot every second, its worker
faulted inside a slot's firing, three workers at work; judged by the slots and their runs.

Each cell has its own database, model server and workers (their environment sets
``CHAOS_SCHEDULES``, so they declare the ``ticker/tick`` schedule at boot: see :mod:`chaos.app`).
The victim runs alone until its point, so that the point's occurrence counts the victim's own
firings: ``committing:schedule.slot_started#3`` is the third slot about to start its run (its
step, which spawns the run, sends it its start and records the slot, about to commit), and
``committed:schedule.slot_started#3`` the same step committed. At the point the victim is
faulted as every cell's (``SIGKILL``; its sessions terminated; ``SIGSTOP`` until another worker
claimed the schedule, then ``SIGCONT``), and two more workers join (for ``SIGSTOP``, before the
takeover they make). The schedule fires :data:`AFTER` more slots after the fault; then the
harness pauses it, lets every run end, and backfills the whole window (``allow_all``): the
slots' keys make each slot's run the run it already had, so the backfill must start none.

What must hold (:func:`judge_schedule`), over the window from the schedule's declaration to the
last slot it dealt with:

- every slot of the schedule in the window started exactly one run (run rows counted by their
  ``slot`` argument): a slot with two runs is red, and so is one with no run unless the
  schedule's journal says why (skipped, buffered or missed); a slot recorded started whose run
  does not exist is red, and so is a slot recorded started twice;
- every run is a slot's of the window, started once (one ``run.started``), completed with the
  answer its input asks for (``tick <slot>``), with the clean run's model calls;
- the backfill started no run: a run it started is a second run for a slot that had one;
- the schedule's journal contiguous, its epochs never going back, nothing written at a stale
  epoch after a ``SIGSTOP`` takeover; nothing dead-lettered; nothing stuck (the pause and the
  backfill handled, every run ended, within the harness's bound).
"""

from __future__ import annotations

import signal
import time
from collections import Counter
from collections.abc import Callable, Iterable
from decimal import Decimal
from typing import Any

import anyio
import asyncpg
import attrs
import orjson

from chaos.app import SCHEDULE, TICK, ticker
from chaos.harness import (
    _ZOMBIE_STOPPED,
    CHAOS,
    LEASE,
    Cell,
    CellFailed,
    CellResult,
    Harness,
    _Execution,
    _poll,
    _Recorder,
)
from chaos.oracle import Row, Takeover, Verdict, journal_problems
from chaos.processes import Worker
from chaos.servers import EffectServer, schedule_answer
from toren import Client
from toren.runs import ENDED, RUN_KIND, read_run
from toren.schedules import slot_key
from toren.schedules.client import backfill, full_name, pause
from toren.schedules.events import schedule_id
from toren.testing import AnthropicServer

NAME = full_name(ticker.name, SCHEDULE)
ADDRESS = schedule_id(NAME)
BEFORE = 3  # slots the victim fires alone in a clean run before the others join
AFTER = 3  # slots that must fire after the fault (after its evidence is in) before the pause
BYSTANDERS = 2  # the workers that join the victim at the fault: three in all
HANDLED_WITHIN = 15.0  # seconds for the schedule to take its pause, and its backfill
# What the schedule's journal records for a slot: a slot it names is accounted for.
DEALT = ("schedule.slot_started", "schedule.slot_skipped", "schedule.slot_buffered")


@attrs.frozen
class ScheduleExpected:
    """What the clean cell did: the model calls of each run (all alike)."""

    steps: int


@attrs.frozen
class ScheduledRun:
    """One run the schedule started, as it ended (or not)."""

    run: str
    slot: str  # its ``slot`` argument
    status: str
    input: str
    output: str
    error: str
    calls: int
    started: int  # its run.started events
    backfilled: bool  # it did not exist before the backfill


@attrs.frozen
class ScheduleObserved:
    slots: tuple[str, ...]  # the schedule's slots in the window, by key, in order
    journal: tuple[Row, ...]  # the schedule's
    backfill_seq: int  # the journal's last seq before the backfill (0: none was sent)
    runs: tuple[ScheduledRun, ...]
    deadletters: int
    takeover: Takeover | None


def window(journal: Iterable[Row]) -> tuple[float, float] | None:
    """The window ``(after, last]``: from the first declaration (whose slots come after it; a
    journal without one, from the first slot it deals with) to the last slot it deals with
    (started, skipped, buffered or missed); None if it deals with none."""
    found: list[float] = []
    declared: float | None = None
    for row in journal:
        if row.type in DEALT:
            found.append(float(row.data["slot"]))
        elif row.type == "schedule.slots_missed":
            found += [float(row.data["first"]), float(row.data["last"])]
        elif row.type == "schedule.declared" and declared is None:
            declared = float(row.data["at"])
    if not found:
        return None
    return (min(found) - 0.5 if declared is None else declared, max(found))


def window_slots(journal: Iterable[Row]) -> tuple[str, ...]:
    """The keys of the schedule's slots in the journal's window."""
    span = window(journal)
    if span is None:
        return ()
    return tuple(slot_key(s) for s in TICK.spec.slots(span[0], span[1], 100_000))


def judge_schedule(seen: ScheduleObserved, expected: ScheduleExpected) -> Verdict:
    problems = [f"schedule: {p}" for p in journal_problems(seen.journal, seen.takeover)]
    problems += _slot_problems(seen)
    problems += _run_problems(seen, expected)
    problems += _backfill_problems(seen)
    if seen.deadletters:
        problems.append(f"{seen.deadletters} messages dead-lettered")
    return Verdict(tuple(problems), 0, Decimal(0))


def _slot_problems(seen: ScheduleObserved) -> list[str]:
    """Every slot of the window: one run, or a record of why it started none."""
    if not seen.slots:
        return ["the schedule dealt with no slot"]
    before = [r for r in seen.journal if not seen.backfill_seq or r.seq <= seen.backfill_seq]
    started: dict[str, list[str]] = {}
    for row in before:
        if row.type == "schedule.slot_started":
            started.setdefault(row.data["key"], []).append(row.data["run"])
    accounted = {r.data["key"] for r in before if r.type in DEALT[1:]}
    for row in before:
        if row.type == "schedule.slots_missed":
            first, last = float(row.data["first"]), float(row.data["last"])
            missed = TICK.spec.slots(first - 0.5, last, 100_000)
            accounted.update(slot_key(s) for s in missed)
    runs: dict[str, list[str]] = {}
    for run in seen.runs:
        runs.setdefault(run.slot, []).append(run.run)
    problems = []
    for key in seen.slots:
        mine, recorded = runs.get(key, []), started.get(key, [])
        if len(mine) > 1:
            problems.append(f"slot {key} started {len(mine)} runs: {sorted(mine)}")
        if len(recorded) > 1:
            problems.append(f"slot {key} recorded started {len(recorded)} times: {recorded}")
        if not mine and recorded:
            problems.append(f"slot {key} recorded started run {recorded[0]}, which does not exist")
        elif not mine and key not in accounted:
            problems.append(f"slot {key} started no run and the schedule's journal never names it")
    strays = sorted({r.slot for r in seen.runs} - set(seen.slots))
    problems.extend(f"runs for slot {key}, not a slot of the window" for key in strays)
    return problems


def _run_problems(seen: ScheduleObserved, expected: ScheduleExpected) -> list[str]:
    problems = []
    for run in seen.runs:
        if run.started != 1:
            problems.append(f"run {run.run} (slot {run.slot}) started {run.started} times")
        if run.status not in ENDED:
            problems.append(f"stuck: run {run.run} (slot {run.slot}) is still {run.status}")
        elif run.status != "completed":
            problems.append(f"run {run.run} (slot {run.slot}) {run.status}: {run.error}")
        elif run.output != schedule_answer(run.input):
            problems.append(f"run {run.run} answered {run.output!r} to {run.input!r}")
        if run.input != f"tick {run.slot}":
            problems.append(f"run {run.run} of slot {run.slot} was given {run.input!r}")
        if run.status == "completed" and run.calls != expected.steps:
            problems.append(f"run {run.run} made {run.calls} model calls, clean {expected.steps}")
    return problems


def _backfill_problems(seen: ScheduleObserved) -> list[str]:
    """The backfill over the window started nothing: its slots had their runs."""
    if not seen.backfill_seq:
        return []
    had = {r.slot: r.run for r in seen.runs if not r.backfilled}
    problems = []
    for run in sorted((r for r in seen.runs if r.backfilled), key=lambda r: r.slot):
        if run.slot in had:
            problems.append(
                f"the backfill started a second run for slot {run.slot}: {run.run}, beside "
                f"{had[run.slot]}"
            )
        else:
            problems.append(f"the backfill started run {run.run} for slot {run.slot}")
    return problems


def note(seen: ScheduleObserved) -> str:
    return f"{len(seen.slots)} slots, {len(seen.runs)} runs"


# -- the cell ------------------------------------------------------------------------------------


class ScheduleExecution(_Execution):
    """One schedule cell: the victim fires slots alone up to its point, is faulted there, two
    more workers join; then the schedule is paused and its window backfilled."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)  # as every cell's (see chaos.harness)
        self.env["CHAOS_SCHEDULES"] = "1"
        self.holder: tuple[object, int] | None = None  # (owner, epoch) of the schedule at the point
        self.backfill_seq = 0
        self.before_backfill: frozenset[str] = frozenset()

    async def run(self) -> str:
        cell = self.cell
        victim_env = dict(self.env)
        if cell.fault is None:
            victim_env["TOREN_KILL_POINT_TRACE"] = str(self.folder / "trace")
        else:
            victim_env["TOREN_KILL_POINT"] = f"{cell.point}#{cell.occurrence}"
            victim_env["TOREN_KILL_POINT_DIR"] = str(self.points)
        victim = self.start(victim_env, "victim")
        evidence = ""
        try:
            if cell.fault is None:
                await self._fired(lambda slots: len(slots) >= BEFORE, f"{BEFORE} slots fired")
                self._join()
            else:
                await self._reach_point(victim)
                row = await self.client.actor(ADDRESS)
                self.holder = (row["owner"], row["epoch"])
                evidence = await getattr(self, f"_{cell.fault}")(victim, None)
                if cell.fault != "sigstop":
                    self._join()
            after = time.time()
            await self._fired(
                lambda slots: any(s >= after + AFTER for s in slots), f"{AFTER} slots after"
            )
            await self._stop()
            await self._backfill()
        except CellFailed as exc:
            self.problems.append(str(exc))
        return evidence

    def _join(self) -> None:
        for _ in range(BYSTANDERS):
            self.start(self.env, "bystander")

    async def _journal(self) -> tuple[Row, ...]:
        rows = await self.client.pool.fetch(
            "SELECT seq, epoch, type, data, extract(epoch FROM created_at)::float8 AS at "
            "FROM toren.journal WHERE actor_id = $1 ORDER BY seq",
            ADDRESS,
        )
        return tuple(Row(r["seq"], r["epoch"], r["type"], r["data"], r["at"]) for r in rows)

    async def _fired(self, enough: Callable[[list[float]], bool], what: str) -> None:
        """Wait until the slots recorded started satisfy ``enough`` (a replacement started if
        no worker runs)."""
        deadline = time.monotonic() + self.h.bound
        while True:
            rows = await self._journal()
            slots = [float(r.data["slot"]) for r in rows if r.type == "schedule.slot_started"]
            if enough(slots):
                return
            if not any(w.running for w in self.workers):
                self.start(self.env, "replacement")
            if time.monotonic() > deadline:
                raise CellFailed(f"stuck: not {what} {self.h.bound:g}s on ({len(slots)} started)")
            await anyio.sleep(0.1)

    async def _reach_point(self, victim: Worker) -> None:
        hit = self.points / "hit"
        deadline = time.monotonic() + 30
        while not await _poll(hit.exists, 0.25):
            if victim.exited and not await _poll(hit.exists, 1.0):
                raise CellFailed("the point was never reached (the victim exited)")
            if time.monotonic() > deadline:
                raise CellFailed("the point was not reached within 30s")
        if orjson.loads(hit.read_bytes())["pid"] != victim.pid:
            raise CellFailed("the point was reached by another process than the victim")

    async def _sigstop(self, victim: Worker, hold: object) -> str:
        """Stopped at the point; the two others join and one claims the schedule once its lease
        expired; the zombie is continued and must give the schedule up."""
        if self.holder is None:  # pragma: no cover  (set at the point)
            raise CellFailed("no holder of the schedule known at the point")
        owner, epoch = self.holder
        victim.signal(signal.SIGSTOP)
        if not await _poll(lambda: victim.stopped, 5):
            raise CellFailed("the victim was never seen stopped")
        self._go(None)  # it goes on from the point once continued
        self._join()
        deadline = time.monotonic() + LEASE + 20
        while True:
            row = await self.client.actor(ADDRESS)
            if row["owner"] not in (None, owner) and row["epoch"] > epoch:
                break
            if time.monotonic() > deadline:
                raise CellFailed("no worker claimed the schedule while the victim was stopped")
            await anyio.sleep(0.02)
        if not victim.stopped:
            raise CellFailed("the victim was not stopped through the takeover")
        journal = await self._journal()
        self.takeover = Takeover(seq=journal[-1].seq if journal else 0, epoch=row["epoch"])
        offset = len(victim.log())
        victim.signal(signal.SIGCONT)
        fenced = await _poll(
            lambda: any(s in victim.log()[offset:] for s in _ZOMBIE_STOPPED), 10, 0.05
        )
        if not fenced:
            self.problems.append("the zombie never gave the schedule up after SIGCONT")
        return (
            f"stopped at the point; another worker claimed the schedule at epoch "
            f"{self.takeover.epoch} meanwhile; continued, the zombie gave it up"
        )

    async def _stop(self) -> None:
        """Pause the schedule, and let every run it started end."""
        await pause(self.client, NAME, by=CHAOS, reason="the chaos cell is over")
        await self._until(
            lambda rows: any(r.type == "schedule.paused" for r in rows),
            "the schedule never took its pause",
        )
        await self._runs_end()

    async def _backfill(self) -> None:
        """Backfill the whole window under allow_all, and wait until the schedule handled it."""
        journal = await self._journal()
        span = window(journal)
        if span is None:
            raise CellFailed("the schedule dealt with no slot")
        self.backfill_seq = journal[-1].seq
        self.before_backfill = frozenset(r["actor_id"] for r in await self._run_rows())
        count = await backfill(self.client, NAME, span[0], span[1], overlap="allow_all", by=CHAOS)
        await self._until(
            lambda rows: sum(r.seq > self.backfill_seq and r.type in DEALT for r in rows) >= count,
            f"the backfill of {count} slots was never handled",
        )
        await self._runs_end()

    async def _until(self, done: Callable[[tuple[Row, ...]], bool], failure: str) -> None:
        deadline = time.monotonic() + HANDLED_WITHIN
        while not done(await self._journal()):
            if time.monotonic() > deadline:
                raise CellFailed(f"stuck: {failure} within {HANDLED_WITHIN:g}s")
            await anyio.sleep(0.1)

    async def _run_rows(self) -> list[asyncpg.Record]:
        return list(
            await self.client.pool.fetch(
                "SELECT actor_id, args FROM toren.actors WHERE kind = $1 "
                "AND args->>'schedule' = $2 ORDER BY actor_id",
                RUN_KIND,
                NAME,
            )
        )

    async def _runs_end(self) -> None:
        deadline = time.monotonic() + self.h.bound
        while True:
            rows = await self._run_rows()
            states = [await read_run(self.client, r["actor_id"]) for r in rows]
            if all(s.status in ENDED for s in states):
                return
            if time.monotonic() > deadline:
                return  # judged stuck by the oracle, run by run
            await anyio.sleep(0.1)


async def observe_schedule(execution: ScheduleExecution) -> ScheduleObserved:
    client = execution.client
    journal = await execution._journal()
    runs = []
    for row in await execution._run_rows():
        run_id = row["actor_id"]
        args = orjson.loads(row["args"]) if isinstance(row["args"], str) else row["args"]
        state = await read_run(client, run_id)
        started = await client.pool.fetchval(
            "SELECT count(*) FROM toren.journal WHERE actor_id = $1 AND type = 'run.started'",
            run_id,
        )
        runs.append(
            ScheduledRun(
                run=run_id,
                slot=str(args.get("slot")),
                status=state.status,
                input=state.input,
                output=state.output or "",
                error=str(state.error or ""),
                calls=len(state.calls),
                started=started,
                backfilled=bool(execution.backfill_seq) and run_id not in execution.before_backfill,
            )
        )
    return ScheduleObserved(
        slots=window_slots(
            r for r in journal if not execution.backfill_seq or r.seq <= execution.backfill_seq
        ),
        journal=journal,
        backfill_seq=execution.backfill_seq,
        runs=tuple(runs),
        deadletters=await client.pool.fetchval("SELECT count(*) FROM toren.deadletters"),
        takeover=execution.takeover,
    )


async def run_schedule_cell(
    harness: Harness, cell: Cell, expected: ScheduleExpected | None
) -> tuple[CellResult, ScheduleObserved]:
    """Run a schedule cell (``expected`` None: the clean cell, its points traced)."""
    prefix = f"{harness.mutation}/" if harness.mutation else ""
    folder = harness.workdir / f"{prefix}{cell.slug}"
    folder.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    recorder = _Recorder()
    async with (
        harness.database() as url,
        AnthropicServer(recorder) as model,
        EffectServer() as effects,
    ):
        client = await Client.connect(url)
        execution = ScheduleExecution(harness, cell, folder, client, model, effects, url, recorder)
        try:
            with anyio.fail_after(harness.bound * 3 + 60):
                evidence = await execution.run()
            observed = await observe_schedule(execution)
        finally:
            for w in execution.workers:
                w.close()
            await client.close()
    problems = list(execution.problems)
    if expected is not None:
        problems.extend(judge_schedule(observed, expected).problems)
    result = CellResult(
        cell,
        tuple(problems),
        0,
        Decimal(0),
        time.monotonic() - started,
        evidence,
        note(observed),
    )
    return result, observed


def calls_of(seen: ScheduleObserved) -> Counter[int]:
    """How many runs made each number of model calls (a clean cell's must all agree)."""
    return Counter(r.calls for r in seen.runs if r.status == "completed")
