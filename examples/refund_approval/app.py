"""``refund_desk``: looks an order up, then refunds it; a refund over $100 waits for a human.

Run it offline (from the repository's root)::

    toren dev --app examples.refund_approval.app \\
        --model-script examples.refund_approval.model:script
"""

from __future__ import annotations

from typing import Any

from toren import Agent, ToolContext, tool

THRESHOLD = 100.0

ORDERS: dict[str, dict[str, Any]] = {
    "A-17": {"item": "espresso machine", "paid": 120.0, "status": "arrived broken"},
    "B-2": {"item": "milk jug", "paid": 30.0, "status": "arrived dented"},
}
ISSUED: list[str] = []  # what a payment system would have refunded (read by the test)


@tool(effects="read")
async def lookup_order(ctx: ToolContext, order_id: str) -> dict[str, Any]:
    """Look an order up by its id: the item, what was paid and its status."""
    order = ORDERS.get(order_id)
    if order is None:
        raise LookupError(f"no order {order_id}")
    return order


@tool(effects="external", idempotency="keyed", approval=lambda args: args["amount"] > THRESHOLD)
async def issue_refund(ctx: ToolContext, order_id: str, amount: float) -> str:
    """Refund an order. A real payment API would get ``ctx.idempotency_key`` and refund once
    per key, so a crash between the refund and its record never refunds twice."""
    ISSUED.append(ctx.idempotency_key)
    return f"refund of ${amount:.2f} issued for {order_id}"


refund_desk = Agent(
    name="refund_desk",
    model="anthropic/claude-sonnet-4-6",
    system="You are a support agent. Look an order up before refunding it.",
    tools=[lookup_order, issue_refund],
    budget_usd=1.0,
)
