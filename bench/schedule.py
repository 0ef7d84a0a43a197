"""A schedule firing: what starting one slot's run costs the database, against a kernel step.

Twenty schedules of an agent no worker runs (their runs are spawned and started, and wait: the
figure holds the firing alone) fire every second in a ``toren worker`` process. Each slot is one
step of its schedule (its timer consumed, the run spawned and sent its start, the slot recorded,
the next timer set): one commit. A schedule sleeps between slots as any actor on a timer does
(it passivates after a second idle), so a slot also pays the schedule's claim on waking and its
release after: three commits in all. Also: how late a slot's run starts after the slot's
instant (the due timer found by the worker's poll, the wake-up, the step), median and p99.
"""

from __future__ import annotations

import anyio

from bench._common import Bench, db_counters, median_ms, p99_ms, per_step
from toren import Client
from toren._agent.principal import Principal
from toren.schedules import Schedule
from toren.schedules.client import declare, delete

SCHEDULES = 20


async def run(b: Bench) -> None:
    slots = b.count(200, 10)
    async with await Client.connect(b.url) as client:
        worker = b.start_worker()
        await b.wait_registered(client.pool, worker)
        try:
            by = Principal.os_user(via="bench")
            for i in range(SCHEDULES):
                every = Schedule(name=f"s{i}", every=1, overlap="allow_all", input="{slot_utc}")
                await declare(client, "bench_unserved", every, source="api", by=by)
            await anyio.sleep(1.5)  # past the first wake-ups (each declaration's own step)
            before = await db_counters(client.pool)
            started = await _fired(client)
            with b.task("schedules: slots fired", slots) as task:
                while (fired := await _fired(client) - started) < slots:
                    b.progress.update(task, completed=fired)
                    await anyio.sleep(0.05)
            fired = await _fired(client) - started
            cost = await per_step(client.pool, before, fired)
            for i in range(SCHEDULES):  # nothing fires on into the sections after
                await delete(client, f"bench_unserved/s{i}", by=by)
            lateness = await client.pool.fetch(
                "SELECT extract(epoch FROM created_at)::float8 - (data->>'slot')::float8 AS late "
                "FROM toren.journal WHERE type = 'schedule.slot_started'"
            )
        finally:
            b.stop_workers()
    late = [r["late"] for r in lateness]
    b.results["schedule_firing_db"] = cost
    b.record(
        "schedule_firing_wal_flushes",
        cost["wal_sync"],
        "schedule firing: WAL flushes per slot",
        f"{cost['wal_sync']:.2f}",
        f"{cost['rows_written']:.0f} rows/slot; wake-up, one step, passivation",
    )
    kernel = b.results.get("kernel_step_db")
    if kernel and kernel.get("wal_sync"):
        b.results["kernel_step_db_wal_sync"] = kernel["wal_sync"]
        b.ratio(
            "schedule_firing_vs_kernel_step",
            cost["wal_sync"],
            "kernel_step_db_wal_sync",
            "schedule firing / kernel step (WAL flushes)",
            "one step + wake-up and passivation: 3x",
        )
    b.record(
        "schedule_late_median_ms",
        round(median_ms(late), 1),
        "schedule: slot to its run started (median)",
        f"{median_ms(late):.0f} ms (p99 {p99_ms(late):.0f} ms)",
        f"{SCHEDULES} schedules, every second",
    )


async def _fired(client: Client) -> int:
    return int(
        await client.pool.fetchval(
            "SELECT count(*) FROM toren.journal WHERE type = 'schedule.slot_started'"
        )
    )
