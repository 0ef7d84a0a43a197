"""The batch cells: group commit under the kill matrix. Several runs of the ``chaos`` agent in
flight on one worker whose steps commit in batches, the worker faulted inside a batch.

The victim commits through one lane (``TOREN_COMMIT_LANES=1``): a step that arrives while the
lane is busy queues, and the oldest waiter leads the queue's steps as one pipelined transaction
(:mod:`toren._core.group_commit`). :data:`RUNS` runs start together, so their steps arrive
together and batch (the clean cell counts the batches, and checks that the points' occurrences
are reached). The victim logs each batch's members at DEBUG (each step's actor) before it sends
it; the cells read them from there.

The cells fault the ``k``-th batch:

- ``batch.sending``: the worker frozen before the batch is sent (nothing of it at the server);
- ``batch.in_flight``, on the harness's side: the worker frozen at ``batch.sending``, the harness
  locks the row of the batch's first step's actor (``FOR UPDATE``, in a transaction of its own)
  and lets the worker go; the batch is sent and its first step waits on the lock inside the batch's
  transaction, the worker waiting for the answer: the batch is in flight, at the server, not
  committed. Then the fault lands and the lock goes. Under ``sigkill`` the server may still
  commit the batch, all of it, after its client died (the pipeline was received whole; the note
  says which happened); under ``pg_terminate`` its backend dies with it and nothing of it commits;
- ``batch.committed``: the batch's commit returned, no member told yet.

Each under ``sigkill`` (a fresh worker finishes), the first two under ``pg_terminate`` too (the
worker lives on, learns that its sessions went, and must recover by itself; past the commit that
changes nothing of the batch), and ``batch.sending`` under three more:

- ``sigstop``: a survivor claims the runs once their leases lapsed, and the continued zombie
  sends its batch, every step of which must be fenced out, alone;
- ``fence_one``: one step of the batch fenced out beside batch-mates that commit: the harness
  makes the lease of the batch's last step's run lapse (as if a renewal had missed it), a worker
  allowed one actor claims that run and is held just after its claim, and the victim goes on:
  its batch commits, that step fenced out alone;
- ``refuse_one``: one step of the batch refused by the database (a trigger the harness adds
  raises ``disk_full`` for that run's journal rows, twice, counted by a sequence): the batch
  aborts, each step commits alone, the refused one is refused again, charged to its message,
  and commits when tried again.

Then each run is judged as the plain cells judge
one (:func:`chaos.oracle.judge`): the clean output, every model call paid once plus the one in
flight at the fault (one per run for a worker that lives on), the calls made and lost what the
server received, each effect once after its intent, the journal contiguous with epochs never
going back and nothing stale after the takeover, one approval for the refund, no dead letter,
nothing stuck.
"""

from __future__ import annotations

import signal
import time
import uuid
from decimal import Decimal
from typing import Any

import anyio
import asyncpg

from chaos.batch_oracle import (
    COMMITTED,
    SENDING,
    BatchObserved,
    batches_in,
    journal_problems_of,
    judge_batch,
    note,
)
from chaos.harness import (
    _ZOMBIE_STOPPED,
    CHAOS,
    LEASE,
    Cell,
    CellFailed,
    CellResult,
    Fault,
    Harness,
    _Execution,
    _poll,
    _Recorder,
)
from chaos.oracle import Expected, Takeover, meant_for, observe
from chaos.processes import Worker
from chaos.servers import EffectServer, case, position
from toren import Client, InternalError
from toren.runs import ENDED, RunState, decide, read_run, start_run, waiting_on
from toren.testing import AnthropicServer

RUNS = 8  # runs in flight on the victim at once
# One lane, so that steps that arrive while it is busy batch. Leases of 6 s: eight runs on one
# worker of a loaded machine keep theirs (with the harness's 2 s, a renewal 1.5 s late gives
# every actor up, the batch with them), and so does a victim that stands still while another
# worker claims (fence_one). The sigstop cells keep 2 s: their survivor waits for the lapse.
SETTINGS = {"TOREN_COMMIT_LANES": "1", "TOREN_LEASE_SECONDS": "6"}

# (point, occurrence, faults): the second batch is made of the runs' first model.called steps
# (the first, of their starts, of fewer of them: the victim claims the runs a few at a time).
BATCH_POINTS: tuple[tuple[str, int, tuple[Fault, ...]], ...] = (
    ("batch.sending", 2, ("sigkill", "pg_terminate", "sigstop", "fence_one", "refuse_one")),
    ("batch.in_flight", 2, ("sigkill", "pg_terminate")),
    # Not pg_terminate: past the commit, sessions lost change nothing of the batch (its rows
    # are in hand); a worker losing its sessions after a commit is the plain cells' concern.
    ("batch.committed", 2, ("sigkill",)),
)

# What a step statement waiting on the harness's lock shows in pg_stat_activity.
_STEP_TEXT = "%consumed AS (%"


# The refusal of the refuse_one cells: the target's first journal rows refused (disk full),
# twice; a sequence counts them, outside the transactions that the refusals roll back.
_REFUSE = """
CREATE TABLE public.chaos_refuse (actor_id text PRIMARY KEY);
CREATE SEQUENCE public.chaos_refused;
CREATE FUNCTION public.chaos_refuse() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF EXISTS (SELECT 1 FROM public.chaos_refuse WHERE actor_id = NEW.actor_id) THEN
        IF nextval('public.chaos_refused') <= 2 THEN
            RAISE EXCEPTION 'chaos: no space left for %', NEW.actor_id USING ERRCODE = 'disk_full';
        END IF;
    END IF;
    RETURN NEW;
END $$;
CREATE TRIGGER chaos_refuse BEFORE INSERT ON toren.journal
    FOR EACH ROW EXECUTE FUNCTION public.chaos_refuse();
"""


def _stopped_lines(log: str) -> str:
    """The lines of ``log`` in which the worker gave an actor up (fenced out, lease lost)."""
    return "\n".join(line for line in log.splitlines() if any(s in line for s in _ZOMBIE_STOPPED))


def _went(log: str) -> str:
    """What became of the batch a worker held at its point, from its log since it went on:
    ``committed`` (its next line about batches says so), ``aborted`` (it sent another batch
    first: the failed batch's steps went alone), or ``""`` (nothing yet)."""
    for line in log.splitlines():
        if COMMITTED.search(line):
            return "committed"
        if SENDING.search(line):
            return "aborted"
    return ""


def batch_cells() -> list[Cell]:
    return [Cell(p, k, f, shape="batch") for p, k, faults in BATCH_POINTS for f in faults]


class BatchExecution(_Execution):
    """One batch cell: :data:`RUNS` runs on the victim, faulted in its ``k``-th batch."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)  # as every cell's (see chaos.harness)
        self.env.update(SETTINGS)
        if self.cell.fault == "sigstop":
            self.env["TOREN_LEASE_SECONDS"] = str(LEASE)
        self.runs: list[str] = []
        self.allowed: dict[str, int] = {}
        self.unsent_of: dict[str, frozenset[int]] = {}
        self.takeover_of: dict[str, Takeover] = {}
        self.members: tuple[str, ...] = ()
        self.landed = ""  # what became of a batch in flight when its worker was killed

    async def run(self) -> str:
        cell = self.cell
        tag = uuid.uuid4().hex[:8]
        for i in range(RUNS):
            self.runs.append(await start_run(self.client, "chaos", f"case {tag} {i}"))
        self.run_id = self.runs[0]  # the one the base class's helpers look at
        victim_env = dict(self.env)
        if cell.fault is None:
            victim_env["TOREN_KILL_POINT_TRACE"] = str(self.folder / "trace")
        else:
            point = "batch.sending" if cell.point == "batch.in_flight" else cell.point
            victim_env["TOREN_KILL_POINT"] = f"{point}#{cell.occurrence}"
            victim_env["TOREN_KILL_POINT_DIR"] = str(self.points)
        victim = self.start(victim_env, "victim")
        evidence = ""
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._approve_all)
            try:
                if cell.fault is not None:
                    await self._reach(victim, None)
                    self.members = self._members(victim)
                    await self._count_all()
                    if cell.point == "batch.in_flight":
                        evidence = await self._in_flight(victim, cell.fault)
                    elif cell.fault == "sigstop":
                        evidence = await self._stopped(victim)
                    elif cell.fault == "fence_one":
                        evidence = await self._fence_one(victim)
                    elif cell.fault == "refuse_one":
                        evidence = await self._refuse_one(victim)
                    else:
                        evidence = await getattr(self, f"_{cell.fault}")(victim, None)
                await self._finish_all()
            except CellFailed as exc:
                self.problems.append(str(exc))
            tg.cancel_scope.cancel()
        return evidence

    def _members(self, victim: Worker) -> tuple[str, ...]:
        """The actors of the batch the victim holds at its point (its last batch logged)."""
        found = SENDING.findall(victim.log())
        if not found:
            raise CellFailed("the victim logged no batch before its point")
        size, names = found[-1]
        members = tuple(n.strip().strip("'\"") for n in names.split(","))
        if len(members) != int(size) or len(members) < 2:
            raise CellFailed(f"the faulted batch holds {members}: not a batch")
        return members

    async def _count_all(self) -> None:
        """Per run, as the plain cells count one (:meth:`_Execution._count_in_flight`): the
        calls the server saw and the journal has not recorded may be paid again; a worker that
        lives on may be cut again mid-call once it learns (one per run); the call announced and
        not sent at the fault may be counted lost."""
        for run in self.runs:
            state = await read_run(self.client, run)
            seen = {position(r) for _, r in self.recorder.arrivals if case(r) == state.input}
            recorded = await self.client.pool.fetchval(
                "SELECT count(*) FROM toren.journal WHERE type = 'model.called' AND actor_id = $1",
                run,
            )
            allowed = max(0, len(seen) - recorded)
            if self.cell.fault in ("pg_terminate", "sigstop"):
                allowed = max(allowed, 1)
            self.allowed[run] = allowed
            unsent: set[int] = set()
            if state.calling is not None:
                step = state.calling.step
                arrived = sum(
                    1
                    for _, r in self.recorder.arrivals
                    if case(r) == state.input and position(r) == step - 1
                )
                lost = await self.client.pool.fetchval(
                    "SELECT coalesce(sum((data->>'count')::int), 0) FROM toren.journal "
                    "WHERE actor_id = $1 AND type = 'model.lost' AND (data->>'step')::int = $2",
                    run,
                    step,
                )
                if arrived <= lost:
                    unsent.add(step)
            self.unsent_of[run] = frozenset(unsent)

    # -- faults -------------------------------------------------------------------------------

    async def _in_flight(self, victim: Worker, fault: Fault) -> str:
        """The batch sent and waiting at the server on the harness's lock; then the fault."""
        lock = await asyncpg.connect(self.env["TOREN_DATABASE_URL"])
        try:
            held = lock.transaction()
            await held.start()
            # The leader's row (the batch's first step): its fence waits, and the batch with
            # it; nothing else of the worker waits but its lease renewal.
            await lock.execute(
                "SELECT 1 FROM toren.actors WHERE actor_id = $1 FOR UPDATE", self.members[0]
            )
            self._go(None)
            backend = await self._waiting_batch(lock)
            if fault == "sigkill":
                rows = await self._journal_rows(lock)
                if not victim.kill():
                    raise CellFailed("the victim did not die of SIGKILL")
                await held.rollback()
                if not await self._gone(lock, backend):
                    raise CellFailed(f"the batch's backend {backend} outlived the lock by 10s")
                landed = await self._journal_rows(lock) > rows
                self.landed = (
                    "the batch committed after its worker died"
                    if landed
                    else "the batch died with its worker"
                )
                return (
                    f"pid {victim.pid} SIGKILLed while its batch of {len(self.members)} waited "
                    f"at the server (backend {backend}); {self.landed}"
                )
            offset = len(victim.log())
            ended = await self._terminate(lock)
            await held.rollback()
            if not await _poll(
                lambda: "lost its lock connection" in victim.log()[offset:], 15, 0.05
            ):
                raise CellFailed(f"{ended} sessions terminated, but the worker never noticed")
            self.landed = "the batch rolled back with its backend"
            return (
                f"{ended} sessions terminated while the batch of {len(self.members)} waited at "
                f"the server (backend {backend}); the worker logged the loss"
            )
        finally:
            await lock.close()

    async def _waiting_batch(self, conn: asyncpg.Connection) -> int:
        """The victim's backend whose step statement waits on the harness's lock."""
        deadline = time.monotonic() + 10
        while True:
            pid = await conn.fetchval(
                "SELECT pid FROM pg_stat_activity WHERE datname = $1 "
                "AND application_name LIKE 'toren-worker%' AND wait_event_type = 'Lock' "
                "AND query LIKE $2",
                self.dbname,
                _STEP_TEXT,
            )
            if pid is not None:
                return int(pid)
            if time.monotonic() > deadline:
                raise CellFailed("the batch never reached the server's lock within 10s")
            await anyio.sleep(0.005)

    async def _gone(self, conn: asyncpg.Connection, backend: int) -> bool:
        async def alive() -> bool:
            found = await conn.fetchval(
                "SELECT count(*) FROM pg_stat_activity WHERE pid = $1", backend
            )
            return bool(found)

        with anyio.move_on_after(10):
            while await alive():
                await anyio.sleep(0.01)
            return True
        return False

    async def _journal_rows(self, conn: asyncpg.Connection) -> int:
        return int(await conn.fetchval("SELECT count(*) FROM toren.journal"))

    async def _terminate(self, conn: asyncpg.Connection) -> int:
        ended = await conn.fetchval(
            "SELECT count(*) FILTER (WHERE pg_terminate_backend(pid)) FROM pg_stat_activity "
            "WHERE datname = $1 AND application_name LIKE 'toren-worker%'",
            self.dbname,
        )
        if not ended:
            raise CellFailed("the worker had no database session to terminate")
        return int(ended)

    async def _stopped(self, victim: Worker) -> str:
        """``SIGSTOP`` at the point; a survivor claims the runs once their leases lapsed (in
        one claim or several: the runs claimed last have the latest leases, so it is not held
        at its claim); the zombie, continued, sends its batch: every step fenced out."""
        before = {run: await self._takeover(run) for run in self.members}
        victim.signal(signal.SIGSTOP)
        if not await _poll(lambda: victim.stopped, 5):
            raise CellFailed("the victim was never seen stopped")
        self._go(None)  # it goes on from the point once continued
        self.start(self.env, "survivor")
        deadline = time.monotonic() + LEASE + 20
        while True:
            now = {run: await self._takeover(run) for run in self.members}
            if all(now[r].epoch > before[r].epoch for r in self.members):
                break
            if time.monotonic() > deadline:
                taken = sum(now[r].epoch > before[r].epoch for r in self.members)
                raise CellFailed(f"{taken} of the batch's {len(self.members)} runs taken over")
            await anyio.sleep(0.05)
        if not victim.stopped:
            raise CellFailed("the victim was not stopped through the takeover")
        self.takeover_of = {run: await self._takeover(run) for run in self.runs}
        offset = len(victim.log())
        victim.signal(signal.SIGCONT)
        fenced = await _poll(
            lambda: any(s in victim.log()[offset:] for s in _ZOMBIE_STOPPED), 10, 0.05
        )
        if not fenced:
            self.problems.append("the zombie never stopped its runs after SIGCONT")
        return (
            f"stopped at the point; the batch's {len(self.members)} runs claimed meanwhile; "
            "continued, the zombie stopped its copies"
        )

    async def _fence_one(self, victim: Worker) -> str:
        """The batch's last step's run taken by another worker while the batch waits to go: its
        lease made to lapse (as if a renewal had missed it), a worker allowed one actor claims
        it and is held just after its claim; the victim goes on, its batch commits with that
        step fenced out, alone; then the other worker finishes the run."""
        target = self.members[-1]  # not the leader: its host stopped, the batch goes on
        before = await self._takeover(target)
        await self.client.pool.execute(
            "UPDATE toren.actors SET lease_expires_at = now() WHERE actor_id = $1", target
        )
        held = self.folder / "taker"
        held.mkdir()
        env = dict(
            self.env,
            TOREN_MAX_ACTORS="1",
            TOREN_KILL_POINT="actor.claimed#1",
            TOREN_KILL_POINT_DIR=str(held),
        )
        self.start(env, "taker")
        if not await _poll((held / "hit").exists, 20, 0.01):
            raise CellFailed("no worker claimed the batch's run whose lease lapsed")
        taken = await self._takeover(target)
        owners = {r["owner"] for r in await self._rows(self.members[:-1])}
        if taken.epoch <= before.epoch or len(owners) != 1:
            raise CellFailed(f"{target} not taken alone: epoch {taken.epoch}, others' {owners}")
        self.takeover_of[target] = taken
        offset = len(victim.log())
        self._go(None)
        await _poll(lambda: _went(victim.log()[offset:]) != "", 10, 0.02)
        committed = _went(victim.log()[offset:]) == "committed"
        fenced = await _poll(lambda: target in _stopped_lines(victim.log()[offset:]), 10, 0.02)
        (held / "go").touch()
        if not committed or not fenced:  # the fault landed: what the worker did is the finding
            went = "committed" if committed else "never committed"
            self.problems.append(
                f"the batch of {len(self.members)} {went}; its taken step "
                f"{'was' if fenced else 'was never'} fenced out"
            )
        return (
            f"{target} claimed by another worker at epoch {taken.epoch} at the point; the batch "
            f"of {len(self.members)} committed, that step fenced out"
        )

    async def _refuse_one(self, victim: Worker) -> str:
        """The database refuses the batch's last step twice (a trigger raising ``disk_full``
        for its run's first journal row, counted by a sequence: outside any transaction): the
        batch aborts, each step commits alone, the refused one is refused again, charged to its
        message, and commits when tried again."""
        target = self.members[-1]
        await self.client.pool.execute(_REFUSE)
        await self.client.pool.execute("INSERT INTO public.chaos_refuse VALUES ($1)", target)
        offset = len(victim.log())
        self._go(None)
        refused = await _poll(
            lambda: (
                f"{target}: message" in victim.log()[offset:]
                and "the database refused the step" in victim.log()[offset:]
            ),
            10,
            0.02,
        )
        tries = await self.client.pool.fetchval("SELECT last_value FROM public.chaos_refused")
        await _poll(lambda: _went(victim.log()[offset:]) != "", 10, 0.02)
        alone = _went(victim.log()[offset:]) == "aborted"
        if not refused or tries < 2 or not alone:  # the fault landed: the worker's doing
            self.problems.append(
                f"the refused step was not committed alone and charged: "
                f"{'charged' if refused else 'never charged'} to its message, {tries} "
                f"refusals, its batch {'aborted' if alone else 'committed'}"
            )
        return (
            f"{target}'s step refused in its batch of {len(self.members)} (aborted: each step "
            "alone) and alone again; charged to its message, committed on its next try"
        )

    async def _rows(self, actors: list[str] | tuple[str, ...]) -> list[asyncpg.Record]:
        return list(
            await self.client.pool.fetch(
                "SELECT actor_id, owner, epoch FROM toren.actors WHERE actor_id = ANY($1)",
                list(actors),
            )
        )

    # -- driving the runs -----------------------------------------------------------------------

    async def _approve_all(self) -> None:
        """Approve each run's refund once, as soon as the run waits for it."""
        decided: set[str] = set()
        while True:
            for run in self.runs:
                if run in decided:
                    continue
                state = await self._state(run)
                if state is None:
                    continue
                calls = waiting_on(state)
                for call in calls:
                    await decide(
                        self.client,
                        run,
                        call_id=call.id,
                        approved=True,
                        by=CHAOS,
                        reason=meant_for(call.id),
                        wait=None,
                    )
                if calls:
                    decided.add(run)
            await anyio.sleep(0.05)

    async def _state(self, run: str) -> RunState | None:
        """The run's state; None if its journal cannot be folded (judged as such at the end)."""
        try:
            return await read_run(self.client, run)
        except InternalError:
            return None

    async def _finish_all(self) -> None:
        deadline = time.monotonic() + self.h.bound
        while True:
            found = [await self._state(run) for run in self.runs]
            states = [s for s in found if s is not None]  # an unreadable run is judged so
            if all(s.status in ENDED for s in states):
                return
            if not any(w.running for w in self.workers):
                self.start(self.env, "replacement")
            if time.monotonic() > deadline:
                left = sum(s.status not in ENDED for s in states)
                raise CellFailed(f"stuck: {left} runs still unfinished {self.h.bound:g}s on")
            await anyio.sleep(0.1)


async def run_batch_cell(
    harness: Harness, cell: Cell, expected: Expected | None
) -> tuple[CellResult, BatchObserved]:
    """Run a batch cell (``expected`` None: the clean cell, its points traced)."""
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
        execution = BatchExecution(harness, cell, folder, client, model, effects, url, recorder)
        try:
            with anyio.fail_after(harness.bound * 2 + 60):
                evidence = await execution.run()
            runs = []
            unreadable = []
            for i, run in enumerate(execution.runs):
                try:
                    state = await read_run(client, run)
                except InternalError as exc:
                    unreadable.append((i, exc.what, await journal_problems_of(client, run)))
                    continue
                runs.append(
                    await observe(
                        client.pool,
                        run,
                        state,
                        recorder.arrivals,
                        list(effects.effects.values()),
                        allowed_repeats=execution.allowed.get(run, 0),
                        takeover=execution.takeover_of.get(run),
                        unsent=execution.unsent_of.get(run, frozenset())
                        if cell.fault is not None
                        else frozenset(),
                    )
                )
        finally:
            for w in execution.workers:
                w.close()
            await client.close()
    batches, batched = batches_in(w.log() for w in execution.workers)
    observed = BatchObserved(tuple(runs), tuple(unreadable), batches, batched, execution.members)
    problems = list(execution.problems)
    calls, usd = 0, Decimal(0)
    if expected is not None:
        more, calls, usd = judge_batch(observed, expected)
        problems.extend(more)
    result = CellResult(
        cell,
        tuple(problems),
        calls,
        usd,
        time.monotonic() - started,
        evidence,
        note(observed, execution.landed),
    )
    return result, observed


async def clean_batch_run(harness: Harness) -> Expected:
    """Run the batch cell without a fault: every run alike and passing the oracle, batches
    formed, each point reached as often as the cells need.

    Raises:
        RuntimeError: the clean cell failed, formed no batch, or misses a point.
    """
    from chaos.matrix import _unreached  # here: chaos.matrix builds its tables on the cells

    cell = Cell("clean", 0, None, shape="batch")
    result, seen = await run_batch_cell(harness, cell, None)
    if seen.unreadable or not seen.runs:
        raise RuntimeError(f"the clean batch cell left unreadable runs: {seen.unreadable}")
    first = seen.runs[0].state
    expected = Expected(
        output=first.output or "",
        steps=len(first.calls),
        effect_kinds=tuple(sorted(e.kind for e in seen.runs[0].effects)),
    )
    problems, _, _ = judge_batch(seen, expected)
    if not result.passed or problems or first.status != "completed":
        raise RuntimeError(f"the clean batch cell failed: {[*result.problems, *problems]}")
    points = [("batch.sending" if p == "batch.in_flight" else p, k) for p, k, _ in BATCH_POINTS]
    short = _unreached(harness, cell, points)
    if short:
        raise RuntimeError(
            f"the clean batch cell does not reach: {', '.join(short)} ({note(seen, '')})"
        )
    return expected
