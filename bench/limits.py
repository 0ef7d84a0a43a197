"""The claim with concurrency limits configured against the same claim without, in one run.

10,000 runs wait to be claimed (each with its start message), 3 registered workers hold 50 runs
each in flight, and a worker claims its next 50; each claimed run then claims its first message
through the claim statement (with its ``limits`` fragment), as its host does. Three sides:

- ``plain``: no limits; any waiting run can be taken.
- ``limited``: every run under its agent's cap of 200 (the 150 in flight and 50 more hold
  permits, handed to them); the other 9,800 wait in the cap's queue, their start messages out of
  the claim's sight as a queued run's are.
- ``loose``: every run under a cap none reaches (all hold permits, none waits): the scan is the
  baseline's and the limits' checks are paid on every run.

The sides take turns on the same database (each twice, so that a machine busy with other work
weighs on all), each claim undone after it is timed (not timed), and the medians compared; the
issue's target is 1.2x.
"""

from __future__ import annotations

import statistics
import time
import uuid

import asyncpg

from bench._common import Bench
from toren import Client, Settings
from toren._core.leases import claim
from toren._core.mailbox import claim_next
from toren._core.session import WorkerSession
from toren.kernel import connect
from toren.runs import RUN_KIND

IN_FLIGHT = 50  # per worker
WORKERS = 3
ROUTE = "agent:limitbench"


async def _populate(conn: asyncpg.Connection, tag: str, waiting: int, *, side: str) -> None:
    """``waiting`` runs with a start message each; under ``agent/<tag>`` unless ``side`` is
    ``plain``: at a cap of 200 (``limited``) or of more than them all (``loose``: every run
    holds its permit, none waits)."""
    limited = side != "plain"
    await conn.execute(
        "INSERT INTO toren.actors (actor_id, kind, args, route, limits) "
        "SELECT 'run/' || $2 || '-' || g, $3, '{}', $4, "
        "       CASE WHEN $5 THEN ARRAY['agent/' || $2] END "
        "FROM generate_series(1, $1) g",
        waiting,
        tag,
        RUN_KIND,
        ROUTE,
        limited,
    )
    await conn.execute(
        "INSERT INTO toren.mailbox (actor_id, lane, kind, body) "
        "SELECT 'run/' || $2 || '-' || g, 1, 'run.start', '{}' FROM generate_series(1, $1) g",
        waiting,
        tag,
    )
    if limited:
        # The cap, its permits (the runs in flight and the next 50, spread over the runs), and
        # the others in its queue in order of arrival.
        permitted = WORKERS * IN_FLIGHT + IN_FLIGHT if side == "limited" else waiting
        step = waiting // permitted
        await conn.execute(
            "INSERT INTO toren.limits (name, cap) VALUES ('agent/' || $1, $2)",
            tag,
            2 * waiting if side == "loose" else permitted,
        )
        await conn.execute(
            "INSERT INTO toren.permits (name, actor_id) "
            "SELECT 'agent/' || $1, 'run/' || $1 || '-' || g FROM generate_series(1, $2) g "
            "WHERE g % $3 = 0",
            tag,
            waiting,
            step,
        )
        await conn.execute(
            "INSERT INTO toren.limit_queue (name, actor_id) "
            "SELECT 'agent/' || $1, 'run/' || $1 || '-' || g FROM generate_series(1, $2) g "
            "WHERE g % $3 <> 0 ORDER BY g",
            tag,
            waiting,
            step,
        )
        # As toren.take_permits leaves a run it queues: its start message out of sight.
        await conn.execute(
            "UPDATE toren.mailbox m SET visible_at = 'infinity' FROM toren.limit_queue q "
            "WHERE q.name = 'agent/' || $1 AND m.actor_id = q.actor_id",
            tag,
        )


async def _claim_times(
    client: Client, sessions: list[WorkerSession], rounds: int, *, first_message: bool
) -> list[float]:
    """Time ``rounds`` claims of 50 by the first worker (then each claimed run's first message,
    as its host claims it, if ``first_message``), undoing each after it is timed."""
    me = sessions[0].worker_id
    times = []
    for _ in range(rounds):
        started = time.perf_counter()
        found = await claim(
            client.pool,
            me,
            limit=IN_FLIGHT,
            lease=60,
            kinds=[RUN_KIND],
            hosted=[],
            routes=[ROUTE],
        )
        if first_message:
            for c in found:
                await claim_next(client.pool, c.actor_id, me, c.epoch)
        times.append(time.perf_counter() - started)
        if len(found) != IN_FLIGHT:
            raise RuntimeError(f"claimed {len(found)} runs, not {IN_FLIGHT}")
        await client.pool.execute(
            "UPDATE toren.actors SET owner = NULL, lease_expires_at = NULL "
            "WHERE actor_id = ANY($1::text[])",
            [c.actor_id for c in found],
        )
    return times


async def _hold_in_flight(client: Client, sessions: list[WorkerSession]) -> None:
    """Each worker claims 50 runs and keeps them (its lease long)."""
    for s in sessions:
        got = await claim(
            client.pool,
            s.worker_id,
            limit=IN_FLIGHT,
            lease=3600,
            kinds=[RUN_KIND],
            hosted=[],
            routes=[ROUTE],
        )
        if len(got) != IN_FLIGHT:
            raise RuntimeError(f"a worker took {len(got)} runs in flight, not {IN_FLIGHT}")


async def run(b: Bench) -> None:
    waiting = b.count(10_000, 400)
    rounds = b.count(30, 3)
    conn = await connect(b.url)
    sessions = [
        await WorkerSession.open(b.url, Settings(database_url=b.url)) for _ in range(WORKERS)
    ]
    client = await Client.connect(b.url, pool_size=2)
    sides = ("plain", "limited", "loose")
    times: dict[str, list[float]] = {side: [] for side in sides}
    medians: dict[str, float] = {}
    try:
        # Each side twice, in turn, so that a machine busy with other work weighs on both.
        for side in sides + sides:
            tag = f"lb{uuid.uuid4().hex[:8]}"
            with b.task(f"limits: {waiting} runs waiting, {side}", 2) as task:
                await _populate(conn, tag, waiting, side=side)
                await conn.execute("ANALYZE toren.actors, toren.mailbox")
                await conn.execute("ANALYZE toren.permits, toren.limit_queue, toren.limits")
                await _hold_in_flight(client, sessions)
                b.progress.advance(task)
                # Both sides claim the first message as a host does (one statement per run).
                times[side] += await _claim_times(client, sessions, rounds, first_message=True)
                await conn.execute(
                    "DELETE FROM toren.actors WHERE route = $1 AND actor_id LIKE 'run/' || $2 "
                    "|| '-%'",
                    ROUTE,
                    tag,
                )
                await conn.execute("DELETE FROM toren.limits WHERE name = 'agent/' || $1", tag)
        medians = {side: statistics.median(t) * 1000 for side, t in times.items()}
    finally:
        await client.close()
        for s in sessions:
            await s.close()
        await conn.close()
    plain, limited, loose = medians["plain"], medians["limited"], medians["loose"]
    b.record(
        "claim_50_ms_no_limits",
        round(plain, 3),
        f"claim of 50 (+ first messages), {waiting:,} waiting, 3x50 in flight, no limits",
        f"{plain:.2f} ms",
    )
    b.record(
        "claim_50_ms_limits",
        round(limited, 3),
        f"claim of 50 (+ first messages), {waiting:,} waiting, 3x50 in flight, agent cap 200",
        f"{limited:.2f} ms",
    )
    b.record(
        "claim_50_ms_limits_loose",
        round(loose, 3),
        f"claim of 50 (+ first messages), {waiting:,} waiting, 3x50 in flight, a cap none "
        "reaches (all hold permits)",
        f"{loose:.2f} ms",
    )
    b.ratio(
        "claim_limits_ratio",
        limited,
        "claim_50_ms_no_limits",
        "claim with limits / without",
        "target <= 1.2x",
    )
    b.ratio(
        "claim_limits_loose_ratio",
        loose,
        "claim_50_ms_no_limits",
        "claim under a cap none reaches / without",
        "target <= 1.2x",
    )
