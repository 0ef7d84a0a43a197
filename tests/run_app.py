"""An app with an agent for the run tests: a keyed external tool and one that needs approval."""

from __future__ import annotations

import os
from pathlib import Path

import anyio

from toren import Agent, ToolContext, durable_sleep, tool

applied: list[str] = []  # effects the "outside world" applied, by idempotency key


@tool(effects="external", idempotency="keyed")
async def create_ticket(ctx: ToolContext, title: str) -> str:
    """Open a ticket."""
    if ctx.idempotency_key not in applied:
        applied.append(ctx.idempotency_key)
    ledger = os.environ.get("TOREN_TEST_LEDGER")  # the tracker's log, across worker processes
    if ledger:
        with Path(ledger).open("a") as f:
            f.write(f"{ctx.idempotency_key} {title}\n")
    return f"ticket for {title!r}"


@tool(effects="external", idempotency="keyed", approval=lambda args: args["amount"] > 100)
async def refund(ctx: ToolContext, amount: float) -> str:
    """Refund the customer."""
    return f"refunded {amount:g}"


@tool(effects="external", idempotency="keyed")
async def slow_ticket(ctx: ToolContext, title: str) -> str:
    """Open a ticket, slowly the first time (tests kill the worker while it runs)."""
    ledger = Path(os.environ["TOREN_TEST_LEDGER"])
    with ledger.open("a") as f:
        f.write(f"{ctx.idempotency_key} {title}\n")
    first = ledger.with_suffix(".first")
    if not first.exists():
        first.write_text("x")
        await anyio.sleep(120)
    return f"ticket for {title!r}"


support = Agent(
    name="support",
    model="anthropic/claude-sonnet-4-6",
    system="You help customers.",
    tools=[create_ticket, refund, slow_ticket],
)

strict = Agent(
    name="strict", model="anthropic/claude-sonnet-4-6", tools=[create_ticket], max_attempts=2
)
cheap = Agent(
    name="cheap", model="anthropic/claude-sonnet-4-6", tools=[create_ticket], budget_usd=1e-9
)
hasty = Agent(
    name="hasty", model="anthropic/claude-sonnet-4-6", tools=[slow_ticket, refund], wall_clock=2
)
sleeper = Agent(
    name="sleeper", model="anthropic/claude-sonnet-4-6", tools=[durable_sleep], wall_clock=3
)
support_openai = Agent(name="support_openai", model="openai/gpt-4o", tools=[create_ticket, refund])
support_bedrock = Agent(
    name="support_bedrock",
    model="bedrock/anthropic.claude-sonnet-4-6-v1:0",
    tools=[create_ticket, refund],
)


@tool(effects="read", timeout=0.2)
async def flaky_lookup(ctx: ToolContext, what: str) -> str:
    """Fails or hangs, on demand."""
    if what == "explode":
        raise RuntimeError("the lookup service is down")
    if what == "hang":
        await anyio.sleep(5)
    return f"found {what}"


looker = Agent(name="looker", model="anthropic/claude-sonnet-4-6", tools=[flaky_lookup])
