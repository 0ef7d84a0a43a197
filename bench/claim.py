"""Claim sweep: what one sweep for runnable actors costs with 100,000 runs asleep on durable
timers (due in a day), against the same sweep on an empty database.

A worker sweeps every poll interval and on every mail notification, so the sweep must not grow
with actors that cannot run now. The runs and their timers are written straight into the
kernel's tables (as 100,000 sleeping runs leave them); a registered worker then sweeps with
nothing claimable, and the median of many sweeps is kept.
"""

from __future__ import annotations

import statistics
import time
import uuid

from bench._common import Bench
from toren import Client, Settings
from toren._core.leases import claim
from toren._core.session import WorkerSession
from toren.kernel import connect
from toren.runs import RUN_KIND

SWEEPS = 50


async def _median_sweep_ms(url: str) -> float:
    session = await WorkerSession.open(url, Settings(database_url=url))
    client = await Client.connect(url, pool_size=1)
    try:
        times = []
        for _ in range(SWEEPS + 5):
            started = time.perf_counter()
            found = await claim(
                client.pool,
                session.worker_id,
                limit=10,
                lease=30,
                kinds=[RUN_KIND],
                hosted=[],
                routes=["agent:bench"],
            )
            times.append((time.perf_counter() - started) * 1000)
            if found:
                raise RuntimeError(f"the sweep claimed {len(found)} actors; none is runnable")
        return statistics.median(times[5:])
    finally:
        await client.close()
        await session.close()


async def run(b: Bench) -> None:
    sleeping = b.count(100_000, 1_000)
    conn = await connect(b.url)
    try:
        with b.task("claim sweep: empty", 1):
            empty = await _median_sweep_ms(b.url)
        with b.task(f"claim sweep: {sleeping} runs asleep on timers", 2) as task:
            tag = uuid.uuid4().hex[:8]
            await conn.execute(
                "INSERT INTO toren.actors (actor_id, kind, args, status, route) "
                "SELECT 'run/sleep-' || $2 || '-' || g, $3, '{}', 'live', 'agent:bench' "
                "FROM generate_series(1, $1) g",
                sleeping,
                tag,
                RUN_KIND,
            )
            await conn.execute(
                "INSERT INTO toren.mailbox (actor_id, lane, kind, body, timer_name, visible_at) "
                "SELECT 'run/sleep-' || $2 || '-' || g, 1, 'run.wake', '{}', 'sleep', "
                "now() + interval '1 day' FROM generate_series(1, $1) g",
                sleeping,
                tag,
            )
            await conn.execute("ANALYZE toren.actors, toren.mailbox")
            b.progress.advance(task)
            full = await _median_sweep_ms(b.url)
            await conn.execute(
                "DELETE FROM toren.actors WHERE actor_id LIKE 'run/sleep-' || $1 || '-%'", tag
            )
    finally:
        await conn.close()
    b.record(
        "claim_sweep_ms_empty", round(empty, 3), "claim sweep: empty database", f"{empty:.2f} ms"
    )
    b.record(
        "claim_sweep_ms_100k_sleeping",
        round(full, 3),
        f"claim sweep: {sleeping:,} runs asleep on timers",
        f"{full:.2f} ms",
        "target < 5 ms",
    )
