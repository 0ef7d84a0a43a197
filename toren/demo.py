"""The demo app ``toren dev`` runs when no ``--app`` is given.

``concierge`` is an agent with a read tool and an external, keyed tool that asks for approval
above $50. Without a provider key it talks to the **offline demo model**: a local server that
speaks the Anthropic Messages API and answers from a script (clearly labelled in what it says),
so the whole loop (model calls, tool intents and results, an approval that parks the run, the
cost receipt) runs on a machine with no network.
"""

from __future__ import annotations

from typing import Any

from toren import Agent, ToolContext, tool
from toren.testing import ModelRequest, Reply, Text, ToolCall, Usage, turns

LABEL = "[Toren offline demo model]"

ORDERS = {"A-17": {"item": "espresso machine", "paid": 80.0, "status": "arrived broken"}}


@tool(effects="read")
async def lookup_order(ctx: ToolContext, order_id: str) -> dict[str, Any]:
    """Look an order up by its id."""
    order = ORDERS.get(order_id)
    if order is None:
        raise LookupError(f"no order {order_id}")
    return order


@tool(effects="external", idempotency="keyed", approval=lambda args: args["amount"] > 50)
async def issue_refund(ctx: ToolContext, order_id: str, amount: float) -> str:
    """Refund an order (a real system would receive ctx.idempotency_key and deduplicate)."""
    return f"refund {ctx.idempotency_key[:8]} of ${amount:.2f} issued for {order_id}"


concierge = Agent(
    name="concierge",
    model="anthropic/claude-sonnet-4-6",
    system="You are a customer-service agent. Look orders up before refunding them.",
    tools=[lookup_order, issue_refund],
    budget_usd=1.0,
)

DEMO_INPUT = "My espresso machine from order A-17 arrived broken. Can I get my money back?"


def demo_model(request: ModelRequest) -> Reply:
    """The offline demo model (a model script, see :mod:`toren.testing`): answers by how far
    the conversation has got."""
    answered = turns(request)
    usage = Usage(input_tokens=400 + 150 * answered, output_tokens=60)
    if answered == 0:
        return Reply(
            [
                Text(text=f"{LABEL} Let me look at order A-17 first."),
                ToolCall(id="demo-1", name="lookup_order", arguments={"order_id": "A-17"}),
            ],
            usage=usage,
        )
    if answered == 1:
        return Reply(
            [
                Text(text=f"{LABEL} It arrived broken; I will refund the $80 paid."),
                ToolCall(
                    id="demo-2", name="issue_refund", arguments={"order_id": "A-17", "amount": 80}
                ),
            ],
            usage=usage,
        )
    return Reply(f"{LABEL} Done: your $80 refund for order A-17 is on its way.", usage=usage)
