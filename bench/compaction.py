"""Compaction: a 500-step run on a 16k-token window, against the same run without compaction.

An agent reads 500 pages of 1.5 KB, one tool call each, through the real Anthropic SDK and a
local server that counts every request's input tokens with Toren's estimator (four UTF-8 bytes
of text per token). Run once with ``context_window`` set (the server refusing anything over the
window, so the figure is for a run that stayed under it) and once without compaction (a window
the price library does not know, a server with no window): the second must cost more input
tokens, and its first request over the window says where a real provider would have refused
it. The compacted run's state is then rebuilt from its journal with its digests checked (as a
worker does without a snapshot).

This module is also the benchmark's app (``toren worker --app bench.compaction``).
"""

from __future__ import annotations

import hashlib
import re
import time
from typing import Any

import anyio
from aiohttp import web

from bench._common import Bench
from bench.agent import Finishes
from toren import Agent, Client, Context, ToolContext, tool
from toren.actors.runs.summarising import SUMMARISER
from toren.testing import AnthropicServer, Reply, Text, ToolCall

WINDOW = 16384
PAGE_BYTES = 1500
MODEL = "anthropic/bench-window"  # unknown to the price library: no window, no price


def page_text(n: int) -> str:
    words, seed = [], f"page {n}".encode()
    while sum(len(w) + 1 for w in words) < PAGE_BYTES:
        seed = hashlib.sha256(seed).digest()
        words.append(seed.hex()[: 4 + seed[0] % 8])
    return f"page {n}: " + " ".join(words)[:PAGE_BYTES]


@tool(effects="read")
async def page(ctx: ToolContext, n: int) -> str:
    """Read page ``n``."""
    return page_text(n)


bench_compacting = Agent(
    name="bench_compacting",
    model=MODEL,
    system="You read the archive page by page.",
    tools=[page],
    context_window=WINDOW,
)
bench_uncompacted = Agent(
    name="bench_uncompacted", model=MODEL, system="You read the archive page by page.", tools=[page]
)


def _script(body: dict[str, Any], _n: int) -> Reply:
    if body.get("system") == SUMMARISER:
        return Reply("The agent has been reading the archive page by page.")
    first = body["messages"][0]["content"]
    text = first if isinstance(first, str) else str(first[0]["text"])
    found = re.search(r"pages=(\d+)", text)
    pages = int(found.group(1)) if found else 1
    last = 0
    for message in reversed(body["messages"]):
        blocks = message["content"] if isinstance(message["content"], list) else []
        calls = [b for b in blocks if b.get("type") == "tool_use"]
        if message["role"] == "assistant" and calls:
            last = int(calls[-1]["input"]["n"])
            break
    if last >= pages:
        return Reply(f"Read {pages} pages.")
    call = ToolCall(id=f"p{last + 1}", name="page", arguments={"n": last + 1})
    return Reply([Text(text=f"Page {last + 1}."), call])


class PagesModel(AnthropicServer):
    """Answers from :func:`_script`; sums input tokens, keeps no request bodies."""

    def __init__(self, window: int | None) -> None:
        super().__init__(_script, window=window)
        self.calls = 0
        self.refused_calls = 0
        self.tokens_sent = 0
        self.largest = 0
        self.first_over: int | None = None  # the first request over WINDOW (its number)

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        try:
            return await super()._handle(request)
        finally:
            for r in self.received:
                self.calls += 1
                self.refused_calls += r.refused
                self.tokens_sent += 0 if r.refused else r.input_tokens
                self.largest = max(self.largest, r.input_tokens)
                if self.first_over is None and r.input_tokens > WINDOW:
                    self.first_over = self.calls
            self.received.clear()


async def _one_run(b: Bench, client: Client, agent: str, steps: int, window: int | None) -> Any:
    async with PagesModel(window) as model:
        worker = b.start_toren(["worker", "--app", "bench.compaction"], model.env())
        await b.wait_registered(client.pool, worker)
        finishes = Finishes(client)
        from toren.runs import start_run

        try:
            with b.task(f"compaction: {agent}, {steps} pages", 1):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(finishes.watch)
                    run_id = await start_run(client, agent, f"Read the archive: pages={steps}")
                    await finishes.wait(run_id)
                    tg.cancel_scope.cancel()
        finally:
            b.stop_workers()
        if finishes.failed:
            from toren.runs import read_run

            state = await read_run(client, run_id)
            raise RuntimeError(f"the {agent} run failed: {state.error_class}: {state.error}")
        return run_id, model


async def run(b: Bench) -> None:
    from toren._core.journal import replay as fold_journal
    from toren.actors.runs import RunActor, verify
    from toren.runs import RunState, fold, receipt

    steps = b.count(500, 20)
    async with await Client.connect(b.url) as client:
        run_id, compacted = await _one_run(b, client, "bench_compacting", steps, WINDOW)
        _, whole = await _one_run(b, client, "bench_uncompacted", steps, None)
        times = []
        for _ in range(3):
            actor = RunActor(run_id, {"agent": "bench_compacting"})
            t = time.perf_counter()
            rebuilt = await fold_journal(client.pool, run_id, RunState(), fold)
            ctx = Context(actor, rebuilt.state, rebuilt.seq, 0, None)
            verify(ctx, bench_compacting, go_on=False)
            times.append(time.perf_counter() - t)
            if ctx.events or rebuilt.state.status != "completed":
                raise RuntimeError(f"replay of {run_id} does not match its live run")
        state = rebuilt.state
    r = receipt(state)
    if compacted.refused_calls or compacted.largest > WINDOW:
        raise RuntimeError(f"a compacted request went over the window ({compacted.largest})")
    b.record(
        "compaction_500_input_tokens",
        compacted.tokens_sent,
        f"input tokens sent, {steps} steps on a {WINDOW // 1024}k window",
        f"{compacted.tokens_sent:,}",
        f"{r.compactions_soft} soft, {r.compactions_hard} hard compactions; largest request "
        f"{compacted.largest:,}",
    )
    over = f"over the window from request {whole.first_over}" if whole.first_over else ""
    b.record(
        "nocompaction_500_input_tokens",
        whole.tokens_sent,
        f"input tokens sent, the same {steps} steps without compaction",
        f"{whole.tokens_sent:,}",
        f"largest request {whole.largest:,}; {over or 'never over the window'}",
    )
    ratio = whole.tokens_sent / max(1, compacted.tokens_sent)
    b.record(
        "nocompaction_vs_compaction_input",
        round(ratio, 2),
        "input tokens without compaction / with",
        f"{ratio:.1f}x",
        "must be > 1 (or the run fails)",
    )
    replay = min(times)
    b.record(
        "compaction_500_replay_ms",
        round(replay * 1000, 1),
        f"replay of the compacted {steps}-step run ({rebuilt.seq} events)",
        f"{replay * 1000:.0f} ms",
        "best of 3, digests checked across compactions",
    )
