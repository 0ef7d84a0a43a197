"""The physical floor: what one durable commit costs on this database, with nothing around it.

Raw asyncpg, one ~300-byte jsonb row per single-statement transaction: sequentially on one
connection (median and p99 per commit), then from 50 connections at once (commits/s, where
Postgres' group commit shares one WAL flush among concurrent commits).
"""

from __future__ import annotations

import time

import anyio
import asyncpg
import orjson

from bench._common import Bench, median_ms, p99_ms

CONCURRENCY = 50
ROW = orjson.dumps(
    {
        "actor_id": "run/0b4f7cde-58a1-4f0e-9d64-1a3e0c2b9f11",
        "type": "model.called",
        "step": 7,
        "model": "claude-sonnet-4-6",
        "usage": {"input_tokens": 1834, "output_tokens": 212},
        "digest": "6f1c0e8a9b2d4c3e5f7a8b9c0d1e2f3a",
        "text": "The order was shipped on Tuesday; I opened a ticket with the courier.",
        "cost_usd": "0.008682",
    }
).decode()

_INSERT = "INSERT INTO bench_floor (data) VALUES ($1::jsonb)"


async def run(b: Bench) -> None:
    assert 250 <= len(ROW) <= 350, len(ROW)
    conn = await asyncpg.connect(b.url)
    try:
        await conn.execute(
            "CREATE TABLE IF NOT EXISTS bench_floor (id bigserial PRIMARY KEY, data jsonb NOT NULL)"
        )
        n = b.count(3000, 50)
        for _ in range(min(n, 200)):  # warm the plan cache and the WAL
            await conn.execute(_INSERT, ROW)
        times: list[float] = []
        with b.task("floor: sequential commits", n) as task:
            for _ in range(n):
                t = time.perf_counter()
                await conn.execute(_INSERT, ROW)
                times.append(time.perf_counter() - t)
                b.progress.advance(task)
    finally:
        await conn.close()
    median, p99 = median_ms(times), p99_ms(times)
    b.results["floor_commit_p99_ms"] = round(p99, 4)
    b.record(
        "floor_commit_median_ms",
        round(median, 4),
        "floor: one commit, sequential (median / p99)",
        f"{median:.3f} / {p99:.3f} ms",
        "raw asyncpg INSERT of a 300-byte jsonb row",
    )
    per_conn = b.count(400, 10)
    pool = await asyncpg.create_pool(b.url, min_size=CONCURRENCY, max_size=CONCURRENCY)
    try:
        with b.task("floor: 50 connections", CONCURRENCY * per_conn) as task:

            async def lane() -> None:
                async with pool.acquire() as c:
                    for _ in range(per_conn):
                        await c.execute(_INSERT, ROW)
                        b.progress.advance(task)

            t = time.perf_counter()
            async with anyio.create_task_group() as tg:
                for _ in range(CONCURRENCY):
                    tg.start_soon(lane)
            wall = time.perf_counter() - t
    finally:
        await pool.close()
    rate = CONCURRENCY * per_conn / wall
    b.record(
        "floor_commits_per_s_conc50",
        round(rate),
        "floor: commits/s, 50 connections",
        f"{rate:,.0f}/s",
        "group commit: concurrent commits share a WAL flush",
    )
