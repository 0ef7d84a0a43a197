"""Replay: rebuild a 1,000-step run's state from its journal, digest checks included, against
the time its live execution took.

The run is executed live by a ``toren worker`` (1,000 model calls through the real SDK, each
but the last followed by a tool call). Its state is then rebuilt here exactly as a worker does
when it takes a run over whose snapshot is gone (the slow case: a snapshot spares most of this;
see :mod:`bench.activate`): the journal folded from seq 1, then every recorded call's digest
checked against the request this code would send (``verify``).
"""

from __future__ import annotations

import time

import anyio

from bench import app
from bench._common import Bench
from bench.agent import Finishes, walls
from bench.model import BenchModel
from toren import Client, Context
from toren._core.journal import replay as fold_journal
from toren.actors.runs import RunActor, verify
from toren.runs import RunState, fold, start_run


async def run(b: Bench) -> None:
    steps = b.count(1000, 20)
    async with BenchModel() as model, await Client.connect(b.url) as client:
        worker = b.start_worker(model.env())
        await b.wait_registered(client.pool, worker)
        finishes = Finishes(client)
        try:
            with b.task(f"replay: a {steps}-step run, live", steps) as task:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(finishes.watch)
                    run_id = await start_run(client, "bench", f"steps={steps} replay")
                    waiting = anyio.Event()
                    tg.start_soon(_progress, b, task, model, waiting)
                    await finishes.wait(run_id)
                    waiting.set()
                    tg.cancel_scope.cancel()
        finally:
            b.stop_workers()
        if finishes.failed:
            raise RuntimeError(f"the {steps}-step run failed: see {b.tmp / 'workers.log'}")
        live = (await walls(client, [run_id]))[run_id]
        agent = app.bench
        times = []
        with b.task("replay: rebuild from the journal", 5) as task:
            for _ in range(5):
                actor = RunActor(run_id, {"agent": "bench"})
                t = time.perf_counter()
                rebuilt = await fold_journal(client.pool, run_id, RunState(), fold)
                state, seq = rebuilt.state, rebuilt.seq
                ctx = Context(actor, state, seq, 0, None)
                verify(ctx, agent, go_on=False)
                times.append(time.perf_counter() - t)
                if ctx.events or len(state.calls) != steps or state.status != "completed":
                    raise RuntimeError(f"replay of {run_id} does not match its live run")
                b.progress.advance(task)
    replay = min(times)
    b.results["replay_events"] = seq
    b.results["replay_live_s"] = round(live, 3)
    b.record(
        "replay_1000_ms",
        round(replay * 1000, 1),
        f"replay of a {steps}-step run ({seq} events)",
        f"{replay * 1000:.0f} ms",
        f"best of 5; live execution took {live:.1f} s",
    )
    ratio = replay / live
    b.record(
        "replay_vs_live",
        round(ratio, 4),
        "replay / live execution",
        f"{ratio:.1%}",
        "target < 5%",
    )


async def _progress(b: Bench, task: object, model: BenchModel, done: anyio.Event) -> None:
    while not done.is_set():
        b.progress.update(task, completed=model.calls)  # type: ignore[arg-type]
        await anyio.sleep(0.2)
