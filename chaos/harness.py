"""The chaos harness: run the scripted agent once per cell, fault a worker at one kill point,
and judge what is left.

A cell is a kill point (with the occurrence to fault) and a fault:

- ``sigkill``: the worker is frozen at the point, then ``SIGKILL``ed; a fresh worker finishes;
- ``pg_terminate``: while it is frozen there, every database session of the worker is
  terminated (``pg_terminate_backend``); it goes on and must notice and recover by itself;
- ``sigstop``: frozen there, then ``SIGSTOP``ped; a survivor claims the run once the lease
  expired and is held just after its claim; the zombie is continued (``SIGCONT``) and must be
  fenced out; then the survivor finishes.

Two points are on the harness's side of the wire: ``model.in_flight`` (the model server holds
the k-th request) and ``tool.in_flight`` (the tracker applied the k-th effect and holds its
answer). Shutdown points are reached after the harness sends ``SIGTERM`` when the second model
request arrives.

Every cell checks that its fault landed (the point was reached; the process died of SIGKILL;
sessions were terminated and the worker logged that it lost its lock; the process was seen
stopped and another worker claimed meanwhile), so a cell cannot pass by missing its fault.

A cell runs one of these shapes: the ``chaos`` agent's run (below), a cross-agent call (``call``
cells: the ``caller`` agent calls the ``callee`` agent, whose child run makes two model calls and
one keyed effect, and answers with its output; judged by :mod:`chaos.calls`), a run whose
tools run in its sandbox on real Docker (``sandbox`` cells, and ``rerunnable`` ones whose sandbox
may run a command again; judged by :mod:`chaos.sandbox`), a Telegram chat whose bot delivers
``at_least_once`` or ``at_most_once`` (driven and judged by :mod:`chaos.telegram`, with this
module's faults), or a schedule firing a slot a second (``schedule`` cells, three workers;
driven and judged by :mod:`chaos.schedules`), or a run moved to another version of its agent
(``upgrade`` cells) or forked from a step (``fork`` cells; both driven and judged by
:mod:`chaos.versions`). The points' occurrences count in the victim
process, which runs caller and child, run and sandbox, or channel and conversation alike. A
third point on the harness's side is ``sandbox.in_flight``: the long command runs in the
container (its first line is in the workspace); the Telegram cells add ``telegram.in_flight``
and ``telegram.delivered``, a send the Bot API server holds before or after delivering it.

Cells at a decision's points (``DECISION_POINTS``) also send decisions that must not be applied,
each naming in its ``reason`` the call its sender meant (the oracle compares):

- when the run parks on the refund: a stale approval for the ticket's call (which waits for
  nothing), then the refund's approval twice at once (a concurrent duplicate);
- while the fault is in effect: a stale denial for a made-up call, the refund's approval again
  (a repeat), and twice more at once;
- once the decision is recorded: a stale denial for the ticket's call, a stale approval for a
  made-up call, a repeat, and two more at once;
- after the run completed: a stale approval and a repeat, waiting for the run's answers
  (``not_waiting``, ``repeated``); then the run's mailbox must drain.
"""

from __future__ import annotations

import contextlib
import signal
import time
import uuid
from collections.abc import AsyncIterator, Callable
from decimal import Decimal
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal
from urllib.parse import urlsplit

import anyio
import asyncpg
import attrs
import orjson

from chaos.calls import (
    CallExpected,
    CallObserved,
    call_note,
    child_runs,
    judge_call,
    observe_call,
)
from chaos.oracle import (
    Expected,
    Observed,
    Sent,
    Takeover,
    early_problems,
    judge,
    lost_note,
    meant_for,
    observe,
)
from chaos.processes import Launchers, Worker
from chaos.sandbox import (
    SandboxExpected,
    SandboxObserved,
    judge_sandbox,
    note,
    observe_sandbox,
    open_calls,
    remove_left,
    wait_gone,
    watch_in_flight,
)
from chaos.sandbox import worker_env as sandbox_env
from chaos.servers import EffectServer, case, child_input, position, script
from toren import Client, TorenError
from toren._agent.principal import Principal
from toren._core.db import with_database
from toren._core.migrate import migrate
from toren.actors.sandboxes.docker import Docker
from toren.runs import ENDED, DecisionOutcome, decide, read_run, say, start_run, waiting_on
from toren.sandboxes import sandbox_address
from toren.testing import AnthropicServer, Hold

if TYPE_CHECKING:
    from chaos.batch_oracle import BatchObserved
    from chaos.schedules import ScheduleExpected, ScheduleObserved
    from chaos.telegram import TelegramExpected, TelegramObserved
    from chaos.version_oracle import ForkExpected, ForkObserved, UpgradeObserved

CHAOS = Principal(kind="os_user", id="chaos", name="chaos", via="chaos")

# The batch cells' own two (chaos.batches): one step of the faulted batch fenced out (its run
# claimed by another worker at the point), or refused by the database (twice).
Fault = Literal["sigkill", "pg_terminate", "sigstop", "fence_one", "refuse_one"]
Shape = Literal[
    "chaos",
    "early",
    "call",
    "sandbox",
    "rerunnable",
    "at_least_once",
    "at_most_once",
    "interrupted",
    "schedule",
    "upgrade",
    "fork",
    "batch",
]
SANDBOX_SHAPES = ("sandbox", "rerunnable")
# A Telegram cell's shape is its bot's delivery; the run is started by the chat, not the harness.
TELEGRAM_SHAPES = ("at_least_once", "at_most_once")
# The chats: each delivery's, and one whose user writes again while an answer is being made (at
# least once).
CHAT_SHAPES = (*TELEGRAM_SHAPES, "interrupted")
# The chaos agent's run, told something between its start and the start's handling.
EARLY = "and one more thing before you start"
AGENTS: dict[Shape, str] = {
    "chaos": "chaos",
    "early": "chaos",
    "interrupted": "chatty",
    "call": "caller",
    "sandbox": "sandboxed",
    "rerunnable": "rerunnable",
    "at_least_once": "chatty",
    "at_most_once": "chatty_once",
    "schedule": "ticker",
    "upgrade": "versioned",
    "fork": "versioned",
    "batch": "chaos",
}
FAULTS: tuple[Fault, ...] = ("sigkill", "pg_terminate", "sigstop")
# telegram.in_flight: the Bot API server holds a send before it takes effect; telegram.delivered:
# it delivered the message and holds the answer (see chaos.telegram).
HARNESS_POINTS = (
    "model.in_flight",
    "tool.in_flight",
    "sandbox.in_flight",
    "telegram.in_flight",
    "telegram.delivered",
)
# Where a decision is in flight: cells here send stale, repeated and concurrent decisions too.
DECISION_POINTS = frozenset(
    {
        "decision.received",
        "committing:approval.decided",
        "committed:approval.decided",
        "committing:decision.refused",
    }
)
MADE_UP_CALL = "no-such-call"

LEASE = 2.0
SETTINGS = {
    "TOREN_LEASE_SECONDS": str(LEASE),
    "TOREN_RENEW_SECONDS": "0.5",
    "TOREN_POLL_SECONDS": "0.2",
    "TOREN_GRACE_SECONDS": "3",
    # Runs snapshot every few events, so activations read a snapshot and a tail, and the
    # snapshot writes are faulted too.
    "TOREN_SNAPSHOT_EVERY": "4",
    "TOREN_MODEL_RETRY_BASE_SECONDS": "0.1",
}


@attrs.frozen
class Cell:
    point: str
    occurrence: int
    fault: Fault | None  # None: the clean run
    decisions: bool = attrs.field()  # also send stale, repeated and concurrent decisions

    # the chaos agent's run, a cross-agent call, a sandboxed run, a Telegram chat (by delivery)
    shape: Shape = "chaos"

    @decisions.default
    def _at_a_decision(self) -> bool:
        return self.point in DECISION_POINTS

    @property
    def slug(self) -> str:
        fault = self.fault or "clean"
        extra = "-decisions" if self.decisions and self.point not in DECISION_POINTS else ""
        prefix = "" if self.shape == "chaos" else f"{self.shape}-"
        return f"{prefix}{self.point.replace(':', '-')}-{self.occurrence}-{fault}{extra}"

    @property
    def label(self) -> str:
        """The cell's row in the tables: its point and occurrence (and shape)."""
        prefix = "" if self.shape == "chaos" else f"{self.shape} "
        return f"{prefix}{self.point}#{self.occurrence}"


@attrs.frozen
class CellResult:
    cell: Cell
    problems: tuple[str, ...]
    duplicate_calls: int
    duplicate_usd: Decimal
    seconds: float
    evidence: str
    note: str = ""  # what the cell saw besides passing (a sandboxed call told interrupted)

    @property
    def passed(self) -> bool:
        return not self.problems


class CellFailed(Exception):
    """The cell cannot go on (its fault did not land, or the run did not start)."""


class Harness:
    """One Postgres server, a template database, warm worker processes; cells run one by one."""

    def __init__(
        self, server_url: str, workdir: Path, *, mutation: str | None = None, bound: float = 30.0
    ) -> None:
        self.server_url = server_url
        self.workdir = workdir
        self.mutation = mutation
        self.bound = bound
        self.launchers: Launchers | None = None
        self.template = f"chaos_template_{uuid.uuid4().hex[:8]}"
        self.docker: Docker | None = None  # connected for the first sandbox cell

    async def __aenter__(self) -> Harness:
        admin = await asyncpg.connect(self.server_url)
        try:
            await admin.execute(f"CREATE DATABASE {self.template}")
        finally:
            await admin.close()
        conn = await asyncpg.connect(with_database(self.server_url, self.template))
        try:
            await migrate(conn)
        finally:
            await conn.close()
        self.launchers = Launchers()
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self.launchers is not None:
            self.launchers.close()
        if self.docker is not None:
            await self.docker.close()
        admin = await asyncpg.connect(self.server_url)
        try:
            await admin.execute(f"DROP DATABASE IF EXISTS {self.template} WITH (FORCE)")
        finally:
            await admin.close()

    @contextlib.asynccontextmanager
    async def database(self) -> AsyncIterator[str]:
        name = f"chaos_{uuid.uuid4().hex[:12]}"
        admin = await asyncpg.connect(self.server_url)
        try:
            await admin.execute(f"CREATE DATABASE {name} TEMPLATE {self.template}")
        finally:
            await admin.close()
        try:
            yield with_database(self.server_url, name)
        finally:
            admin = await asyncpg.connect(self.server_url)
            try:
                await admin.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
            finally:
                await admin.close()

    def worker_env(
        self,
        url: str,
        model: AnthropicServer,
        effects: EffectServer,
        sandboxes: Path | None = None,
    ) -> dict[str, str]:
        """The workers' environment; with ``sandboxes`` (a folder for the workspace store),
        they run sandboxes, else they do not touch Docker."""
        env = {"TOREN_DATABASE_URL": url, "CHAOS_EFFECTS_URL": effects.url, **SETTINGS}
        env.update(sandbox_env(sandboxes) if sandboxes else {"TOREN_SANDBOXES": "false"})
        env.update(model.env())
        if self.mutation:
            env["CHAOS_MUTATION"] = self.mutation
        return env

    async def run_cell(
        self,
        cell: Cell,
        expected: (
            Expected
            | CallExpected
            | SandboxExpected
            | TelegramExpected
            | ScheduleExpected
            | ForkExpected
            | None
        ),
    ) -> tuple[
        CellResult,
        Observed
        | CallObserved
        | SandboxObserved
        | TelegramObserved
        | ScheduleObserved
        | UpgradeObserved
        | ForkObserved
        | BatchObserved,
    ]:
        """Run ``cell``; ``expected`` is None for the clean run (no fault, points traced), else
        what the clean run of the cell's shape did."""
        if cell.shape in ("upgrade", "fork"):
            # Imported here: chaos.versions builds on this module (its execution and faults).
            from chaos.version_oracle import ForkExpected
            from chaos.versions import run_version_cell

            if expected is not None and not isinstance(expected, Expected | ForkExpected):
                raise TypeError(f"a {cell.shape} cell judged against {type(expected).__name__}")
            return await run_version_cell(self, cell, expected)
        if cell.shape == "batch":
            # Imported here: chaos.batches builds on this module (its execution and faults).
            from chaos.batches import run_batch_cell

            if expected is not None and not isinstance(expected, Expected):
                raise TypeError(f"a batch cell judged against {type(expected).__name__}")
            return await run_batch_cell(self, cell, expected)
        if cell.shape == "schedule":
            # Imported here: chaos.schedules builds on this module (its execution and faults).
            from chaos.schedules import ScheduleExpected, run_schedule_cell

            if expected is not None and not isinstance(expected, ScheduleExpected):
                raise TypeError(f"a schedule cell judged against {type(expected).__name__}")
            return await run_schedule_cell(self, cell, expected)
        if cell.shape in CHAT_SHAPES:
            # Imported here: chaos.telegram builds on this module (its execution and faults).
            from chaos.telegram import TelegramExpected, run_telegram_cell

            if expected is not None and not isinstance(expected, TelegramExpected):
                raise TypeError(f"a {cell.shape} cell judged against {type(expected).__name__}")
            return await run_telegram_cell(self, cell, expected)
        prefix = f"{self.mutation}/" if self.mutation else ""
        folder = self.workdir / f"{prefix}{cell.slug}"
        folder.mkdir(parents=True, exist_ok=True)
        started = time.monotonic()
        recorder = _Recorder()
        if cell.shape in SANDBOX_SHAPES and self.docker is None:
            self.docker = await Docker.connect()
        async with (
            self.database() as url,
            AnthropicServer(recorder) as model,
            EffectServer() as effects,
        ):
            client = await Client.connect(url)
            execution = _Execution(self, cell, folder, client, model, effects, url, recorder)
            try:
                with anyio.fail_after(self.bound + 90):
                    evidence = await execution.run()
                observed: Observed | CallObserved | SandboxObserved
                if cell.shape in SANDBOX_SHAPES:
                    observed = await observe_sandbox(
                        client,
                        execution.run_id,
                        recorder.arrivals,
                        folder / "workspaces",
                        allowed_repeats=execution.allowed_repeats,
                        open_at_fault=execution.open_at_fault,
                        rerunnable=cell.shape == "rerunnable",
                        gone_after=execution.gone_after,
                        takeovers=execution.takeovers,
                        logs=[w.log() for w in execution.workers],
                    )
                elif cell.shape == "call":
                    observed = await observe_call(
                        client,
                        execution.run_id,
                        recorder.arrivals,
                        list(effects.effects.values()),
                        allowed_repeats=execution.allowed_repeats,
                        takeover=execution.takeover,
                        unsent=execution.unsent,
                    )
                else:
                    state = await read_run(client, execution.run_id)
                    observed = await observe(
                        client.pool,
                        execution.run_id,
                        state,
                        recorder.arrivals,
                        list(effects.effects.values()),
                        allowed_repeats=execution.allowed_repeats,
                        takeover=execution.takeover,
                        sent=tuple(execution.sent),
                        unsent=frozenset(
                            step for run, step in execution.unsent if run == execution.run_id
                        ),
                    )
                    if cell.shape == "early":
                        execution.problems.extend(early_problems(observed, EARLY))
            finally:
                for w in execution.workers:
                    w.close()
                await client.close()
                if self.docker is not None and cell.shape in SANDBOX_SHAPES and execution.run_id:
                    await remove_left(self.docker, execution.run_id)
        problems = list(execution.problems)
        verdict = None
        if isinstance(observed, SandboxObserved) and isinstance(expected, SandboxExpected):
            verdict = judge_sandbox(observed, expected)
        elif isinstance(observed, CallObserved) and isinstance(expected, CallExpected):
            verdict = judge_call(observed, expected)
        elif isinstance(observed, Observed) and isinstance(expected, Expected):
            verdict = judge(observed, expected)
        elif expected is not None:
            raise TypeError(f"a {cell.shape} cell judged against {type(expected).__name__}")
        if verdict is not None:
            problems.extend(verdict.problems)
        return (
            CellResult(
                cell,
                tuple(problems),
                verdict.duplicate_calls if verdict else 0,
                verdict.duplicate_usd if verdict else Decimal(0),
                time.monotonic() - started,
                evidence,
                note(observed)
                if isinstance(observed, SandboxObserved)
                else lost_note(observed.journal, observed.arrivals)
                if isinstance(observed, Observed)
                else call_note(observed)
                if isinstance(observed, CallObserved)
                else "",
            ),
            observed,
        )


class _Recorder:
    """The model script, recording when each request arrived (for the replay checks)."""

    def __init__(self) -> None:
        self.arrivals: list[tuple[float, dict[str, Any]]] = []

    def __call__(self, request: dict[str, Any], n: int) -> Any:
        self.arrivals.append((time.time(), request))
        return script(request, n)


# What a continued zombie logs as it gives the run up: its write was refused, its renewal came
# back without the run, its lease deadline passed, its lock session is gone, or its own clock
# says the lease may have lapsed before a model call or a tool run (LeaseExpired).
_ZOMBIE_STOPPED = (
    "fenced out",
    "lease lost to another worker",
    "lease renewal keeps failing",
    "lost its lock connection",
    "the lease may have lapsed",
)


async def _poll(predicate: Callable[[], bool], timeout: float, interval: float = 0.01) -> bool:
    with anyio.move_on_after(timeout):
        while not predicate():
            await anyio.sleep(interval)
        return True
    return False


class _Execution:
    """One cell: start the run, fault the victim at its point, drive the run to its end."""

    def __init__(
        self,
        harness: Harness,
        cell: Cell,
        folder: Path,
        client: Client,
        model: AnthropicServer,
        effects: EffectServer,
        url: str,
        recorder: _Recorder,
    ) -> None:
        self.h = harness
        self.recorder = recorder
        self.cell = cell
        self.folder = folder
        self.client = client
        self.model = model
        self.effects = effects
        self.dbname = urlsplit(url).path.lstrip("/")
        sandboxes = folder if cell.shape in SANDBOX_SHAPES else None
        self.env = harness.worker_env(url, model, effects, sandboxes)
        self.workers: list[Worker] = []
        self.problems: list[str] = []
        self.run_id = ""
        self.allowed_repeats = 0
        # (run, step): a call announced and not yet sent at the fault (see lost_problems)
        self.unsent: frozenset[tuple[str, int]] = frozenset()
        self.takeover: Takeover | None = None
        self.takeovers: dict[str, Takeover] = {}  # "run" and "sandbox", at a sigstop takeover
        self.open_at_fault: frozenset[str] = frozenset()  # sandboxed calls in flight
        self.gone_after: float | None = None  # the run's container gone, seconds after its end
        self.points = folder / "point"
        self.points.mkdir(exist_ok=True)
        self.sent: list[Sent] = []  # every decision sent, in order
        self.refund_call: str | None = None  # the call the run parked on (decision cells)
        self.ticket_call: str | None = None  # a call that waits for no decision

    def start(self, env: dict[str, str], role: str) -> Worker:
        assert self.h.launchers is not None
        log = self.folder / f"{len(self.workers)}-{role}.log"
        worker = self.h.launchers.start(env, log, role)
        self.workers.append(worker)
        return worker

    async def run(self) -> str:
        cell = self.cell
        self.run_id = await start_run(
            self.client, AGENTS[cell.shape], f"case {uuid.uuid4().hex[:8]}"
        )
        if cell.shape == "early":
            # Before any worker runs: the message waits on the lane a run takes first, so the
            # run handles it before its start.
            await say(self.client, self.run_id, EARLY, by=CHAOS)
        victim_env = dict(self.env)
        hold: Hold | None = None
        if cell.fault is None:
            victim_env["TOREN_KILL_POINT_TRACE"] = str(self.folder / "trace")
        elif cell.point == "model.in_flight":
            hold = self.model.hold(cell.occurrence)
        elif cell.point == "tool.in_flight":
            hold = self.effects.hold(cell.occurrence)
        elif cell.point == "sandbox.in_flight":
            hold = Hold(cell.occurrence)  # set when the long command runs; nothing to release
        else:
            victim_env["TOREN_KILL_POINT"] = f"{cell.point}#{cell.occurrence}"
            victim_env["TOREN_KILL_POINT_DIR"] = str(self.points)
        victim = self.start(victim_env, "victim")
        evidence = ""
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._approve)
            if cell.point == "sandbox.in_flight" and hold is not None and self.h.docker:
                tg.start_soon(watch_in_flight, self.h.docker, self.run_id, hold.arrived)
            if cell.point.startswith("shutdown."):
                tg.start_soon(self._sigterm_at_second_call, victim)
            try:
                if cell.fault is not None:
                    await self._reach(victim, hold)
                    await self._count_in_flight()
                    fault = getattr(self, f"_{cell.fault}")
                    evidence = await fault(victim, hold)
                sent_after = anyio.Event()
                if cell.decisions:
                    tg.start_soon(self._decide_once_decided, sent_after)
                await self._finish()
                if cell.shape in SANDBOX_SHAPES and self.h.docker is not None:
                    self.gone_after = await wait_gone(self.h.docker, self.run_id)
                if cell.decisions:
                    with anyio.move_on_after(self.h.bound):
                        await sent_after.wait()
                    if sent_after.is_set():
                        await self._decide_at_end()
                    else:
                        self.problems.append("the refund's decision was never recorded")
            except CellFailed as exc:
                self.problems.append(str(exc))
            tg.cancel_scope.cancel()
        return evidence

    # -- reaching the point -------------------------------------------------------------------

    async def _reach(self, victim: Worker, hold: Hold | None) -> None:
        def reached() -> bool:
            return hold.arrived.is_set() if hold else (self.points / "hit").exists()

        deadline = time.monotonic() + 30
        while not await _poll(reached, 0.25):
            state = await read_run(self.client, self.run_id)
            # A point past the run's last commit (committed:run.completed) is reached just after
            # the run ends: give its report a moment before calling it missed.
            ended = state.status in ENDED or victim.exited
            if ended and not await _poll(reached, 1.0):
                raise CellFailed(f"the point was never reached (run {state.status})")
            if time.monotonic() > deadline:
                raise CellFailed("the point was not reached within 30s")
        if hold is None:
            hit = orjson.loads((self.points / "hit").read_bytes())
            if hit["pid"] != victim.pid:
                raise CellFailed(f"the point was reached by pid {hit['pid']}, not the victim")

    async def _count_in_flight(self) -> None:
        """A call the server has seen but the journal has not recorded may be paid again (in a
        call cell, a call of the caller or of its child)."""
        inputs = (await read_run(self.client, self.run_id)).input
        cases = {inputs, child_input(inputs)} if self.cell.shape == "call" else {inputs}
        seen = {(case(r), position(r)) for _, r in self.recorder.arrivals if case(r) in cases}
        recorded = await self.client.pool.fetchval(
            "SELECT count(*) FROM toren.journal WHERE type = 'model.called' AND (actor_id = $1 "
            "OR actor_id IN (SELECT actor_id FROM toren.actors WHERE parent = $1 AND $2))",
            self.run_id,
            self.cell.shape == "call",
        )
        self.allowed_repeats = max(0, len(seen) - recorded)
        self.unsent = await self._unsent()
        if self.cell.shape in SANDBOX_SHAPES:
            self.open_at_fault = await open_calls(self.client, self.run_id)
        if self.cell.fault != "sigkill":
            # The worker lives on after the fault and may be cut again mid-call once it learns.
            self.allowed_repeats = max(self.allowed_repeats, 1)

    async def _unsent(self) -> frozenset[tuple[str, int]]:
        """The calls announced (``model.calling``) and not received by the server at the fault,
        each ``(run, step)``: the run (or, in a call cell, its child) counts one lost in flight
        if the victim began the step before it stopped, with nothing sent."""
        runs = [self.run_id]
        if self.cell.shape == "call":
            runs += await child_runs(self.client.pool, self.run_id)
        found = set()
        for run in runs:
            state = await read_run(self.client, run)
            if state.calling is None:
                continue
            arrived = sum(
                1
                for _, r in self.recorder.arrivals
                if case(r) == state.input and position(r) == state.calling.step - 1
            )
            lost = await self.client.pool.fetchval(
                "SELECT coalesce(sum((data->>'count')::int), 0) FROM toren.journal "
                "WHERE actor_id = $1 AND type = 'model.lost' AND (data->>'step')::int = $2",
                run,
                state.calling.step,
            )
            if arrived <= lost:
                found.add((run, state.calling.step))
        return frozenset(found)

    def _go(self, hold: Hold | None) -> None:
        if hold is not None:
            hold.release()
        else:
            (self.points / "go").touch()

    # -- faults -------------------------------------------------------------------------------

    async def _sigkill(self, victim: Worker, hold: Hold | None) -> str:
        gone = victim.kill()
        self._go(hold)
        if not gone:
            raise CellFailed("the victim did not die of SIGKILL")
        await self._decide_in_fault()  # before a replacement starts
        return f"pid {victim.pid} held at the point, then SIGKILLed"

    async def _pg_terminate(self, victim: Worker, hold: Hold | None) -> str:
        offset = len(victim.log())
        admin = await asyncpg.connect(self.h.server_url)
        try:
            ended = await admin.fetchval(
                "SELECT count(*) FILTER (WHERE pg_terminate_backend(pid)) FROM pg_stat_activity "
                "WHERE datname = $1 AND application_name LIKE 'toren-worker%'",
                self.dbname,
            )
        finally:
            await admin.close()
        if not ended:
            raise CellFailed("the worker had no database session to terminate")
        await self._decide_in_fault()  # its sessions gone, the worker still frozen
        self._go(hold)
        if not await _poll(lambda: "lost its lock connection" in victim.log()[offset:], 15, 0.05):
            raise CellFailed(f"{ended} sessions terminated, but the worker never noticed")
        return f"{ended} sessions terminated at the point; the worker logged the loss"

    async def _sigstop(self, victim: Worker, hold: Hold | None) -> str:
        victim.signal(signal.SIGSTOP)
        if not await _poll(lambda: victim.stopped, 5):
            raise CellFailed("the victim was never seen stopped")
        self._go(hold)  # it goes on from the point once continued
        held = self.folder / "survivor"
        held.mkdir()
        env = dict(self.env, TOREN_KILL_POINT="actor.claimed#1", TOREN_KILL_POINT_DIR=str(held))
        self.start(env, "survivor")
        if not await _poll(lambda: (held / "hit").exists(), LEASE + 20, 0.02):
            raise CellFailed("no survivor claimed the run while the victim was stopped")
        if not victim.stopped:
            raise CellFailed("the victim was not stopped through the takeover")
        self.takeover = await self._takeover(self.run_id)
        self.takeovers["run"] = self.takeover
        if self.cell.shape in SANDBOX_SHAPES:
            self.takeovers["sandbox"] = await self._takeover(sandbox_address(self.run_id))
        await self._decide_in_fault()  # the zombie stopped, the survivor held at its claim
        offset = len(victim.log())
        victim.signal(signal.SIGCONT)
        fenced = await _poll(
            lambda: any(s in victim.log()[offset:] for s in _ZOMBIE_STOPPED),
            10,
            0.05,
        )
        (held / "go").touch()
        if not fenced:
            self.problems.append("the zombie never stopped the run after SIGCONT")
        return (
            f"stopped at the point; a survivor claimed at epoch {self.takeover.epoch} meanwhile; "
            "continued, the zombie stopped its copy"
        )

    async def _takeover(self, actor_id: str) -> Takeover:
        """Where ``actor_id``'s journal and epoch stand (a survivor holds what it claimed)."""
        row = await self.client.actor(actor_id)
        seq = await self.client.pool.fetchval(
            "SELECT coalesce(max(seq), 0) FROM toren.journal WHERE actor_id = $1", actor_id
        )
        return Takeover(seq=seq, epoch=row["epoch"])

    # -- driving the run ------------------------------------------------------------------------

    async def _approve(self) -> None:
        """Approve each request once, after the parked run left its worker (without waiting for
        the run's answer: the worker that would give it may be the one faulted). In a decision
        cell, a stale approval goes first, and the right one is sent twice at once."""
        decided: set[str] = set()
        while True:
            state = await read_run(self.client, self.run_id)
            waiting = {c.id for c in waiting_on(state)} - decided
            if waiting:
                with anyio.move_on_after(2):
                    while (await self.client.actor(self.run_id))["owner"] is not None:
                        await anyio.sleep(0.05)
                for call_id in sorted(waiting):
                    if self.cell.decisions and self.refund_call is None:
                        self.refund_call = call_id
                        self.ticket_call = next(
                            c.id
                            for call in state.calls
                            for c in call.response.tool_calls
                            if c.id not in waiting
                        )
                        await self._send(self.ticket_call, approved=True)
                        await self._send(call_id, approved=True, copies=2)
                    else:
                        await self._send(call_id, approved=True)
                decided |= waiting
            await anyio.sleep(0.05)

    async def _send(self, call_id: str, *, approved: bool, copies: int = 1) -> None:
        """Send a decision on ``call_id`` (``copies`` of it at once), without waiting for the
        run's answer; its ``reason`` names the call it is meant for."""

        async def one() -> None:
            await decide(
                self.client,
                self.run_id,
                call_id=call_id,
                approved=approved,
                by=CHAOS,
                reason=meant_for(call_id),
                wait=None,
            )
            self.sent.append(Sent(call_id, approved))

        async with anyio.create_task_group() as tg:
            for _ in range(copies):
                tg.start_soon(one)

    async def _decide_in_fault(self) -> None:
        """While the fault is in effect: a stale denial, a repeat, and a duplicate pair."""
        if not self.cell.decisions or self.refund_call is None:
            return
        await self._send(MADE_UP_CALL, approved=False)
        await self._send(self.refund_call, approved=True)
        await self._send(self.refund_call, approved=True, copies=2)

    async def _decide_once_decided(self, done: anyio.Event) -> None:
        """Once the refund's decision is recorded: stale decisions, a repeat, a duplicate pair."""
        while not await self.client.pool.fetchval(
            "SELECT EXISTS (SELECT 1 FROM toren.journal "
            "WHERE actor_id = $1 AND type = 'approval.decided')",
            self.run_id,
        ):
            await anyio.sleep(0.05)
        refund, ticket = self.refund_call, self.ticket_call
        if refund is None or ticket is None:
            self.problems.append("a decision was recorded before the harness sent one")
        else:
            await self._send(ticket, approved=False)
            await self._send(MADE_UP_CALL, approved=True)
            await self._send(refund, approved=True)
            await self._send(refund, approved=True, copies=2)
        done.set()

    async def _decide_at_end(self) -> None:
        """The run completed: a stale decision and a repeat, each answered by the run; then
        every decision sent must have been handled (the mailbox drains)."""
        refund, ticket = self.refund_call, self.ticket_call
        if refund is None or ticket is None:
            raise CellFailed("the run never waited for the refund's decision")
        answers: dict[str, DecisionOutcome | TorenError | None] = {}

        async def ask(call_id: str) -> None:
            try:
                answers[call_id] = await decide(
                    self.client,
                    self.run_id,
                    call_id=call_id,
                    approved=True,
                    by=CHAOS,
                    reason=meant_for(call_id),
                    wait=10.0,
                )
            except TorenError as exc:  # dead-lettered, or the run is no longer live
                answers[call_id] = exc
            self.sent.append(Sent(call_id, True))

        async with anyio.create_task_group() as tg:
            tg.start_soon(ask, ticket)
            tg.start_soon(ask, refund)
        expect = {ticket: "not_waiting", refund: "repeated"}
        for call_id, outcome in expect.items():
            got = answers.get(call_id)
            if got is None:
                self.problems.append(f"no answer within 10s to a decision on {call_id}")
            elif isinstance(got, TorenError):
                self.problems.append(f"a decision on {call_id} after the end: {got!r}")
            elif got.outcome != outcome:
                self.problems.append(
                    f"a decision on {call_id} after the end answered {got.outcome!r} "
                    f"({got.detail}), expected {outcome!r}"
                )
        drained = False
        with anyio.move_on_after(10):
            while await self.client.pool.fetchval(
                "SELECT count(*) FROM toren.mailbox WHERE actor_id = $1", self.run_id
            ):
                await anyio.sleep(0.05)
            drained = True
        if not drained:
            self.problems.append("messages left unhandled in the run's mailbox 10s after its end")

    async def _sigterm_at_second_call(self, victim: Worker) -> None:
        await self.model.arrived(2).wait()
        victim.signal(signal.SIGTERM)

    async def _finish(self) -> None:
        deadline = time.monotonic() + self.h.bound
        while True:
            state = await read_run(self.client, self.run_id)
            if state.status in ENDED:
                return
            if not any(w.running for w in self.workers):
                self.start(self.env, "replacement")
            if time.monotonic() > deadline:
                raise CellFailed(f"stuck: the run is still {state.status} {self.h.bound:g}s on")
            await anyio.sleep(0.1)
