"""DBOS Transact on the suite's Postgres: workflows of 10 no-op steps (a benchmark-only peer).

Run in its own process by :func:`run` (DBOS keeps process-wide state and threads); prints one
JSON object. Sequential workflows are timed one by one; 50 in flight are 50 threads each running
workflows back to back, and also 50 asyncio tasks (DBOS' async API); the better of the two is
reported.

    python -m bench.dbos_peer URL SEQUENTIAL PER_LANE
"""

from __future__ import annotations

import json
import logging
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import anyio

from bench._common import Bench

STEPS = 10
CONCURRENCY = 50


def _measure(url: str, sequential: int, per_lane: int) -> dict[str, Any]:
    from dbos import DBOS

    logging.getLogger("dbos").setLevel(logging.WARNING)
    DBOS(
        config={
            "name": "toren-bench",
            "system_database_url": url,
            "sys_db_pool_size": CONCURRENCY + 10,
            "log_level": "WARNING",
        }
    )

    @DBOS.step()
    def noop(i: int) -> int:
        return i

    @DBOS.workflow()
    def workflow() -> int:
        return sum(noop(i) for i in range(STEPS))

    @DBOS.step()
    async def anoop(i: int) -> int:
        return i

    @DBOS.workflow()
    async def aworkflow() -> int:
        total = 0
        for i in range(STEPS):
            total += await anoop(i)
        return total

    DBOS.launch()
    try:
        for _ in range(5):
            workflow()
        times = []
        for _ in range(sequential):
            t = time.perf_counter()
            workflow()
            times.append(time.perf_counter() - t)

        def lane(_: int) -> None:
            for _ in range(per_lane):
                workflow()

        t = time.perf_counter()
        with ThreadPoolExecutor(CONCURRENCY) as pool:
            list(pool.map(lane, range(CONCURRENCY)))
        threads = CONCURRENCY * per_lane / (time.perf_counter() - t)

        async def lanes() -> float:
            async def one() -> None:
                for _ in range(per_lane):
                    await aworkflow()

            t = time.perf_counter()
            async with anyio.create_task_group() as tg:
                for _ in range(CONCURRENCY):
                    tg.start_soon(one)
            return CONCURRENCY * per_lane / (time.perf_counter() - t)

        tasks = anyio.run(lanes)
    finally:
        DBOS.destroy()
    wall = sum(times)
    return {
        "wf_median_ms": statistics.median(times) * 1000,
        "wf_per_s_seq": sequential / wall,
        "wf_per_s_conc50_threads": threads,
        "wf_per_s_conc50_asyncio": tasks,
    }


async def run(b: Bench) -> None:
    sequential, per_lane = b.count(100, 3), b.count(4, 1)
    with b.task("DBOS: 10-step workflows (own process)", 1):
        done = await anyio.run_process(
            [sys.executable, "-m", "bench.dbos_peer", b.url, str(sequential), str(per_lane)],
            check=False,
        )
    if done.returncode:
        raise RuntimeError(f"the DBOS benchmark failed:\n{done.stderr.decode()[-3000:]}")
    found = json.loads(done.stdout.decode().strip().splitlines()[-1])
    step_ms = found["wf_median_ms"] / STEPS
    b.results["dbos_step_overhead_median_ms"] = round(step_ms, 4)
    b.record(
        "dbos_wf_per_s_seq",
        round(found["wf_per_s_seq"], 1),
        "DBOS: 10-step workflows/s, sequential",
        f"{found['wf_per_s_seq']:.1f}/s",
        f"{step_ms:.2f} ms per no-op step",
    )
    best = max(found["wf_per_s_conc50_threads"], found["wf_per_s_conc50_asyncio"])
    mode = "threads" if best == found["wf_per_s_conc50_threads"] else "asyncio"
    b.results["dbos_wf_per_s_conc50_threads"] = round(found["wf_per_s_conc50_threads"], 1)
    b.results["dbos_wf_per_s_conc50_asyncio"] = round(found["wf_per_s_conc50_asyncio"], 1)
    b.record(
        "dbos_wf_per_s_conc50",
        round(best, 1),
        "DBOS: 10-step workflows/s, 50 in flight",
        f"{best:.1f}/s",
        f"best of threads and asyncio ({mode})",
    )
    steps = best * STEPS
    b.record(
        "dbos_steps_per_s_conc50",
        round(steps),
        "DBOS: steps/s, 50 in flight",
        f"{steps:,.0f}/s",
    )
    if "kernel_steps_per_s_conc50" in b.results:
        b.ratio(
            "kernel_vs_dbos_conc50",
            b.results["kernel_steps_per_s_conc50"],
            "dbos_steps_per_s_conc50",
            "kernel steps/s / DBOS steps/s (50 in flight)",
            "target >= 10x",
        )


if __name__ == "__main__":
    url, sequential, per_lane = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    print(json.dumps(_measure(url, sequential, per_lane)))
