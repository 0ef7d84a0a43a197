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
again) or just after it (``committed:run.upgraded#1``). A replacement of version B takes over
once the move is recorded; the harness approves the refund, the run completes.

The **fork** cell: a worker (``source``) runs the source run to its end and drains. The harness
forks it at step :data:`FORK_AT` (``toren.runs.fork_run``: the fork's row, its journal's prefix
copied from the source's, ``run.forked`` and its first ``Continue`` in one transaction); the
victim runs the fork and is ``SIGKILL``ed at its first live step, just before and just after
its first ``model.called`` commit; a replacement finishes it (the harness approves the fork's
refund, asked again).

What must hold after each is in :mod:`chaos.version_oracle`.
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
import orjson

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
from chaos.oracle import Expected, Row, meant_for, observe
from chaos.processes import Worker
from chaos.servers import EffectServer, case, position, system_of
from chaos.version_oracle import (
    DEPLOY,
    NAME,
    ForkExpected,
    ForkObserved,
    UpgradeObserved,
    cut_at,
    judge_fork,
    judge_upgrade,
    note,
)
from toren import Client
from toren._agent.directory import card_version
from toren._core.workers import live_workers
from toren.runs import RunState, decide, read_run, receipt, start_run, waiting_on
from toren.testing import AnthropicServer

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


def _agents(stats: Any) -> dict[str, Any]:
    """The agent cards in a worker's published statistics."""
    stats = orjson.loads(stats) if isinstance(stats, str | bytes) else stats
    agents = stats.get("agents") if isinstance(stats, dict) else None
    return agents if isinstance(agents, dict) else {}


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

    async def _drain(self, worker: Worker) -> None:
        """``SIGTERM``: the worker drains, releases what it holds and exits."""
        worker.signal(signal.SIGTERM)
        if not await _poll(lambda: worker.exited, WITHIN, 0.05):
            raise CellFailed(f"the {worker.role} worker did not exit within {WITHIN:g}s")

    async def _registered(self, worker: Worker) -> None:
        """Wait until ``worker`` is a live worker that published its card of the agent (with
        the version it serves)."""
        deadline = time.monotonic() + WITHIN
        while not any(
            w["pid"] == worker.pid and card_version(_agents(w["stats"]).get(NAME))
            for w in await live_workers(self.client.pool)
        ):
            if worker.exited or time.monotonic() > deadline:
                raise CellFailed(f"the {worker.role} worker never published its {NAME} card")
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
            (t, position(r), system_of(r))
            for t, r in self.recorder.arrivals
            if case(r) == state.input
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

    async def _fault_and_finish(self, victim: Worker) -> str:
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
        cut = cut_at(journal)
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
        state = await read_run(self.client, self.run_id)
        return ForkObserved(
            state=state,
            receipt=receipt(state),
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
    cut = cut_at(seen.journal)
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
