"""Listing runs by status: ``GET /runs?status=parked`` with 100,000 runs, 100 of them (0.1%)
parked and the rest completed (their summaries written straight into the actors table, as the
runs' steps leave them), through the HTTP API served in this process with a bearer token; the
median of 50 requests for the first page and of 50 for the page after it. Then ``GET /metrics``
over the same runs (median of 50), beside the count of every run it used to make.
"""

from __future__ import annotations

import logging
import statistics
import time
import uuid

import aiohttp
import asyncpg

from bench._common import Bench
from toren import Client
from toren._surfaces.serve import serving
from toren._surfaces.tokens import create_token
from toren.runs import RUN_KIND

REQUESTS = 50


async def run(b: Bench) -> None:
    runs = b.count(100_000, 100_000 // 10)
    tag = uuid.uuid4().hex[:8]
    async with await Client.connect(b.url) as client:
        with b.task(f"listing: {runs:,} runs written", 1):
            await client.pool.execute(
                "INSERT INTO toren.actors (actor_id, kind, args, status, route, summary, "
                "created_at) "
                "SELECT 'run/' || gen_random_uuid(), $3, jsonb_build_object('bench', $2::text), "
                "'live', 'agent:bench', "
                "jsonb_build_object('agent', 'bench', 'status', "
                "  CASE WHEN g % $4 = 0 THEN 'parked' ELSE 'completed' END, "
                "  'input', 'x', 'calls_made', 1, 'usd_paid', '0'), "
                "now() - make_interval(secs => g) FROM generate_series(1, $1) g",
                runs,
                tag,
                RUN_KIND,
                runs // 100,  # 100 parked runs: two full pages however many runs there are
            )
            await client.pool.execute("ANALYZE toren.actors")
        _, token = await create_token(client.pool, f"bench-list-{tag}")
        try:
            first, second, scrape = await _timed(b.url, token)
            scan = await _counted_by_scan(client.pool)
        finally:
            await client.pool.execute("DELETE FROM toren.actors WHERE args->>'bench' = $1", tag)
    b.record(
        "api_list_by_status_ms_100k",
        round(first, 2),
        f"GET /runs?status=parked, {runs:,} runs ({100 / (runs // 100):g}% parked)",
        f"{first:.1f} ms (next page {second:.1f} ms)",
        "target < 20 ms",
    )
    b.record(
        "metrics_scrape_ms_100k",
        round(scrape, 2),
        f"GET /metrics, {runs:,} runs",
        f"{scrape:.1f} ms",
        f"counting every run instead: {scan:.1f} ms",
    )


async def _timed(url: str, token: str) -> tuple[float, float, float]:
    # The server runs in this process: its access log would flood the suite's output (and
    # `toren serve`'s own logging is not what is measured here).
    logging.getLogger("toren.http.access").setLevel(logging.WARNING)
    headers = {"Authorization": f"Bearer {token}"}
    async with serving(url, port=0) as base, aiohttp.ClientSession(headers=headers) as http:
        medians = []
        cursor = None
        for page in range(2):
            times = []
            for _ in range(REQUESTS + 5):  # the first five warm up
                query = {
                    "status": "parked",
                    "limit": "50",
                    **({"cursor": cursor} if cursor else {}),
                }
                started = time.perf_counter()
                async with http.get(f"{base}/runs", params=query) as r:
                    body = await r.json()
                    if r.status != 200 or len(body["runs"]) != 50:
                        raise RuntimeError(f"GET /runs answered {r.status}: {body}")
                times.append((time.perf_counter() - started) * 1000)
            medians.append(statistics.median(times[5:]))
            cursor = body["next_cursor"]
            if page == 0 and not cursor:
                raise RuntimeError("no second page")
        times = []
        for _ in range(REQUESTS + 5):
            started = time.perf_counter()
            async with http.get(f"{base}/metrics") as r:
                text = await r.text()
                if r.status != 200 or 'toren_runs{status="parked"}' not in text:
                    raise RuntimeError(f"GET /metrics answered {r.status}: {text[:200]}")
            times.append((time.perf_counter() - started) * 1000)
        medians.append(statistics.median(times[5:]))
    return medians[0], medians[1], medians[2]


async def _counted_by_scan(pool: asyncpg.Pool) -> float:
    """The median time of the statement ``/metrics`` ran before migration 0006, for comparison."""
    times = []
    for _ in range(REQUESTS + 5):
        started = time.perf_counter()
        await pool.fetch(
            "SELECT coalesce(summary->>'status', 'running') AS status, count(*) AS n "
            "FROM toren.actors WHERE kind = 'toren.run' GROUP BY 1"
        )
        times.append((time.perf_counter() - started) * 1000)
    return statistics.median(times[5:])
