"""The HTTP API: ``GET /runs/{id}`` under 50 concurrent connections from ``wrk`` (a second
process; Debian's ``wrk`` package), against ``toren serve`` with a bearer token.

The run read is a completed 10-step run (30 events): each request authenticates the token and
folds the run's journal into its state, receipt and events count.
"""

from __future__ import annotations

import re
import shutil
import socket
import subprocess
import time

import aiohttp
import anyio

from bench._common import Bench
from bench.agent import Finishes
from bench.model import BenchModel
from toren import Client
from toren._surfaces.tokens import SCOPES, create_token
from toren.runs import start_run

CONNECTIONS = 50
_UNITS = {"us": 0.001, "ms": 1.0, "s": 1000.0}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _ms(text: str) -> float:
    found = re.fullmatch(r"([\d.]+)(us|ms|s)", text)
    if found is None:
        raise ValueError(f"unreadable latency from wrk: {text!r}")
    return float(found.group(1)) * _UNITS[found.group(2)]


def parse_wrk(output: str) -> tuple[float, float]:
    """Requests/s and the p99 latency in ms from ``wrk --latency`` output."""
    rps = re.search(r"Requests/sec:\s+([\d.]+)", output)
    p99 = re.search(r"^\s+99%\s+(\S+)", output, re.MULTILINE)
    if rps is None or p99 is None:
        raise ValueError(f"unreadable output from wrk:\n{output}")
    return float(rps.group(1)), _ms(p99.group(1))


async def run(b: Bench) -> None:
    wrk = shutil.which("wrk")
    if wrk is None:
        raise RuntimeError("the API benchmark needs wrk: apt-get install wrk (Debian)")
    seconds = b.count(15, 2)
    async with BenchModel() as model, await Client.connect(b.url) as client:
        worker = b.start_worker(model.env())
        await b.wait_registered(client.pool, worker)
        finishes = Finishes(client)
        async with anyio.create_task_group() as tg:
            tg.start_soon(finishes.watch)
            run_id = await start_run(client, "bench", "steps=10 read over HTTP")
            await finishes.wait(run_id)
            tg.cancel_scope.cancel()
        b.stop_workers()
        _, token = await create_token(client.pool, "bench", scopes=SCOPES)
    port = _free_port()
    server = b.start_toren(["serve", "--port", str(port)])
    url = f"http://127.0.0.1:{port}/runs/{run_id.removeprefix('run/')}"
    try:
        await _wait_serving(url, token, server)
        with b.task(f"API: wrk, {CONNECTIONS} connections, {seconds} s", 1):
            done = await anyio.run_process(
                [
                    wrk,
                    "-t2",
                    f"-c{CONNECTIONS}",
                    f"-d{seconds}s",
                    "--latency",
                    "-H",
                    f"Authorization: Bearer {token}",
                    url,
                ],
                check=False,
            )
    finally:
        b.stop_workers()
    output = done.stdout.decode()
    if done.returncode or "Non-2xx" in output:
        raise RuntimeError(f"wrk failed or saw errors:\n{output}{done.stderr.decode()}")
    rps, p99 = parse_wrk(output)
    b.record(
        "api_get_run_rps",
        round(rps),
        f"API: GET /runs/{{id}}, {CONNECTIONS} connections",
        f"{rps:,.0f} req/s",
        "one toren serve process; wrk in another",
    )
    b.record(
        "api_get_run_p99_ms", round(p99, 2), "API: p99 latency", f"{p99:.1f} ms", "target < 20 ms"
    )


async def _wait_serving(url: str, token: str, server: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 60
    async with aiohttp.ClientSession() as http:
        while True:
            try:
                async with http.get(url, headers={"Authorization": f"Bearer {token}"}) as answer:
                    if answer.status == 200:
                        return
                    raise RuntimeError(f"GET {url}: {answer.status} {await answer.text()}")
            except aiohttp.ClientConnectionError:
                if server.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("toren serve did not start") from None
                await anyio.sleep(0.1)
