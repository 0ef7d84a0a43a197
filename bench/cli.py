"""The command line's start-up: ``toren --help``, ``toren jobs list --help``, ``toren jobs list``
and ``toren jobs show RUN``, each timed as a whole process (``python -m toren ...``, as a person
runs it, on the suite's database; RUN a completed 10-step run), beside ``python -c pass``: the
interpreter's own start-up, the floor no command can go under. The median of 15 runs each, the
commands taking turns so that a busy moment of the machine falls on all of them alike.

Then a worker's: ``toren worker --app bench.app`` (an app whose agents call Anthropic) from its
start to its row in ``toren.workers`` (it claims from then on), stopped with SIGTERM once there;
the median of 10.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Mapping, Sequence

import anyio
import asyncpg

from bench._common import ROOT, Bench
from bench.agent import Finishes
from bench.model import BenchModel
from toren import Client
from toren.runs import start_run

BASELINE = "cli_python_pass_ms"


def commands(run_id: str) -> list[tuple[str, str, tuple[str, ...]]]:
    """``(key, figure, python's arguments)`` of each process timed, the baseline first."""
    toren = ("-m", "toren")
    return [
        (BASELINE, "python -c pass", ("-c", "pass")),
        ("cli_help_ms", "toren --help", (*toren, "--help")),
        ("cli_jobs_list_help_ms", "toren jobs list --help", (*toren, "jobs", "list", "--help")),
        ("cli_jobs_list_ms", "toren jobs list", (*toren, "jobs", "list")),
        ("cli_jobs_show_ms", "toren jobs show RUN", (*toren, "jobs", "show", run_id)),
    ]


async def timed(argvs: Sequence[Sequence[str]], rounds: int, env: Mapping[str, str]) -> list[float]:
    """The median wall time in ms of each ``python ARGV`` process over ``rounds`` rounds, in
    which each runs once in turn (after one round that warms the file cache up, not counted).

    Raises:
        RuntimeError: a process exited with an error.
    """
    times: list[list[float]] = [[] for _ in argvs]
    for n in range(rounds + 1):
        for argv, spent in zip(argvs, times, strict=True):
            started = time.perf_counter()
            done = await anyio.run_process([sys.executable, *argv], env=env, cwd=ROOT, check=False)
            took = (time.perf_counter() - started) * 1000
            if done.returncode:
                said = done.stderr.decode(errors="replace")[-2000:]
                raise RuntimeError(f"python {' '.join(argv)} exited {done.returncode}: {said}")
            if n:
                spent.append(took)
    return [statistics.median(spent) for spent in times]


async def worker_registered(b: Bench, pool: asyncpg.Pool, rounds: int) -> float:
    """The median time in ms from a ``toren worker`` process's start to its registration."""
    times = []
    for _ in range(rounds):
        started = time.perf_counter()
        worker = b.start_worker()
        await b.wait_registered(pool, worker)
        times.append((time.perf_counter() - started) * 1000)
        b.stop_workers()
    return statistics.median(times)


async def run(b: Bench) -> None:
    rounds = b.count(15, 2)
    async with BenchModel() as model, await Client.connect(b.url) as client:
        worker = b.start_worker(model.env())
        await b.wait_registered(client.pool, worker)
        finishes = Finishes(client)
        async with anyio.create_task_group() as tg:
            tg.start_soon(finishes.watch)
            run_id = await start_run(client, "bench", "steps=10 shown by the CLI")
            await finishes.wait(run_id)
            tg.cancel_scope.cancel()
        b.stop_workers()
    timings = commands(run_id)
    env = b.environ({"TOREN_HOME": str(b.tmp / "cli-home")})  # no `toren dev` record read
    with b.task(f"CLI: {len(timings)} processes, {rounds} rounds", 1):
        medians = await timed([argv for _, _, argv in timings], rounds, env)
    for (key, figure, _), ms in zip(timings, medians, strict=True):
        note = "the interpreter's start-up" if key == BASELINE else "target < 500 ms"
        b.record(key, round(ms, 1), f"CLI: {figure} (median)", f"{ms:.0f} ms", note)
        if key != BASELINE:
            vs = key.removesuffix("_ms") + "_vs_python"
            b.ratio(vs, ms, BASELINE, f"CLI: {figure} / python -c pass", "")
    rounds = b.count(10, 1)
    with b.task(f"CLI: toren worker to registered, {rounds} times", 1):
        async with await Client.connect(b.url) as client:
            ms = await worker_registered(b, client.pool, rounds)
    b.record(
        "cli_worker_registered_ms",
        round(ms),
        "CLI: toren worker, start to registered (median)",
        f"{ms:.0f} ms",
        "an app whose agents call Anthropic",
    )
