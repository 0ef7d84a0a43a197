"""Agent steps: 10-step runs through the real ``anthropic`` SDK against the local wire server.

Each run makes 10 model calls: 9 ask for the no-op ``lookup`` tool (a ``read`` tool: its result
is journaled), the 10th answers. A ``toren worker`` process runs them. Per step overhead =
(run wall time - the server's time answering the run's calls) / 10, sequentially; runs/s
sequentially and with 50 runs in flight (50 lanes, each starting its next run when the last
completes). Wall times come from Postgres: the run's spawn to its ``run.completed`` commit.
"""

from __future__ import annotations

import statistics
import time

import anyio

from bench._common import Bench, db_counters, per_step
from bench.model import BenchModel
from toren import Client
from toren.runs import start_run

STEPS = 10
CONCURRENCY = 50


class Finishes:
    """Watches runs for their end (one query per tick for all of them)."""

    def __init__(self, client: Client) -> None:
        self.client = client
        self.waiting: dict[str, anyio.Event] = {}
        self.failed: list[str] = []

    async def wait(self, run_id: str) -> None:
        event = self.waiting[run_id] = anyio.Event()
        await event.wait()

    async def watch(self) -> None:
        while True:
            await anyio.sleep(0.005)
            if not self.waiting:
                continue
            rows = await self.client.pool.fetch(
                "SELECT actor_id, type FROM toren.journal "
                "WHERE actor_id = ANY($1) AND type IN ('run.completed', 'run.failed')",
                list(self.waiting),
            )
            for row in rows:
                if row["type"] == "run.failed":
                    self.failed.append(row["actor_id"])
                self.waiting.pop(row["actor_id"]).set()


async def walls(client: Client, runs: list[str]) -> dict[str, float]:
    """Spawn to completion of each run, in seconds, from Postgres' own clock."""
    rows = await client.pool.fetch(
        "SELECT a.actor_id, extract(epoch FROM j.created_at - a.created_at)::float8 AS wall "
        "FROM toren.actors a JOIN toren.journal j ON j.actor_id = a.actor_id "
        "WHERE a.actor_id = ANY($1) AND j.type = 'run.completed'",
        runs,
    )
    return {r["actor_id"]: r["wall"] for r in rows}


async def run(b: Bench) -> None:
    async with BenchModel() as model, await Client.connect(b.url) as client:
        await b.start_ready_worker(client.pool, "agent", model.env())
        finishes = Finishes(client)
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(finishes.watch)
                await _sequential(b, client, model, finishes)
                await _concurrent(b, client, finishes)
                tg.cancel_scope.cancel()
        finally:
            b.stop_workers()
        if finishes.failed:
            raise RuntimeError(f"{len(finishes.failed)} runs failed, e.g. {finishes.failed[0]}")


async def _sequential(b: Bench, client: Client, model: BenchModel, finishes: Finishes) -> None:
    n = b.count(30, 2)
    overheads: list[float] = []
    runs: list[str] = []
    counters: dict[str, int] = {}
    with b.task("agent: sequential 10-step runs", n) as task:
        for i in range(n + 2):  # the first two warm the worker's provider and plans
            if i == 2:
                counters = await db_counters(client.pool)
            busy = model.busy_seconds
            run_id = await start_run(client, "bench", f"steps={STEPS} seq {i}")
            await finishes.wait(run_id)
            model_time = model.busy_seconds - busy
            if i >= 2:
                wall = (await walls(client, [run_id]))[run_id]
                overheads.append((wall - model_time) / STEPS)
                runs.append(run_id)
                b.progress.advance(task)
    b.results["agent_step_db"] = await per_step(client.pool, counters, n * STEPS)
    median = statistics.median(overheads) * 1000
    b.record(
        "agent_step_overhead_median_ms",
        round(median, 3),
        "agent step overhead (median)",
        f"{median:.2f} ms",
        "(run wall - model server time) / 10; SDK call, tool, journal",
    )
    total = sum((await walls(client, runs)).values())
    rate = len(runs) / total
    b.record(
        "toren_runs_per_s_seq", round(rate, 1), "agent: 10-step runs/s, sequential", f"{rate:.1f}/s"
    )


async def _concurrent(b: Bench, client: Client, finishes: Finishes) -> None:
    per_lane = b.count(4, 1)
    total = CONCURRENCY * per_lane
    with b.task("agent: 50 runs in flight", total) as task:

        async def lane(k: int) -> None:
            for i in range(per_lane):
                run_id = await start_run(client, "bench", f"steps={STEPS} lane {k} run {i}")
                await finishes.wait(run_id)
                b.progress.advance(task)

        t = time.perf_counter()
        async with anyio.create_task_group() as tg:
            for k in range(CONCURRENCY):
                tg.start_soon(lane, k)
        wall = time.perf_counter() - t
    rate = total / wall
    b.record(
        "toren_runs_per_s_conc50",
        round(rate, 1),
        "agent: 10-step runs/s, 50 in flight",
        f"{rate:.1f}/s",
    )
    b.ratio(
        "throughput_vs_dbos_conc50",
        rate,
        "dbos_wf_per_s_conc50",
        "agent runs/s / DBOS 10-step workflows/s (50 in flight)",
        "target >= 2x",
    )
