"""The version cells: a run moved to another version of its agent, and a run forked from a step,
each with its worker ``SIGKILL``ed at the commit that does it; judged against a clean cell.

Both run the ``versioned`` agent (:mod:`chaos.app`): a ticket (a keyed external effect), a
refund (the same, approved by a person: the run parks on it), then the answer; three model
calls. Its policy is ``next_turn``: a run moved to another version takes the calls it made by
value. A worker whose ``CHAOS_VERSION`` is set serves another version of it (another system
prompt), so the request digests of the two differ from the first call on.

The **upgrade** cell: a worker of version A (``old``) starts the run, which pins itself to A and
parks on the refund's approval; ``old`` drains and exits, so the run waits for a worker of A.
The victim, a worker of version B, starts; the harness calls ``toren.runs.upgrade_run``, which
re-routes the run to B and sends it its ``Upgrade``; the victim records ``run.upgraded`` and is
``SIGKILL``ed just before that commit (``committing:run.upgraded#1``: the ``Upgrade`` is handled
again) or just after it (``committed:run.upgraded#1``). A replacement of version B takes over,
the harness approves the refund, the run completes. What must hold (:func:`judge_upgrade`):
every check of the plain cells (:func:`chaos.oracle.judge`: the clean cell's output, no model call
paid twice but the one in flight, each effect once, the journal contiguous, one approval,
nothing dead-lettered, nothing stuck), and one ``run.upgraded``, from the version the run started
on to the one ``upgrade_run`` named, by value; no step invalidated; the run's row routed to
version B; the requests made before the move carry A's system prompt, those after B's.

The **fork** cell: a worker (``source``) runs the source run to its end and drains. The harness
forks it at step :data:`FORK_AT` (``toren.runs.fork_run``: the fork's row, its journal's prefix
copied from the source's, ``run.forked`` and its first ``Continue`` in one transaction); the
victim runs the fork and is ``SIGKILL``ed at its first live step, just before and just after
its first ``model.called`` commit; a replacement finishes it (the harness approves the fork's
refund, asked again). What must hold (:func:`judge_fork`): the fork completed with the clean
fork's output; its journal starts with the events the clean fork copied, each equal by value to
its source's, then ``run.forked``; no call before the step paid by anybody (the model server's
count since the fork was made), the step's call paid at most twice (once in flight), every later
call once; each effect of the fork applied once, under the fork's own idempotency keys, and
its refund approved again; the source's effects not asked for again, its journal unchanged byte
for byte; nothing dead-lettered, nothing stuck.
"""

from __future__ import annotations

import signal
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from decimal import Decimal
from pathlib import Path
from typing import Any, TypeVar

import anyio
import asyncpg
import attrs

from chaos.app import versioned_system
from chaos.harness import (
    CHAOS,
    Cell,
    CellFailed,
    CellResult,
    Harness,
    _Execution,
    _poll,
    _Recorder,
)
from chaos.mutations import applied_here
from chaos.oracle import (
    Expected,
    Observed,
    Row,
    Verdict,
    duplicate_usd,
    journal_problems,
    judge,
    meant_for,
    observe,
)
from chaos.servers import Effect, EffectServer, case, position, system_of
from toren import Client
from toren._agent.routes import version_route
from toren._core.workers import live_workers
from toren.runs import RunState, decide, read_run, receipt, start_run, waiting_on
from toren.testing import AnthropicServer

NAME = "versioned"  # the agent (chaos.app)
DEPLOY = "2"  # the CHAOS_VERSION of the workers of version B
FORK_AT = 2  # the fork's first live step: the refund's call (the ticket's is copied)
UPGRADE_POINTS: tuple[tuple[str, int], ...] = (
    ("committing:run.upgraded", 1),
    ("committed:run.upgraded", 1),
)
# The victim runs the fork alone: its first model.called is the fork's first live step.
FORK_POINTS: tuple[tuple[str, int], ...] = (
    ("committing:model.called", 1),
    ("committed:model.called", 1),
)
VERSION_SHAPES = ("upgrade", "fork")
WITHIN = 15.0  # seconds for a worker to drain, register, or a run to park
T = TypeVar("T")


def upgrade_cells() -> list[Cell]:
    return [Cell(p, k, "sigkill", shape="upgrade") for p, k in UPGRADE_POINTS]


def fork_cells() -> list[Cell]:
    return [Cell(p, k, "sigkill", shape="fork") for p, k in FORK_POINTS]


def version_cells() -> list[Cell]:
    """SIGKILL at each point of each shape."""
    return upgrade_cells() + fork_cells()


@attrs.frozen
class ForkExpected:
    """What the clean fork did."""

    output: str
    steps: int  # its model calls, the copied ones included
    prefix: tuple[str, ...]  # the types of the events it copied from its source
    effect_kinds: tuple[str, ...]  # the effects it applied itself
    asked: int  # the approvals it asked again


@attrs.frozen
class UpgradeObserved:
    run: Observed  # as a plain cell's run (chaos.oracle)
    systems: tuple[tuple[int, str], ...]  # (position, system prompt) of each of its requests
    target: str  # the version upgrade_run moved it to ("" if never called)
    route: str  # its row's route at the end


@attrs.frozen
class ForkObserved:
    state: RunState  # the fork's
    journal: tuple[Row, ...]  # the fork's
    source: tuple[Row, ...]  # the source's journal when the fork was made
    source_raw: tuple[tuple[Any, ...], ...]  # ... byte for byte
    source_raw_after: tuple[tuple[Any, ...], ...]  # ... and after the cell
    arrivals: tuple[tuple[float, int], ...]  # (when, position): the requests since the fork
    effects: tuple[Effect, ...]  # applied by the fork
    source_effects: tuple[tuple[str, str, int], ...]  # (key, kind, requests) when it was made
    source_effects_after: tuple[tuple[str, str, int], ...]  # ... and after the cell
    deadletters: int
    allowed_repeats: int  # the fork's calls in flight at the fault
    unsent: frozenset[int]  # the step announced and not sent at the fault
    at: int


# -- the oracle ----------------------------------------------------------------------------------


def judge_upgrade(seen: UpgradeObserved, expected: Expected) -> Verdict:
    verdict = judge(seen.run, expected)
    problems = [*verdict.problems, *upgrade_problems(seen)]
    return Verdict(tuple(problems), verdict.duplicate_calls, verdict.duplicate_usd)


def upgrade_problems(seen: UpgradeObserved) -> list[str]:
    """One ``run.upgraded``, by value, to the version asked; no step invalidated; the row pinned
    to the new version; each request made by the version the run was on."""
    journal = seen.run.journal
    problems = []
    started = next((r for r in journal if r.type == "run.started"), None)
    version = started.data.get("version", "") if started is not None else ""
    upgrades = [r for r in journal if r.type == "run.upgraded"]
    if len(upgrades) != 1:
        problems.append(f"run.upgraded recorded {len(upgrades)} times, expected once")
    for row in upgrades:
        moved = (row.data.get("from_version"), row.data.get("to_version"), row.data.get("how"))
        if moved != (version, seen.target, "value"):
            problems.append(
                f"run.upgraded at seq {row.seq} moved {moved[0]!r} to {moved[1]!r} by "
                f"{moved[2]!r}; expected {version!r} to {seen.target!r} by 'value'"
            )
    if not version or version == seen.target:
        problems.append(f"the run started on version {version!r} and moved to {seen.target!r}")
    invalidated = [r.data.get("from_step") for r in journal if r.type == "steps.invalidated"]
    if invalidated:
        problems.append(f"steps invalidated from {invalidated}: calls taken by value were re-asked")
    pinned = version_route(NAME, seen.target)
    if seen.route != pinned:
        problems.append(f"the run's route is {seen.route!r}, not {pinned!r}: not pinned")
    # The calls recorded before the move were made by version A, those after by B.
    moved_at = next(
        (
            sum(1 for r in journal[: i + 1] if r.type == "model.called")
            for i, r in enumerate(journal)
            if r.type == "run.upgraded"
        ),
        None,
    )
    if moved_at is not None:
        old, new = versioned_system(""), versioned_system(DEPLOY)
        for step, system in seen.systems:
            want = old if step < moved_at else new
            if system != want:
                which = "before" if step < moved_at else "after"
                problems.append(
                    f"step {step + 1} ({which} the move) was asked with system prompt "
                    f"{system!r}, expected {want!r}"
                )
    return problems


def judge_fork(seen: ForkObserved, expected: ForkExpected) -> Verdict:
    problems = []
    state = seen.state
    if state.status != "completed":
        problems.append(f"fork {state.status} ({state.error_class}: {state.error})")
    elif state.output != expected.output:
        problems.append(f"fork output {state.output!r}, expected {expected.output!r}")
    problems += prefix_problems(seen, expected)
    calls, counts = fork_call_problems(seen, expected)
    problems += calls
    problems += fork_effect_problems(seen, expected)
    problems += source_problems(seen)
    if seen.deadletters:
        problems.append(f"{seen.deadletters} messages dead-lettered")
    repeats = sum(n - 1 for n in counts.values())
    return Verdict(tuple(problems), repeats, duplicate_usd(state, counts))


def _cut(journal: Sequence[Row]) -> int | None:
    """Where the fork's own events start: the index of its ``run.forked`` (None: none)."""
    return next((i for i, r in enumerate(journal) if r.type == "run.forked"), None)


def prefix_problems(seen: ForkObserved, expected: ForkExpected) -> list[str]:
    """The fork's journal: the clean fork's prefix, equal by value to the source's first events,
    then one ``run.forked`` naming its source and step."""
    cut = _cut(seen.journal)
    forked = [r for r in seen.journal if r.type == "run.forked"]
    if cut is None or len(forked) != 1:
        return [f"run.forked recorded {len(forked)} times in the fork, expected once"]
    problems = []
    prefix = seen.journal[:cut]
    types = tuple(r.type for r in prefix)
    if types != expected.prefix:
        problems.append(
            f"the fork copied {len(types)} events of its source before run.forked {list(types)}; "
            f"the clean fork copied {len(expected.prefix)} {list(expected.prefix)}"
        )
    for mine, theirs in zip(prefix, seen.source, strict=False):
        if (mine.seq, mine.type, mine.data) != (theirs.seq, theirs.type, theirs.data):
            problems.append(
                f"the fork's event {mine.seq} ({mine.type}) is not its source's "
                f"({theirs.seq}, {theirs.type}) by value"
            )
    if len(prefix) > len(seen.source):
        problems.append(f"the fork holds {len(prefix)} events before run.forked, its source fewer")
    steps = [r.data["step"] for r in prefix if r.type == "model.called"]
    if steps != list(range(1, seen.at)):
        problems.append(f"the fork copied the calls of steps {steps}, forked at step {seen.at}")
    step = forked[0].data.get("step", forked[0].data.get("at"))
    if step != seen.at:
        problems.append(f"run.forked names step {step}, the fork was made at {seen.at}")
    # Contiguous; the copied events and run.forked at epoch 0 (no claim wrote them), then its
    # own, the epochs never going back.
    problems += [f"fork: {p}" for p in journal_problems(seen.journal, None)]
    return problems


def _live(seen: ForkObserved) -> tuple[Row, ...]:
    cut = _cut(seen.journal)
    return seen.journal[cut + 1 :] if cut is not None else seen.journal


def fork_call_problems(
    seen: ForkObserved, expected: ForkExpected
) -> tuple[list[str], Counter[int]]:
    """The calls before the fork's step paid by nobody; from the step on, each call's requests
    are what its journal counts (made or lost in flight), paid twice only for the call in flight
    at the fault; every call of the clean fork made. Returns the problems and the requests per
    position."""
    live = _live(seen)
    received = Counter(pos + 1 for _, pos in seen.arrivals)
    made = Counter(r.data["step"] for r in live if r.type in ("model.called", "model.unreadable"))
    lost: Counter[int] = Counter()
    for row in live:
        if row.type == "model.lost":
            lost[row.data["step"]] += row.data["count"]
    problems = [
        f"step {step}, before the fork's step {seen.at}, paid again ({n} requests since the fork)"
        for step, n in sorted(received.items())
        if step < seen.at
    ]
    missing = sorted(set(range(seen.at, expected.steps + 1)) - set(made))
    if missing:
        problems.append(f"the fork never recorded the calls of steps {missing}")
    for step in sorted((set(received) | set(made) | set(lost)) - set(range(seen.at))):
        n, m, k = received[step], made[step], lost[step]
        if m + k != n and not (m + k == n + 1 and step in seen.unsent):
            problems.append(
                f"fork step {step}: the server received {n} requests, the journal counts {m} "
                f"made and {k} lost in flight"
            )
    counts = Counter(pos for _, pos in seen.arrivals)
    repeats = sum(n - 1 for n in counts.values())
    if repeats > seen.allowed_repeats:
        problems.append(
            f"{repeats} model calls of the fork paid again, {seen.allowed_repeats} allowed: "
            f"{dict(sorted(received.items()))}"
        )
    recorded = {r.data["step"]: r.at for r in live if r.type == "model.called"}
    for when, pos in seen.arrivals:
        if pos + 1 in recorded and when > recorded[pos + 1]:
            problems.append(f"fork step {pos + 1} was sent again after it was recorded")
    r = receipt(seen.state)
    if r.calls_lost != sum(lost.values()):
        problems.append(
            f"fork receipt: {r.calls_lost} lost in flight, the journal says {dict(lost)}"
        )
    return problems, counts


def fork_effect_problems(seen: ForkObserved, expected: ForkExpected) -> list[str]:
    """Each effect of the fork applied once, under a key of its own intents (not its source's),
    after its intent; its approvals asked again."""
    live = _live(seen)
    problems = []
    kinds = Counter(e.kind for e in seen.effects)
    if sorted(kinds.elements()) != sorted(expected.effect_kinds):
        problems.append(f"the fork applied {dict(kinds)}, expected each of {expected.effect_kinds}")
    own = {r.data["idempotency_key"]: r for r in live if r.type == "tool.intent"}
    inherited = {r.data["idempotency_key"] for r in seen.source if r.type == "tool.intent"}
    for effect in seen.effects:
        intent = own.get(effect.key)
        if effect.key in inherited:
            problems.append(f"the fork applied {effect.kind} under its source's key {effect.key}")
        elif intent is None:
            problems.append(f"the fork applied {effect.kind} under a key none of its intents holds")
        elif intent.at > effect.applied_at:
            problems.append(f"the fork's {effect.kind} applied before its tool.intent was recorded")
        if effect.requests != 1:
            problems.append(f"the fork's {effect.kind} asked for {effect.requests} times")
    asked = sum(1 for r in live if r.type == "approval.requested")
    if asked != expected.asked:
        problems.append(f"the fork asked {asked} approvals, the clean fork {expected.asked}")
    return problems


def source_problems(seen: ForkObserved) -> list[str]:
    """The source untouched: its journal byte for byte, its effects not asked for again."""
    problems = []
    if seen.source_raw_after != seen.source_raw:
        before, after = len(seen.source_raw), len(seen.source_raw_after)
        changed = [
            b[0] for b, a in zip(seen.source_raw, seen.source_raw_after, strict=False) if a != b
        ]
        problems.append(
            f"the source's journal changed: {before} events before the fork, {after} after; "
            f"rewritten: seq {changed}"
        )
    if seen.source_effects_after != seen.source_effects:
        problems.append(
            f"the source's effects were asked for again: {list(seen.source_effects)} before the "
            f"fork, {list(seen.source_effects_after)} after"
        )
    return problems


def note(seen: UpgradeObserved | ForkObserved) -> str:
    """For the tables: the calls paid twice (the one in flight)."""
    if isinstance(seen, UpgradeObserved):
        counts = Counter(pos for _, pos in seen.run.arrivals)
    else:
        counts = Counter(pos for _, pos in seen.arrivals)
    twice = sorted(pos + 1 for pos, n in counts.items() if n > 1)
    return f"step {twice} paid twice" if twice else ""


# -- the cells -----------------------------------------------------------------------------------


async def journal_rows(pool: asyncpg.Pool, actor_id: str) -> tuple[Row, ...]:
    rows = await pool.fetch(
        "SELECT seq, epoch, type, data, extract(epoch FROM created_at)::float8 AS at "
        "FROM toren.journal WHERE actor_id = $1 ORDER BY seq",
        actor_id,
    )
    return tuple(Row(r["seq"], r["epoch"], r["type"], r["data"], r["at"]) for r in rows)


async def raw_journal(pool: asyncpg.Pool, actor_id: str) -> tuple[tuple[Any, ...], ...]:
    """An actor's journal as stored: every column, the data as Postgres' own text."""
    rows = await pool.fetch(
        "SELECT seq, epoch, type, data::text, created_at FROM toren.journal "
        "WHERE actor_id = $1 ORDER BY seq",
        actor_id,
    )
    return tuple(tuple(r) for r in rows)


async def approve_all(client: Client, run_id: str) -> None:
    """Approve every call the run waits on, once each, until cancelled."""
    decided: set[str] = set()
    while True:
        state = await read_run(client, run_id)
        for call in waiting_on(state):
            if call.id not in decided:
                decided.add(call.id)
                await decide(
                    client,
                    run_id,
                    call_id=call.id,
                    approved=True,
                    by=CHAOS,
                    reason=meant_for(call.id),
                    wait=None,
                )
        await anyio.sleep(0.05)


class _VersionExecution(_Execution):
    """What both version cells do besides their run (see chaos.harness for the rest)."""

    def _armed(self, env: dict[str, str]) -> dict[str, str]:
        """``env`` with the cell's point armed (the clean cell: traced)."""
        env = dict(env)
        if self.cell.fault is None:
            env["TOREN_KILL_POINT_TRACE"] = str(self.folder / "trace")
        else:
            env["TOREN_KILL_POINT"] = f"{self.cell.point}#{self.cell.occurrence}"
            env["TOREN_KILL_POINT_DIR"] = str(self.points)
        return env

    async def _drain(self, worker: Any) -> None:
        """``SIGTERM``: the worker drains, releases what it holds and exits."""
        worker.signal(signal.SIGTERM)
        if not await _poll(lambda: worker.exited, WITHIN, 0.05):
            raise CellFailed(f"the {worker.role} worker did not exit within {WITHIN:g}s")

    async def _registered(self, worker: Any) -> None:
        """Wait until ``worker`` is a live worker (registered, its lock held)."""
        deadline = time.monotonic() + WITHIN
        while not any(w["pid"] == worker.pid for w in await live_workers(self.client.pool)):
            if worker.exited or time.monotonic() > deadline:
                raise CellFailed(f"the {worker.role} worker never registered")
            await anyio.sleep(0.05)

    async def _approving(self, run_id: str, body: Callable[[], Awaitable[T]]) -> T:
        """``body``, while every call ``run_id`` waits on is approved."""
        failed: CellFailed | None = None
        async with anyio.create_task_group() as tg:
            tg.start_soon(approve_all, self.client, run_id)
            try:
                out = await body()
            except CellFailed as exc:
                failed = exc
            tg.cancel_scope.cancel()
        if failed is not None:
            raise failed
        return out

    async def _settle(self, run_id: str) -> RunState:
        """Wait until ``run_id`` ended (a replacement started if no worker runs)."""
        self.run_id = run_id
        await self._finish()
        return await read_run(self.client, run_id)


class UpgradeExecution(_VersionExecution):
    """The upgrade cell: parked on version A, moved to B, the victim killed at the move."""

    target = ""

    async def run(self) -> str:
        from toren.runs import upgrade_run

        self.run_id = await start_run(self.client, NAME, f"case {uuid.uuid4().hex[:8]}")
        old = self.start(self.env, "old")
        deadline = time.monotonic() + WITHIN
        while not waiting_on(await read_run(self.client, self.run_id)):
            if time.monotonic() > deadline:
                raise CellFailed(f"the run never parked on its refund within {WITHIN:g}s")
            await anyio.sleep(0.05)
        await self._drain(old)
        self.env = dict(self.env, CHAOS_VERSION=DEPLOY)  # every worker from now on: version B
        victim = self.start(self._armed(self.env), "victim")
        await self._registered(victim)
        self.target = await upgrade_run(self.client, self.run_id, by=CHAOS)
        evidence = ""
        if self.cell.fault is not None:
            await self._reach(victim, None)
            await self._count_in_flight()
            evidence = await self._sigkill(victim, None)
        await self._upgraded()  # then the refund is approved, on version B
        await self._approving(self.run_id, lambda: self._settle(self.run_id))
        return evidence

    async def _upgraded(self) -> None:
        """Wait until the move is recorded (a replacement started if no worker runs)."""
        deadline = time.monotonic() + self.h.bound
        while not any(r.type == "run.upgraded" for r in await self._journal()):
            if not any(w.running for w in self.workers):
                self.start(self.env, "replacement")
            if time.monotonic() > deadline:
                raise CellFailed(f"stuck: run.upgraded not recorded {self.h.bound:g}s on")
            await anyio.sleep(0.05)

    async def _journal(self) -> tuple[Row, ...]:
        return await journal_rows(self.client.pool, self.run_id)

    async def observe(self) -> UpgradeObserved:
        state = await read_run(self.client, self.run_id)
        run = await observe(
            self.client.pool,
            self.run_id,
            state,
            self.recorder.arrivals,
            list(self.effects.effects.values()),
            allowed_repeats=self.allowed_repeats,
            takeover=None,
            unsent=frozenset(step for run, step in self.unsent if run == self.run_id),
        )
        systems = tuple(
            (position(r), system_of(r)) for _, r in self.recorder.arrivals if case(r) == state.input
        )
        route = (await self.client.actor(self.run_id))["route"]
        return UpgradeObserved(run=run, systems=systems, target=self.target, route=route)


class ForkExecution(_VersionExecution):
    """The fork cell: a source run to its end, forked at FORK_AT, the victim killed at the
    fork's first live step."""

    source = ""
    since = 0  # the model requests received before the fork was made
    source_rows: tuple[Row, ...] = ()
    source_raw: tuple[tuple[Any, ...], ...] = ()
    source_effects: tuple[tuple[str, str, int], ...] = ()

    async def run(self) -> str:
        from toren.runs import fork_run

        self.source = await start_run(self.client, NAME, f"case {uuid.uuid4().hex[:8]}")
        first = self.start(self.env, "source")
        state = await self._approving(self.source, lambda: self._settle(self.source))
        if state.status != "completed":
            raise CellFailed(f"the source run {state.status}: {state.error}")
        await self._drain(first)
        pool = self.client.pool
        self.source_rows = await journal_rows(pool, self.source)
        self.source_raw = await raw_journal(pool, self.source)
        self.source_effects = self._effects_of(self.source)
        self.since = len(self.recorder.arrivals)
        self.run_id = await fork_run(self.client, self.source, at=FORK_AT, by=CHAOS)
        victim = self.start(self._armed(self.env), "victim")
        return await self._approving(self.run_id, lambda: self._fault_and_finish(victim))

    async def _fault_and_finish(self, victim: Any) -> str:
        evidence = ""
        if self.cell.fault is not None:
            await self._reach(victim, None)
            await self._in_flight()
            evidence = await self._sigkill(victim, None)
        await self._settle(self.run_id)
        return evidence

    def _effects_of(self, run_id: str) -> tuple[tuple[str, str, int], ...]:
        found = (e for e in self.effects.effects.values() if e.run == run_id)
        return tuple(sorted((e.key, e.kind, e.requests) for e in found))

    def _arrivals(self) -> list[tuple[float, int]]:
        """The fork's model requests: every one since it was made (its source had ended)."""
        return [(t, position(r)) for t, r in self.recorder.arrivals[self.since :]]

    async def _in_flight(self) -> None:
        """A fork's call the server saw and its journal has not recorded may be paid again; a
        call announced and not sent is counted lost in flight."""
        journal = await journal_rows(self.client.pool, self.run_id)
        cut = _cut(journal)
        live = journal[cut + 1 :] if cut is not None else journal
        recorded = sum(1 for r in live if r.type == "model.called")
        arrivals = self._arrivals()
        self.allowed_repeats = max(0, len({pos for _, pos in arrivals}) - recorded)
        state = await read_run(self.client, self.run_id)
        if state.calling is not None:
            step = state.calling.step
            if not any(pos == step - 1 for _, pos in arrivals):
                self.unsent = frozenset({(self.run_id, step)})

    async def observe(self) -> ForkObserved:
        pool = self.client.pool
        return ForkObserved(
            state=await read_run(self.client, self.run_id),
            journal=await journal_rows(pool, self.run_id),
            source=self.source_rows,
            source_raw=self.source_raw,
            source_raw_after=await raw_journal(pool, self.source),
            arrivals=tuple(self._arrivals()),
            effects=tuple(e for e in self.effects.effects.values() if e.run == self.run_id),
            source_effects=self.source_effects,
            source_effects_after=self._effects_of(self.source),
            deadletters=await pool.fetchval("SELECT count(*) FROM toren.deadletters"),
            allowed_repeats=self.allowed_repeats,
            unsent=frozenset(step for run, step in self.unsent if run == self.run_id),
            at=FORK_AT,
        )


async def run_version_cell(
    harness: Harness, cell: Cell, expected: Expected | ForkExpected | None
) -> tuple[CellResult, UpgradeObserved | ForkObserved]:
    """Run an upgrade cell (judged against the clean upgrade, as a plain run) or a fork cell
    (against the clean fork); ``expected`` None: the clean cell, its victim traced."""
    prefix = f"{harness.mutation}/" if harness.mutation else ""
    folder = harness.workdir / f"{prefix}{cell.slug}"
    folder.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    recorder = _Recorder()
    kind = UpgradeExecution if cell.shape == "upgrade" else ForkExecution
    async with (
        harness.database() as url,
        AnthropicServer(recorder) as model,
        EffectServer() as effects,
    ):
        client = await Client.connect(url)
        execution = kind(harness, cell, folder, client, model, effects, url, recorder)
        try:
            evidence = ""
            with anyio.fail_after(harness.bound * 2 + 60):
                try:
                    with applied_here(harness.mutation):
                        evidence = await execution.run()
                except CellFailed as exc:
                    execution.problems.append(str(exc))
                observed = await execution.observe()
        finally:
            for w in execution.workers:
                w.close()
            await client.close()
    problems = list(execution.problems)
    verdict = None
    if isinstance(observed, UpgradeObserved) and isinstance(expected, Expected):
        verdict = judge_upgrade(observed, expected)
    elif isinstance(observed, ForkObserved) and isinstance(expected, ForkExpected):
        verdict = judge_fork(observed, expected)
    elif expected is not None:
        raise TypeError(f"a {cell.shape} cell judged against {type(expected).__name__}")
    if verdict is not None:
        problems.extend(verdict.problems)
    result = CellResult(
        cell,
        tuple(problems),
        verdict.duplicate_calls if verdict else 0,
        verdict.duplicate_usd if verdict else Decimal(0),
        time.monotonic() - started,
        evidence,
        note(observed),
    )
    return result, observed


def _unreached(folder: Path, points: Sequence[tuple[str, int]]) -> list[str]:
    trace = Counter((folder / "trace").read_text().split()) if (folder / "trace").exists() else {}
    return [f"{p}#{k} (reached {trace.get(p, 0)} times)" for p, k in points if trace.get(p, 0) < k]


async def clean_upgrade_run(harness: Harness) -> Expected:
    """Run the upgrade without a fault (the expected result), check it against its oracle, and
    that its victim reaches the points of its cells.

    Raises:
        RuntimeError: the clean cell failed, or misses a point (the cells are out of date).
    """
    cell = Cell("clean", 0, None, shape="upgrade")
    result, seen = await harness.run_cell(cell, None)
    if not isinstance(seen, UpgradeObserved):
        raise TypeError("the clean upgrade observed as another shape")
    state = seen.run.state
    expected = Expected(
        output=state.output or "",
        steps=len(state.calls),
        effect_kinds=tuple(sorted(e.kind for e in seen.run.effects)),
    )
    problems = [*result.problems, *judge_upgrade(seen, expected).problems]
    problems += _unreached(harness.workdir / cell.slug, UPGRADE_POINTS)
    if problems or state.status != "completed":
        raise RuntimeError(f"the clean upgrade failed: {problems} {state.error}")
    return expected


async def clean_fork_run(harness: Harness) -> ForkExpected:
    """Run the fork without a fault (the expected result), check it against its oracle, and
    that its victim reaches the points of its cells.

    Raises:
        RuntimeError: the clean cell failed, or misses a point (the cells are out of date).
    """
    cell = Cell("clean", 0, None, shape="fork")
    result, seen = await harness.run_cell(cell, None)
    if not isinstance(seen, ForkObserved):
        raise TypeError("the clean fork observed as another shape")
    cut = _cut(seen.journal)
    live = seen.journal[cut + 1 :] if cut is not None else ()
    expected = ForkExpected(
        output=seen.state.output or "",
        steps=len(seen.state.calls),
        prefix=tuple(r.type for r in seen.journal[: cut or 0]),
        effect_kinds=tuple(sorted(e.kind for e in seen.effects)),
        asked=sum(1 for r in live if r.type == "approval.requested"),
    )
    problems = [*result.problems, *judge_fork(seen, expected).problems]
    source_calls = sum(1 for r in seen.source if r.type == "model.called")
    if expected.steps != source_calls or not expected.effect_kinds or not expected.asked:
        problems.append(
            f"the clean fork {expected} is not the run it forked ({source_calls} calls)"
        )
    problems += _unreached(harness.workdir / cell.slug, FORK_POINTS)
    if problems:
        raise RuntimeError(f"the clean fork failed: {problems} {seen.state.error}")
    return expected
