"""Forks: a new run from step k of a long run, against that run's live execution.

A ``toren worker`` executes a run of N model calls live (each but the last followed by a tool
call). The run is then forked at its last step, several times: each fork's journal starts with
the source's events before that step, copied in one transaction, and the fork makes one model
call live. Measured:

- the fork's creation (``fork_run``: the prefix copied, ``run.forked`` and the fork's first
  message written), median of the forks;
- a fork's wall time, from its row to its ``run.completed`` (claimed, its state folded from the
  copied journal, one live call), median, against the source's live wall time;
- the model calls the forks made: one each (the N - 1 before the step are not asked again).
"""

from __future__ import annotations

import statistics
import time

import anyio

from bench._common import Bench
from bench.agent import Finishes, walls
from bench.model import BenchModel
from toren import Client
from toren.runs import fork_run, start_run

FORKS = 5


async def run(b: Bench) -> None:
    steps = b.count(200, 10)
    async with BenchModel() as model, await Client.connect(b.url) as client:
        worker = b.start_worker(model.env())
        await b.wait_registered(client.pool, worker)
        finishes = Finishes(client)
        created: list[float] = []
        forks: list[str] = []
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(finishes.watch)
                with b.task(f"fork: a {steps}-step run, live", 1) as task:
                    source = await start_run(client, "bench", f"steps={steps} fork")
                    await finishes.wait(source)
                    b.progress.advance(task)
                before = model.calls
                with b.task(f"fork: {FORKS} forks at step {steps}", FORKS) as task:
                    for _ in range(FORKS):
                        started = time.perf_counter()
                        fork = await fork_run(client, source, at=steps)
                        created.append(time.perf_counter() - started)
                        await finishes.wait(fork)
                        forks.append(fork)
                        b.progress.advance(task)
                tg.cancel_scope.cancel()
        finally:
            b.stop_workers()
        if finishes.failed:
            raise RuntimeError(f"a fork benchmark run failed: see {b.tmp / 'workers.log'}")
        calls = model.calls - before
        times = await walls(client, [source, *forks])
    live = times[source]
    fork_wall = statistics.median(times[f] for f in forks)
    create_ms = statistics.median(created) * 1000
    b.results["fork_live_s"] = round(live, 3)
    b.record(
        "fork_create_ms",
        round(create_ms, 1),
        f"fork of a {steps}-step run at its last step: created",
        f"{create_ms:.1f} ms",
        f"median of {FORKS}; the prefix copied in one transaction",
    )
    b.record(
        "fork_calls",
        calls / FORKS,
        "model calls per fork",
        f"{calls / FORKS:g}",
        f"target 1 (the {steps - 1} calls before the step are not asked again)",
    )
    ratio = fork_wall / live
    b.record(
        "fork_vs_live",
        round(ratio, 4),
        "fork's wall time / the source's live wall time",
        f"{ratio:.1%} ({fork_wall * 1000:.0f} ms vs {live:.1f} s)",
        "median of the forks (each folds the copied prefix and makes one call)",
    )
