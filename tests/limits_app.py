"""Agents under concurrency limits, for tests/test_limits.py (a worker process runs this app
too). The model is scripted by the test: each agent's system prompt names it."""

from __future__ import annotations

import anyio

from toren import Agent, ToolContext, tool

MODEL = "anthropic/claude-sonnet-4-6"


@tool(effects="read")
async def work(ctx: ToolContext, seconds: float) -> str:
    """Work for a while (the run is in flight meanwhile)."""
    await anyio.sleep(seconds)
    return "worked"


# One run per concurrency key at a time (the default per-key cap).
serial = Agent(name="serial", model=MODEL, system="serial", tools=[work])
# At most three runs at once, whatever their keys.
capped = Agent(name="capped", model=MODEL, system="capped", tools=[work], max_runs=3)
# a -> b, each capped at one run in flight: a waiting on its child holds no slot.
caller = Agent(name="caller", model=MODEL, system="caller", calls=["callee"], max_runs=1)
callee = Agent(
    name="callee",
    model=MODEL,
    system="callee",
    description="Answers.",
    accepts=["caller"],
    max_runs=1,
)
