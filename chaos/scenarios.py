"""Faults that are not one kill point: Postgres restarted mid-run, and a soak in which several
workers are SIGKILLed and restarted at random while many runs execute."""

from __future__ import annotations

import random
import re
import signal
import time
from collections import Counter
from collections.abc import Callable
from decimal import Decimal
from pathlib import Path
from typing import Any

import anyio
import attrs

from chaos.batch_oracle import batches_in
from chaos.harness import Harness, _Recorder
from chaos.oracle import Expected, judge, meant_for, observe
from chaos.processes import Worker
from chaos.servers import EffectServer
from toren import Client
from toren._agent.principal import Principal
from toren.kernel import TRANSIENT_DB_ERRORS
from toren.runs import ENDED, decide, read_run, start_run, waiting_on
from toren.testing import AnthropicServer

CHAOS = Principal(kind="os_user", id="chaos", name="chaos", via="chaos")

# What a worker logs (toren.worker at DEBUG, toren.leases) of the runs it claims, and of
# stopping them without being killed: on a CPU-starved machine the chaos lease (2 s) can lapse.
CLAIMED = re.compile(r"claimed (run/\S+) at epoch")
LOST_ONE = re.compile(r"(run/\S+): lease lost to another worker")
LOST_ALL = ("lease renewal keeps failing", "lost its lock connection")


@attrs.frozen
class ScenarioResult:
    name: str
    runs: int
    faults: int
    problems: tuple[str, ...]
    duplicate_calls: int
    duplicate_usd: Decimal
    seconds: float
    batches: int = 0  # group commit: batches the workers' logs show committed
    batched: int = 0  # steps in them
    lapses: int = 0  # workers that stopped their runs on a lapsed lease, not killed

    @property
    def passed(self) -> bool:
        return not self.problems

    def line(self) -> str:
        status = "pass" if self.passed else "FAIL"
        return (
            f"{self.name}: {status}; {self.runs} runs, {self.faults} faults, "
            f"{self.duplicate_calls} model calls paid again (${self.duplicate_usd:.6f}, "
            f"all in flight at a fault), {self.lapses} leases lapsed, {self.batches} batches "
            f"of {self.batched} steps committed, {self.seconds:.0f}s"
        )


class Fleet:
    """Many runs of the chaos agent on one database, with the workers that run them."""

    def __init__(
        self,
        harness: Harness,
        folder: Path,
        client: Client,
        env: dict[str, str],
        recorder: _Recorder,
        effects: EffectServer,
    ) -> None:
        self.h = harness
        self.folder = folder
        self.client = client
        self.env = env
        self.recorder = recorder
        self.effects = effects
        self.workers: list[Worker] = []
        self.runs: list[str] = []
        self.done: set[str] = set()

    def start_worker(self) -> Worker:
        assert self.h.launchers is not None
        log = self.folder / f"{len(self.workers)}-worker.log"
        worker = self.h.launchers.start(self.env, log, "worker")
        self.workers.append(worker)
        return worker

    async def start_runs(self, n: int) -> None:
        for i in range(n):
            self.runs.append(await start_run(self.client, "chaos", f"case {i} {time.time_ns()}"))

    async def drive(self) -> None:
        """Approve what waits for approval; note the runs that finished. Database errors (a
        restarting server) are waited out."""
        decided: set[str] = set()
        while True:
            try:
                for run_id in self.runs:
                    if run_id in self.done:
                        continue
                    state = await read_run(self.client, run_id)
                    if state.status in ENDED:
                        self.done.add(run_id)
                    elif waiting_on(state) and run_id not in decided:
                        # Not waiting for the answer: in the soak, workers die all the time.
                        for call in waiting_on(state):
                            await decide(
                                self.client,
                                run_id,
                                call_id=call.id,
                                approved=True,
                                by=CHAOS,
                                reason=meant_for(call.id),
                                wait=None,
                            )
                        decided.add(run_id)
            except TRANSIENT_DB_ERRORS:
                pass
            await anyio.sleep(0.2)

    async def wait_done(self, bound: float, keep_running: bool = True) -> list[str]:
        deadline = time.monotonic() + bound
        while len(self.done) < len(self.runs):
            if keep_running and not any(w.running for w in self.workers):
                self.start_worker()
            if time.monotonic() > deadline:
                return [f"stuck: {len(self.runs) - len(self.done)} runs unfinished after {bound}s"]
            await anyio.sleep(0.2)
        return []

    async def judge(
        self, expected: Expected, allowed: Callable[[str], int]
    ) -> tuple[list[str], int, Decimal]:
        problems: list[str] = []
        dup_calls, dup_usd = 0, Decimal(0)
        for run_id in self.runs:
            state = await read_run(self.client, run_id)
            seen = await observe(
                self.client.pool,
                run_id,
                state,
                self.recorder.arrivals,
                list(self.effects.effects.values()),
                allowed_repeats=allowed(run_id),
                takeover=None,
            )
            verdict = judge(seen, expected)
            problems.extend(f"{run_id}: {p}" for p in verdict.problems)
            dup_calls += verdict.duplicate_calls
            dup_usd += verdict.duplicate_usd
        return problems, dup_calls, dup_usd

    def lapsed(self) -> tuple[int, Counter[str]]:
        """The workers' stops that were not kills (a lease lapsed, the lock connection lost),
        and for each run, how many of them stopped a worker that had claimed it since its last
        stop: each may have cut the run's step with its request sent."""
        stops, runs = 0, Counter[str]()
        for worker in self.workers:
            held: set[str] = set()
            for line in worker.log().splitlines():
                if claimed := CLAIMED.search(line):
                    held.add(claimed.group(1))
                elif lost := LOST_ONE.search(line):
                    runs[lost.group(1)] += 1
                    held.discard(lost.group(1))
                elif any(what in line for what in LOST_ALL) and held:
                    stops += 1
                    runs.update(held)
                    held.clear()
        return stops, runs

    def close(self) -> None:
        for w in self.workers:
            w.close()


async def _fleet(
    harness: Harness, name: str, body: Callable[[Fleet], Any], expected: Expected
) -> ScenarioResult:
    folder = harness.workdir / name
    folder.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    recorder = _Recorder()
    async with (
        harness.database() as url,
        AnthropicServer(recorder) as model,
        EffectServer() as effects,
    ):
        client = await Client.connect(url)
        fleet = Fleet(
            harness, folder, client, harness.worker_env(url, model, effects), recorder, effects
        )
        try:
            faults, problems, allowed = await body(fleet)
            more, dup_calls, dup_usd = await fleet.judge(expected, allowed)
            lapses, _ = fleet.lapsed()
        finally:
            fleet.close()
            await client.close()
    batches, batched = batches_in(w.log() for w in fleet.workers)
    return ScenarioResult(
        name,
        len(fleet.runs),
        faults,
        tuple(problems + more),
        dup_calls,
        dup_usd,
        time.monotonic() - started,
        batches,
        batched,
        lapses,
    )


async def postgres_restart(
    harness: Harness,
    restart: Callable[[float], None],
    expected: Expected,
    *,
    runs: int = 8,
    down: float = 3.0,
) -> ScenarioResult:
    """Stop Postgres (an immediate shutdown: a crash, recovered from the WAL on start) for
    ``down`` seconds while ``runs`` runs are in the middle of their work."""

    async def body(fleet: Fleet) -> tuple[int, list[str], Callable[[str], int]]:
        await fleet.start_runs(runs)
        fleet.start_worker()
        fleet.start_worker()
        problems: list[str] = []
        async with anyio.create_task_group() as tg:
            tg.start_soon(fleet.drive)
            while len(fleet.recorder.arrivals) < runs * 2:
                await anyio.sleep(0.02)
            logs = [len(w.log()) for w in fleet.workers]
            await anyio.to_thread.run_sync(restart, down)
            with anyio.move_on_after(20):
                while not all(
                    "lost its lock connection" in w.log()[at:]
                    for w, at in zip(fleet.workers, logs, strict=True)
                ):
                    await anyio.sleep(0.1)
            noticed = sum(
                "lost its lock connection" in w.log()[at:]
                for w, at in zip(fleet.workers, logs, strict=True)
            )
            if noticed < 2:
                problems.append(f"only {noticed} of 2 workers noticed the restart")
            problems += await fleet.wait_done(harness.bound * 2)
            tg.cancel_scope.cancel()
        # Every run may repay the one call it had in flight when the server went down.
        return 1, problems, lambda _run: 1

    return await _fleet(harness, "postgres-restart", body, expected)


async def soak(
    harness: Harness,
    expected: Expected,
    *,
    runs: int = 50,
    workers: int = 3,
    seconds: float = 20.0,
    seed: int | None = None,
) -> ScenarioResult:
    """``runs`` runs on ``workers`` workers; for ``seconds``, every 0.5-2 s a random worker is
    SIGKILLed (after a SIGSTOP, so the runs it owns at that instant are known exactly) and a
    new one started."""
    rng = random.Random(seed)
    owned_at_kill: Counter[str] = Counter()

    async def body(fleet: Fleet) -> tuple[int, list[str], Callable[[str], int]]:
        await fleet.start_runs(runs)
        for _ in range(workers):
            fleet.start_worker()
        kills = 0
        async with anyio.create_task_group() as tg:
            tg.start_soon(fleet.drive)
            stop_at = time.monotonic() + seconds
            while time.monotonic() < stop_at:
                await anyio.sleep(rng.uniform(0.5, 2.0))
                live = [w for w in fleet.workers if w.running]
                if not live:
                    continue
                victim = rng.choice(live)
                victim.signal(signal.SIGSTOP)
                owned = await fleet.client.pool.fetch(
                    "SELECT a.actor_id FROM toren.actors a JOIN toren.workers w "
                    "ON a.owner = w.worker_id WHERE w.pid = $1",
                    victim.pid,
                )
                owned_at_kill.update(r["actor_id"] for r in owned)
                victim.kill()
                kills += 1
                fleet.start_worker()
            problems = await fleet.wait_done(harness.bound * 3)
            tg.cancel_scope.cancel()
        # A run may repay a call once for each kill of a worker that owned it, and once for
        # each lapse of the lease of a worker that had claimed it (the machine starved it).
        _, lapsed = fleet.lapsed()
        return kills, problems, lambda run_id: owned_at_kill[run_id] + lapsed[run_id]

    return await _fleet(harness, "soak", body, expected)


def restarter(data_dir: Path) -> Callable[[float], None]:
    """A function that crashes the embedded Postgres in ``data_dir`` and starts it again."""

    def restart(down: float) -> None:
        import pgserver  # type: ignore[import-untyped]
        from pgserver._commands import pg_ctl  # type: ignore[import-untyped]

        server = pgserver.get_server(data_dir, cleanup_mode=None)
        pg_ctl(["-w", "-m", "immediate", "stop"], pgdata=server.pgdata, user=server.system_user)
        time.sleep(down)
        server.ensure_postgres_running()

    return restart
