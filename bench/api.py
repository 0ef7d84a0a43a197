"""The HTTP API: ``GET /runs/{id}`` against ``toren serve`` with a bearer token, two ways.

- open loop: a constant 500 requests/s for 10 s from :mod:`bench.openloop` in a process of its
  own (Python and aiohttp: each request sent at its due time whatever the earlier ones do, its
  latency counted from that time), p50, p99 and max, with the generator's own CPU;
- closed loop: 50 concurrent connections from ``wrk`` (a second process; Debian's ``wrk``
  package), each sending its next request when its last is answered: throughput and p99.

The run read is a completed 10-step run (30 events): each request authenticates the token and
folds the run's journal into its state, receipt and events count.
"""

from __future__ import annotations

import json
import re
import shutil
import socket
import subprocess
import sys
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
OPEN_LOOP_RATE = 500  # requests/s
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
        rate = b.count(OPEN_LOOP_RATE, 50)
        with b.task(f"API: open loop, {rate} requests/s", 1):
            opened = await anyio.run_process(
                [
                    sys.executable,
                    "-m",
                    "bench.openloop",
                    url,
                    f"--rate={rate}",
                    f"--seconds={b.count(10, 1)}",
                    "--header",
                    f"Authorization: Bearer {token}",
                ],
                check=False,
            )
        if opened.returncode:
            raise RuntimeError(f"the open-loop generator failed:\n{opened.stderr.decode()}")
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
        "api_get_run_p99_ms",
        round(p99, 2),
        "API: p99 latency, 50 connections",
        f"{p99:.1f} ms",
        "closed loop: a slow answer holds back its connection's next request",
    )
    _open_loop(b, json.loads(opened.stdout))


def _open_loop(b: Bench, o: dict[str, float]) -> None:
    b.results["api_open_loop"] = o
    b.record(
        "api_open_loop_p99_ms",
        o["p99_ms"],
        f"API: p50 / p99 / max at a constant {o['rate']:g} requests/s",
        f"{o['p50_ms']:.1f} / {o['p99_ms']:.1f} / {o['max_ms']:.1f} ms",
        f"target p99 < 20 ms; open loop, {o['answered_per_s']:,.0f} answered/s, "
        f"{o['failed']:g} failed; latency from each request's due time",
    )
    b.record(
        "api_open_loop_generator_cpu",
        o["generator_cpu"],
        "API: the open-loop generator's CPU",
        f"{o['generator_cpu']:.0%} of a core",
        f"its own process (Python, aiohttp); sends late by {o['send_lag_p99_ms']:.1f} ms "
        f"at p99, {o['send_lag_max_ms']:.1f} ms at most",
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
