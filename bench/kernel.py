"""The kernel step: an actor handling a message by appending one event, in a worker process.

Like for like with a DBOS no-op step: the message is claimed under the actor's fence, handled,
and its consumption, the event, the fence check and the next message committed. Each actor
sends itself the next tick, as a run sends itself ``Continue`` and a DBOS workflow goes on to
its next step: a chain of steps, each durable before the next starts. A ``toren worker``
process runs the actors.

- sequential: one actor; the time per step is read from the journal (consecutive events'
  commit timestamps), so the figure holds no client polling;
- 50 in flight: 50 actors' chains at once; steps/s over the wall time from the first tick's
  commit to the last event.
"""

from __future__ import annotations

import itertools
import statistics
import time

import anyio

from bench._common import Bench, db_counters, per_step
from bench.app import Counter, Tick
from toren import Client

CONCURRENCY = 50


async def _queue(client: Client, actors: list[str], per_actor: int) -> None:
    async with client.pool.acquire() as conn, conn.transaction():
        for actor_id in actors:
            await client.spawn(Counter, actor_id)
            await client.send(actor_id, Tick(n=1, last=per_actor), conn=conn)


async def _wait_for(client: Client, prefix: str, total: int, b: Bench, description: str) -> None:
    with b.task(description, total) as task:
        done = 0
        while done < total:
            await anyio.sleep(0.01)
            done = await client.pool.fetchval(
                "SELECT count(*) FROM toren.journal WHERE actor_id LIKE $1", prefix + "%"
            )
            b.progress.update(task, completed=done)


async def run(b: Bench) -> None:
    async with await Client.connect(b.url) as client:
        import os

        pool_size = {k: v for k, v in os.environ.items() if k == "TOREN_POOL_SIZE"}
        await b.start_ready_worker(client.pool, "kernel", pool_size)
        try:
            await _sequential(b, client)
            await _concurrent(b, client)
        finally:
            b.stop_workers()


async def _sequential(b: Bench, client: Client) -> None:
    n = b.count(2000, 50)
    counters = await db_counters(client.pool)
    await _queue(client, ["bench/kernel/seq"], n)
    await _wait_for(client, "bench/kernel/seq", n, b, "kernel: sequential steps")
    b.results["kernel_step_db"] = await per_step(client.pool, counters, n)
    stamps = await client.pool.fetch(
        "SELECT extract(epoch FROM created_at)::float8 AS t FROM toren.journal "
        "WHERE actor_id = 'bench/kernel/seq' ORDER BY seq"
    )
    gaps = [later["t"] - earlier["t"] for earlier, later in itertools.pairwise(stamps)]
    median = statistics.median(gaps) * 1000
    b.record(
        "step_overhead_median_ms",
        round(median, 4),
        "kernel step, sequential (median)",
        f"{median:.3f} ms",
        "handle; one fenced statement: consume, event, next claimed",
    )
    b.ratio(
        "step_overhead_vs_floor",
        median,
        "floor_commit_median_ms",
        "kernel step / floor commit",
        "target <= 1.3x",
    )


async def _concurrent(b: Bench, client: Client) -> None:
    per_actor = b.count(200, 4)
    actors = [f"bench/kernel/c50/{i}" for i in range(CONCURRENCY)]
    total = per_actor * CONCURRENCY
    await _queue(client, actors, per_actor)
    t = time.perf_counter()  # from the first ticks' commit
    await _wait_for(client, "bench/kernel/c50/", total, b, "kernel: 50 actors in flight")
    wall = time.perf_counter() - t
    rate = total / wall
    b.record(
        "kernel_steps_per_s_conc50",
        round(rate),
        "kernel steps/s, 50 actors in flight",
        f"{rate:,.0f}/s",
        "one worker process",
    )
