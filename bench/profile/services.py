"""Agent runs at 50 in flight and the HTTP API under ``wrk``: CPU per step or request, stacks."""

from __future__ import annotations

import os
import statistics
import subprocess
import time
from pathlib import Path

import anyio
import asyncpg

from bench import agent, api
from bench._common import Bench
from bench.model import BenchModel
from bench.profile.measure import Postgres, Window, summary
from bench.profile.statements import settle
from toren import Client
from toren._core.journal_reads import actor_and_events
from toren.runs import start_run


async def phase_agent(b: Bench, pg: Postgres, out: Path) -> str:
    per_lane = 3
    async with BenchModel() as model, await Client.connect(b.url) as client:
        worker = b.start_worker(model.env())
        await b.wait_registered(client.pool, worker)
        finishes = agent.Finishes(client)
        async with anyio.create_task_group() as tg:
            tg.start_soon(finishes.watch)
            for i in range(3):  # warm: the SDK imported, plans prepared
                await finishes.wait(await start_run(client, "bench", f"steps=10 warm {i}"))

            async def lane(k: int) -> None:
                for i in range(per_lane):
                    run_id = await start_run(client, "bench", f"steps=10 lane {k} run {i}")
                    await finishes.wait(run_id)

            procs = {"worker": worker.pid, "bench (model server + client)": os.getpid()}
            spy = {"worker": worker.pid, "bench": os.getpid()}
            with Window(out, "agent", pg, procs, spy) as w:
                async with anyio.create_task_group() as lanes:
                    for k in range(agent.CONCURRENCY):
                        lanes.start_soon(lane, k)
            tg.cancel_scope.cancel()
        b.stop_workers()
    runs = agent.CONCURRENCY * per_lane
    return "\n".join(
        [
            "## agent: 10-step runs, 50 in flight",
            "",
            f"{runs} runs in {w.wall:.1f} s: {runs / w.wall:.1f} runs/s",
            "",
            w.table(runs * 10, "step"),
            summary(out / "agent.worker.raw.txt", wall=w.wall),
            summary(out / "agent.worker.gil.raw.txt", wall=w.wall),
            summary(out / "agent.bench.raw.txt", top=10, wall=w.wall),
        ]
    )


async def _read_plans(url: str, run_id: str) -> str:
    """The API's run read (``actor_and_events``, as ``GET /runs/{id}`` makes it once its state
    is cached: no events after the last seq), prepared once and run 300 times on one
    connection under each ``plan_cache_mode``: the plans Postgres chose and the time seen here."""
    lines = ["| plan_cache_mode | custom plans | generic plans | read, median ms |",
             "| --- | --- | --- | --- |"]  # fmt: skip
    for mode in ("auto", "force_generic_plan", "force_custom_plan"):
        conn = await asyncpg.connect(url)
        try:
            await conn.execute(f"SET plan_cache_mode = {mode}")
            last = await conn.fetchval("SELECT max(seq) FROM toren.journal WHERE actor_id = $1",
                                       run_id)  # fmt: skip
            fields = ("args.concurrency_key", "args.schedule", "args.slot")
            times = []
            for _ in range(300):
                t = time.perf_counter()
                await actor_and_events(conn, run_id, after=last, fields=fields, mail_kind="run.say")
                times.append(time.perf_counter() - t)
            row = await conn.fetchrow(
                "SELECT custom_plans, generic_plans FROM pg_prepared_statements "
                "WHERE statement LIKE '%LEFT JOIN toren.journal%' "
                "AND statement NOT LIKE '%pg_prepared_statements%'"
            )
        finally:
            await conn.close()
        assert row is not None
        lines.append(f"| {mode} | {row['custom_plans']} | {row['generic_plans']} | "
                     f"{statistics.median(times[50:]) * 1000:.3f} |")  # fmt: skip
    return "\n".join(lines) + "\n"


async def phase_api(b: Bench, pg: Postgres, out: Path, seconds: int) -> str:
    async with BenchModel() as model, await Client.connect(b.url) as client:
        worker = b.start_worker(model.env())
        await b.wait_registered(client.pool, worker)
        finishes = agent.Finishes(client)
        async with anyio.create_task_group() as tg:
            tg.start_soon(finishes.watch)
            run_id = await start_run(client, "bench", "steps=10 read over HTTP")
            await finishes.wait(run_id)
            tg.cancel_scope.cancel()
        b.stop_workers()
        _, token = await api.create_token(client.pool, "bench", scopes=api.SCOPES)
    port = api._free_port()
    server = b.start_toren(["serve", "--port", str(port)])
    url = f"http://127.0.0.1:{port}/runs/{run_id.removeprefix('run/')}"
    await api._wait_serving(url, token, server)
    await settle(3)
    with Window(out, "api", pg, {"toren serve": server.pid}, {"serve": server.pid}) as w:
        # Popen and wait4, not anyio.run_process: wait4 reports wrk's own CPU time.
        wrk = subprocess.Popen(  # noqa: ASYNC220
            ["wrk", "-t2", f"-c{api.CONNECTIONS}", f"-d{seconds}s", "--latency",
             "-H", f"Authorization: Bearer {token}", url],
            stdout=subprocess.PIPE,
        )  # fmt: skip
        _, _, usage = await anyio.to_thread.run_sync(os.wait4, wrk.pid, 0)
    b.stop_workers()
    plans = await _read_plans(b.url, run_id)
    text = wrk.stdout.read().decode() if wrk.stdout else ""
    rps, p99 = api.parse_wrk(text)
    requests = int(rps * seconds)
    w.cpu["wrk"] = usage.ru_utime + usage.ru_stime
    return "\n".join(
        [
            f"## API: GET /runs/{{id}}, {api.CONNECTIONS} connections, {seconds} s",
            "",
            f"wrk: {rps:,.0f} req/s, p99 {p99:.1f} ms",
            "",
            "```\n" + text + "```",
            "",
            w.table(requests, "request"),
            plans,
            summary(out / "api.serve.raw.txt", wall=w.wall, top=25),
            summary(out / "api.serve.gil.raw.txt", wall=w.wall, top=25),
        ]
    )
