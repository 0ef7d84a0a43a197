"""The floor, the kernel step and the step statement alone: CPU per commit, stacks, plans."""

from __future__ import annotations

import itertools
import os
import re
import statistics
import time
import uuid
from pathlib import Path
from types import MappingProxyType
from typing import Any

import anyio
import asyncpg
import attrs

from bench import floor, kernel
from bench._common import Bench
from bench.profile.measure import Postgres, Window, cpu_seconds, summary
from toren import Client
from toren._core.step_sql import STEP, STEP_FRAGMENTS, StepInputs, arguments, step_statement


async def settle(seconds: float) -> None:
    await anyio.sleep(seconds)


async def phase_floor(b: Bench, pg: Postgres, out: Path) -> str:
    n = 15_000
    conn = await asyncpg.connect(b.url)
    try:
        await conn.execute(
            "CREATE TABLE IF NOT EXISTS bench_floor (id bigserial PRIMARY KEY, data jsonb NOT NULL)"
        )
        for _ in range(200):
            await conn.execute(floor._INSERT, floor.ROW)
        me = {"client (this process)": os.getpid()}
        with Window(out, "floor", pg, me, {"client": os.getpid()}) as w:
            for _ in range(n):
                await conn.execute(floor._INSERT, floor.ROW)
        plans = await _explain(conn, "EXPLAIN (ANALYZE, BUFFERS, WAL) " + floor._INSERT, floor.ROW)
    finally:
        await conn.close()
    spied = summary(out / "floor.client.raw.txt", wall=w.wall)
    spied += "\n" + summary(out / "floor.client.gil.raw.txt", wall=w.wall)
    return "\n".join(["## floor: sequential commits", "", w.table(n, "commit"), plans, spied])


async def _explain(conn: asyncpg.Connection, statement: str, *args: Any, times: int = 200) -> str:
    """Median execution and planning times of ``statement`` over ``times`` runs, each in a
    rolled-back transaction, and the last plan."""
    execution, planning, plan = [], [], ""
    for _ in range(times):
        tr = conn.transaction()
        await tr.start()
        try:
            rows = await conn.fetch(statement, *args)
        finally:
            await tr.rollback()
        plan = "\n".join(r[0] for r in rows)
        execution.append(float(re.search(r"Execution Time: ([\d.]+)", plan)[1]))  # type: ignore[index]
        planning.append(float(re.search(r"Planning Time: ([\d.]+)", plan)[1]))  # type: ignore[index]
    return (
        f"EXPLAIN ANALYZE over {times} runs (rolled back): execution median "
        f"{statistics.median(execution):.3f} ms, planning median {statistics.median(planning):.3f}"
        f" ms. The last plan:\n\n```\n{plan}\n```\n"
    )


async def _explain_step(client: Client) -> str:
    """EXPLAIN (ANALYZE, BUFFERS) of a Counter's step, as the worker sends it: a fresh actor,
    owned by hand inside the transaction, consumes its tick, appends one event, sends itself
    the next tick and claims it."""
    actor_id = await _ticking(client, "explain", last=10)
    owner = uuid.uuid4()
    execution, planning, plan = [], [], ""
    async with client.pool.acquire() as conn:
        for _ in range(200):
            tr = conn.transaction()
            await tr.start()
            try:
                epoch, message_id = await _take(conn, actor_id, owner)
                inputs = _tick_step(actor_id, owner, epoch, message_id)
                rows = await conn.fetch(
                    "EXPLAIN (ANALYZE, BUFFERS, WAL) " + STEP, *arguments(inputs)
                )
                result = await conn.fetchrow(STEP, *arguments(inputs))
                if result is None:
                    raise RuntimeError("the step fenced itself out")
            finally:
                await tr.rollback()
            plan = "\n".join(r[0] for r in rows)
            execution.append(float(re.search(r"Execution Time: ([\d.]+)", plan)[1]))  # type: ignore[index]
            planning.append(float(re.search(r"Planning Time: ([\d.]+)", plan)[1]))  # type: ignore[index]
    return (
        f"Step statement, EXPLAIN ANALYZE over 200 runs (rolled back): execution median "
        f"{statistics.median(execution):.3f} ms, planning median {statistics.median(planning):.3f}"
        f" ms. The last plan:\n\n```\n{plan}\n```\n"
    )


async def _plan_cache(client: Client, url: str) -> str:
    """How Postgres plans the step statement as a worker sends it (prepared once, executed many
    times): the plans it chose (``pg_prepared_statements``) and the statement's time seen from
    the client, under each ``plan_cache_mode``. Each execution is rolled back."""
    actor_id = await _ticking(client, "plans", last=10)
    owner = uuid.uuid4()
    lines = ["| plan_cache_mode | custom plans | generic plans | step statement, median ms |",
             "| --- | --- | --- | --- |"]  # fmt: skip
    for mode in ("auto", "force_generic_plan", "force_custom_plan"):
        conn = await asyncpg.connect(url)
        try:
            await conn.execute(f"SET plan_cache_mode = {mode}")
            prepared = await conn.prepare(STEP)
            times = []
            for _ in range(300):
                tr = conn.transaction()
                await tr.start()
                try:
                    epoch, message_id = await _take(conn, actor_id, owner)
                    args = arguments(_tick_step(actor_id, owner, epoch, message_id))
                    t = time.perf_counter()
                    if await prepared.fetchrow(*args) is None:
                        raise RuntimeError("the step fenced itself out")
                    times.append(time.perf_counter() - t)
                finally:
                    await tr.rollback()
            row = await conn.fetchrow(
                "SELECT custom_plans, generic_plans FROM pg_prepared_statements "
                "WHERE statement = $1",
                STEP,
            )
        finally:
            await conn.close()
        assert row is not None
        lines.append(f"| {mode} | {row['custom_plans']} | {row['generic_plans']} | "
                     f"{statistics.median(times[50:]) * 1000:.3f} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def _tick_step(actor_id: str, owner: uuid.UUID, epoch: int, message_id: int) -> StepInputs:
    return StepInputs(
        actor_id=actor_id, owner=owner, epoch=epoch, message_id=message_id,
        event_seqs=[1], event_types=["bench.ticked"], event_data=['{"n": 1}'],
        spawn_ids=[], spawn_kinds=[], spawn_args=[], replaced_timers=[],
        out_recipients=[actor_id], out_lanes=[1], out_kinds=["bench.tick"],
        out_bodies=['{"n": 2, "last": 10}'], out_dedupe_keys=[None],
        out_timer_keys=[None], out_delays=[0.0], reply_to=None, reply_kind=None,
        reply_body=None, summary=None, claim=True, spawn_routes=[],
    )  # fmt: skip


# The step statement as a plain step needs it (no spawn, timer, reply, summary, route, limits
# or dedupe key): a prototype for an estimate, never used by the worker. Each fragment left out
# still names its parameters (their types), in a CTE that reads nothing.
LEAN_FRAGMENTS = MappingProxyType(
    {
        **STEP_FRAGMENTS,
        "clash": """clash AS (
    SELECT NULL::text AS id, NULL::text AS kind, NULL::text AS existing
    WHERE false AND {spawn_ids}::text[] IS NULL AND {spawn_kinds}::text[] IS NULL
)""",
        "consume": """consumed AS (
    DELETE FROM toren.mailbox m USING fence
    WHERE m.id = {message_id} AND m.actor_id = fence.actor_id
    RETURNING m.id
)""",
        "timers": "cancelled AS (SELECT 1 WHERE false AND {replaced_timers}::text[] IS NULL)",
        "limits": "lim AS (SELECT true AS runs WHERE false AND {release}::bool)",
        "claim": """nxt AS (
    SELECT m.id FROM toren.mailbox m
    WHERE {claim} AND m.actor_id = {actor_id} AND m.visible_at <= now() AND m.id <> {message_id}
      AND EXISTS (SELECT 1 FROM consumed)
    ORDER BY m.lane, m.id LIMIT 1
), claimed AS (
    UPDATE toren.mailbox m SET deliveries = m.deliveries + 1
    FROM nxt WHERE m.id = nxt.id
    RETURNING m.id, m.lane, m.sender, m.kind, m.body, m.reply_to, m.deliveries, m.attempts,
              m.timer_name IS NOT NULL AS is_timer
)""",
        "spawn": """sp AS (SELECT 1 WHERE false AND {spawn_args}::jsonb[] IS NULL
    AND {spawn_routes}::text[] IS NULL AND {spawn_limits}::text[] IS NULL)""",
        "claim_own": """own AS (
    SELECT o.ord FROM o
    WHERE {claim} AND o.recipient = {actor_id} AND o.delay <= 0 AND NOT EXISTS (SELECT 1 FROM nxt)
    ORDER BY o.lane, o.ord LIMIT 1
)""",
        "send": """dd AS (SELECT NULL::text AS actor_id WHERE false), sent AS (
    INSERT INTO toren.mailbox
        (actor_id, lane, sender, kind, body, dedupe_key, timer_name, visible_at, deliveries)
    SELECT o.recipient, o.lane, {actor_id}, o.kind, o.body::jsonb, o.dedupe_key, o.timer_key,
           now() + make_interval(secs => o.delay),
           CASE WHEN o.ord = (SELECT ord FROM own) THEN 1 ELSE 0 END
    FROM o
    RETURNING actor_id, visible_at <= now() AS due, id, lane, sender, kind, body, reply_to,
              deliveries, attempts, timer_name IS NOT NULL AS is_timer
)""",
        "reply": """rep AS (SELECT NULL::uuid AS correlation_id
    WHERE false AND {reply_to}::uuid IS NULL AND {reply_kind}::text IS NULL
      AND {reply_body}::text IS NULL)""",
        "summary": "summed AS (SELECT 1 WHERE false AND {summary}::jsonb IS NULL)",
        "route": "routed AS (SELECT 1 WHERE false AND {route}::text IS NULL)",
    }
)


async def _ticking(client: Client, kind: str, last: int) -> str:
    """A fresh Counter (its id ``bench/KIND/…``) with one tick queued."""
    actor_id = f"bench/{kind}/{uuid.uuid4()}"
    await client.spawn(kernel.Counter, actor_id)
    await client.send(actor_id, kernel.Tick(n=1, last=last))
    return actor_id


async def _take(conn: asyncpg.Connection, actor_id: str, owner: uuid.UUID) -> tuple[int, int]:
    """Own ``actor_id`` as ``owner`` by hand (a new epoch, a lease of an hour): (epoch, the id of
    its queued message)."""
    epoch = await conn.fetchval(
        "UPDATE toren.actors SET owner = $2, epoch = epoch + 1, "
        "lease_expires_at = now() + interval '1 hour' WHERE actor_id = $1 RETURNING epoch",
        actor_id,
        owner,
    )
    message_id = await conn.fetchval("SELECT id FROM toren.mailbox WHERE actor_id = $1", actor_id)
    return epoch, message_id


async def _own(client: Client, conn: asyncpg.Connection, owner: uuid.UUID) -> tuple[str, int, int]:
    """A fresh Counter with one tick queued, owned by ``owner`` by hand: (id, epoch, tick id)."""
    actor_id = await _ticking(client, "chain", last=1)
    return actor_id, *await _take(conn, actor_id, owner)


# The rows a kernel step writes and nothing else (no fence, no claim, no checks): the least a
# step of this shape could cost the database, for comparison.
_THREE_WRITES = """
WITH d AS (DELETE FROM toren.mailbox WHERE id = $1 RETURNING actor_id),
e AS (INSERT INTO toren.journal (actor_id, seq, epoch, type, data)
      SELECT actor_id, $2, $3, 'bench.ticked', '{"n": 1}'::jsonb FROM d RETURNING 1),
s AS (INSERT INTO toren.mailbox (actor_id, lane, sender, kind, body, deliveries)
      SELECT actor_id, 1, actor_id, 'bench.tick', '{"n": 2, "last": 10}'::jsonb, 1 FROM d
      RETURNING id)
SELECT id FROM s
"""


async def phase_statement(b: Bench, pg: Postgres, out: Path) -> str:
    """A chain of steps committed by a bare asyncpg loop (no worker, no host): the step
    statement, the lean prototype, the three writes alone and the floor's insert, taking
    turns in blocks, each a transaction of its own. What the statement alone costs, against
    the floor."""
    lean = step_statement(LEAN_FRAGMENTS)
    owner = uuid.uuid4()
    block, blocks = 1000, 6
    names = ("floor insert", "step statement", "lean prototype", "three writes only")
    times: dict[str, list[float]] = {name: [] for name in names}
    cpu: dict[str, list[float]] = {k: [0.0, 0.0] for k in times}
    async with await Client.connect(b.url) as client:
        conn = await asyncpg.connect(b.url)
        try:
            await conn.execute(
                "CREATE TABLE IF NOT EXISTS bench_floor "
                "(id bigserial PRIMARY KEY, data jsonb NOT NULL)"
            )
            chains = {}
            for name, statement in (
                ("step statement", STEP),
                ("lean prototype", lean),
                ("three writes only", _THREE_WRITES),
            ):
                actor_id, epoch, message_id = await _own(client, conn, owner)
                chains[name] = [statement, actor_id, epoch, message_id, 1]
            for i in range(blocks + 1):  # the first block warms plans, not counted
                for name in times:
                    pg0, me0 = pg.cpu(), cpu_seconds(os.getpid())
                    for _ in range(block):
                        t = time.perf_counter()
                        if name == "floor insert":
                            await conn.execute(floor._INSERT, floor.ROW)
                        elif name == "three writes only":
                            chain = chains[name]
                            _, actor_id, epoch, message_id, seq = chain
                            new_id = await conn.fetchval(_THREE_WRITES, message_id, seq, epoch)
                            if new_id is None:
                                raise RuntimeError(f"{name}: the chain broke")
                            chain[3], chain[4] = new_id, seq + 1
                        else:
                            chain = chains[name]
                            statement, actor_id, epoch, message_id, seq = chain
                            inputs = _tick_step(actor_id, owner, epoch, message_id)
                            inputs = attrs.evolve(inputs, event_seqs=[seq])
                            row = await conn.fetchrow(statement, *arguments(inputs))
                            if row is None or row["id"] is None:
                                raise RuntimeError(f"{name}: the chain broke: {row}")
                            chain[3], chain[4] = row["id"], seq + 1
                        if i:
                            times[name].append(time.perf_counter() - t)
                    if i:
                        pg1 = pg.cpu()
                        cpu[name][0] += sum(
                            s - pg0.get(p, ("", 0.0))[1] for p, (_, s) in pg1.items()
                        )
                        cpu[name][1] += cpu_seconds(os.getpid()) - me0
            # Nothing of these chains is left for a worker of a later phase to take over.
            await conn.execute("DELETE FROM toren.mailbox WHERE actor_id LIKE 'bench/chain/%'")
        finally:
            await conn.close()
    base = statistics.median(times["floor insert"])
    n = block * blocks
    lines = [
        "## the step statement alone: committed by a bare asyncpg loop",
        "",
        f"{blocks} blocks of {block} of each, taking turns, each a transaction of its own.",
        "",
        "| statement | median ms | p99 ms | x floor | Postgres CPU ms | client CPU ms |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for name, seconds in times.items():
        ordered = sorted(seconds)
        median = statistics.median(seconds)
        lines.append(
            f"| {name} | {median * 1000:.3f} | {ordered[int(len(ordered) * 0.99)] * 1000:.3f} | "
            f"{median / base:.2f} | {cpu[name][0] * 1000 / n:.3f} | {cpu[name][1] * 1000 / n:.3f} |"
        )
    return "\n".join(lines) + "\n"


async def _journal_gaps(pool: asyncpg.Pool, actor_id: str) -> float:
    stamps = await pool.fetch(
        "SELECT extract(epoch FROM created_at)::float8 AS t FROM toren.journal "
        "WHERE actor_id = $1 ORDER BY seq",
        actor_id,
    )
    return statistics.median(b["t"] - a["t"] for a, b in itertools.pairwise(stamps))


async def phase_kernel(b: Bench, pg: Postgres, out: Path) -> str:
    n = 15_000
    async with await Client.connect(b.url) as client:
        worker = b.start_worker()
        await b.wait_registered(client.pool, worker)
        await settle(6)  # the worker's background SDK preload (bench.app has agents)
        actor = "bench/profile/seq"
        await kernel._queue(client, [actor], n)
        procs = {"worker": worker.pid, "client (this process)": os.getpid()}
        with Window(out, "kernel", pg, procs, {"worker": worker.pid}) as w:
            while (
                await client.pool.fetchval(
                    "SELECT max(seq) FROM toren.journal WHERE actor_id = $1", actor
                )
                or 0
            ) < n:
                await anyio.sleep(0.1)
        gap = await _journal_gaps(client.pool, actor) * 1000
        b.stop_workers()
        plans = await _explain_step(client)
        plans += "\n" + await _plan_cache(client, b.url)
    return "\n".join(
        [
            "## kernel: one actor's chain of steps",
            "",
            f"journal gap between consecutive steps (median): {gap:.3f} ms",
            "",
            w.table(n, "step"),
            plans,
            summary(out / "kernel.worker.raw.txt", wall=w.wall),
            summary(out / "kernel.worker.gil.raw.txt", wall=w.wall),
        ]
    )
