"""Fold: a run's state from its events, 1,000 steps against 16,000 (no database, no snapshot).

Each step is what an agent's tool loop records: a model call whose answer holds text and a tool
call, the tool's intent and its result. The fold must be linear in the journal's length (its
sequences and maps are persistent, its receipt totals kept as it goes): 16 times the steps should
take about 16 times as long. The best of several passes is kept for each size, so that a busy
machine's pauses do not pass for the fold's cost. The fold runs with Python's cycle collector
paused, as a replay folds (``toren._core.collector``); the ratio with it running is reported beside.
"""

from __future__ import annotations

import contextlib
import gc
import time
from collections.abc import Iterator
from typing import Any

from bench._common import Bench
from toren._core.collector import paused as collector_paused
from toren.runs import (
    ModelCalled,
    ModelResponse,
    RunStarted,
    RunState,
    Text,
    ToolCall,
    ToolIntended,
    ToolResulted,
    Usage,
    fold,
)


def step_events(
    i: int, *, digest: str, model: str = "bench", messages_len: int, checked_as: str = ""
) -> tuple[Any, ...]:
    """Step ``i`` of a tool loop: a model call whose answer holds text and a tool call, the
    tool's intent and its result."""
    call = ToolCall(id=f"c{i}", name="lookup", arguments={"step": i})
    response = ModelResponse(
        content=(Text(text=f"step {i}: looking it up"), call),
        stop_reason="tool_use",
        usage=Usage(input_tokens=100 + i, output_tokens=20),
        model="bench",
    )
    return (
        ModelCalled(
            step=i,
            digest=digest,
            model=model,
            response=response,
            cost_usd="0.00012",
            latency_ms=5,
            messages_len=messages_len,
            checked_as=checked_as,
        ),
        ToolIntended(call_id=call.id, name="lookup", arguments={"step": i}, idempotency_key=str(i)),
        ToolResulted(call_id=call.id, content=f"result {i}"),
    )


def journal(steps: int) -> Iterator[Any]:
    """The events of a ``steps``-step tool loop."""
    yield RunStarted(agent="bench", input="fold", at=1.0)
    for i in range(1, steps + 1):
        yield from step_events(i, digest=f"{i:064x}", messages_len=2 * i - 1)


def best_fold_seconds(steps: int, passes: int, *, collector: bool = False) -> float:
    """The best time to fold a ``steps``-step journal: with the cycle collector paused, as
    :func:`toren._core.journal.replay` folds, or (``collector``) with it running."""
    events = list(journal(steps))
    best = float("inf")
    for _ in range(passes):
        gc.collect()
        started = time.perf_counter()
        with contextlib.nullcontext() if collector else collector_paused():
            state = RunState()
            for event in events:
                state = fold(state, event)
        best = min(best, time.perf_counter() - started)
        if len(state.calls) != steps:
            raise RuntimeError(f"the fold kept {len(state.calls)} of {steps} calls")
    return best


async def run(b: Bench) -> None:
    small, large = b.count(1000, 100), b.count(16000, 1600)
    with b.task(f"fold: {small} and {large} steps", 4) as task:
        short = best_fold_seconds(small, 7)
        b.progress.advance(task)
        long = best_fold_seconds(large, 3)
        b.progress.advance(task)
        short_on = best_fold_seconds(small, 7, collector=True)
        b.progress.advance(task)
        long_on = best_fold_seconds(large, 3, collector=True)
    b.results["fold_16k_vs_1k_collector_running"] = round(long_on / short_on, 2)
    b.record("fold_1k_ms", round(short * 1000, 1), f"fold: {small} steps", f"{short * 1000:.0f} ms")
    b.record("fold_16k_ms", round(long * 1000, 1), f"fold: {large} steps", f"{long * 1000:.0f} ms")
    b.ratio(
        "fold_16k_vs_1k",
        long * 1000,
        "fold_1k_ms",
        f"fold: {large} over {small} steps",
        f"<= 20 (linear: 16); with the collector running: {long_on / short_on:.1f}",
    )
