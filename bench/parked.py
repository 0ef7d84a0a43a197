"""Parked runs: 10,000 runs driven through a worker until each parks on an approval.

Each run calls the model once, which asks for ``transfer`` (every transfer needs a person's
approval): ``approval.requested`` is committed and the run waits. A parked run should cost the
worker nothing: no lease, no object in memory. Measured once every run has parked and the
worker has passivated them: leases held (actors owned in Postgres), actors in the worker's
memory (its own count, published with its heartbeat), and its RSS against the RSS it had
before the first run (after a warm-up run, so the SDK and code are loaded in both).
"""

from __future__ import annotations

import time

import anyio

from bench._common import Bench, rss_mb
from bench.model import BenchModel
from toren import Client
from toren.runs import start_run

STARTERS = 20  # client tasks starting runs


async def _parked(client: Client) -> int:
    count: int = await client.pool.fetchval(
        "SELECT count(*) FROM toren.journal WHERE type = 'approval.requested'"
    )
    return count


async def _start(client: Client, n: int, prefix: str) -> None:
    async def starter(k: int) -> None:
        for i in range(k, n, STARTERS):
            await start_run(client, "bench_approve", f"park steps=2 {prefix} {i}")

    async with anyio.create_task_group() as tg:
        for k in range(STARTERS):
            tg.start_soon(starter, k)


async def _settled(client: Client, worker_pid: int, since: float) -> tuple[int, int]:
    """Wait (up to 2 minutes) for no lease held and a heartbeat after that; returns (leases,
    actors in memory) as last seen."""
    deadline = time.monotonic() + 120
    leases, in_memory = -1, -1
    while time.monotonic() < deadline:
        leases = await client.pool.fetchval(
            "SELECT count(*) FROM toren.actors WHERE owner IS NOT NULL AND kind = 'toren.run'"
        )
        row = await client.pool.fetchrow(
            "SELECT stats, extract(epoch FROM heartbeat_at)::float8 AS beat "
            "FROM toren.workers WHERE pid = $1",
            worker_pid,
        )
        if row is not None:
            in_memory = int(row["stats"].get("actors_in_memory", -1))
        if leases == 0 and row is not None and row["beat"] > since:
            return 0, in_memory
        if leases:
            since = await client.pool.fetchval("SELECT extract(epoch FROM now())::float8")
        await anyio.sleep(0.5)
    return leases, in_memory


async def run(b: Bench) -> None:
    n = b.count(10_000, 20)
    async with BenchModel() as model, await Client.connect(b.url) as client:
        worker = b.start_worker(model.env())
        await b.wait_registered(client.pool, worker)
        try:
            # Warm-up: one run parks first, so the provider's SDK is loaded before the baseline.
            await start_run(client, "bench_approve", "park steps=2 warm-up")
            while await _parked(client) < 1:
                await anyio.sleep(0.05)
            now = await client.pool.fetchval("SELECT extract(epoch FROM now())::float8")
            await _settled(client, worker.pid, now)
            before = rss_mb(worker.pid)
            with b.task(f"parked: {n:,} runs park on approvals", n) as task:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(_start, client, n, "run")
                    done = 0
                    while done < n:
                        await anyio.sleep(0.25)
                        done = await _parked(client) - 1
                        b.progress.update(task, completed=done)
            now = await client.pool.fetchval("SELECT extract(epoch FROM now())::float8")
            leases, in_memory = await _settled(client, worker.pid, now)
            after = rss_mb(worker.pid)
        finally:
            b.stop_workers()
    b.results["parked_runs"] = n
    b.results["parked_rss_before_mb"] = round(before, 1)
    b.results["parked_rss_after_mb"] = round(after, 1)
    b.record(
        "parked_10k_leases",
        leases,
        f"{n:,} parked runs: leases held",
        str(leases),
        "target 0",
    )
    b.record(
        "parked_10k_actors_in_memory",
        in_memory,
        f"{n:,} parked runs: actors in the worker's memory",
        str(in_memory),
        "target 0",
    )
    delta = after - before
    b.record(
        "parked_10k_rss_delta_mb",
        round(delta, 1),
        f"{n:,} parked runs: worker RSS growth",
        f"{delta:+.1f} MB",
        f"{before:.0f} MB before the first run, {after:.0f} MB after the last parked; "
        "target < 20 MB",
    )
