"""An app with an agent for the run tests: a keyed external tool and one that needs approval."""

from __future__ import annotations

from toren import Agent, ToolContext, tool

applied: list[str] = []  # effects the "outside world" applied, by idempotency key


@tool(effects="external", idempotency="keyed")
async def create_ticket(ctx: ToolContext, title: str) -> str:
    """Open a ticket."""
    if ctx.idempotency_key not in applied:
        applied.append(ctx.idempotency_key)
    return f"ticket for {title!r}"


@tool(effects="external", idempotency="keyed", approval=lambda args: args["amount"] > 100)
async def refund(ctx: ToolContext, amount: float) -> str:
    """Refund the customer."""
    return f"refunded {amount:g}"


support = Agent(
    name="support",
    model="anthropic/claude-sonnet-4-6",
    system="You help customers.",
    tools=[create_ticket, refund],
)
