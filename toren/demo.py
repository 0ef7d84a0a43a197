"""The demo app ``toren dev`` runs when no ``--app`` is given.

``concierge`` is an agent with a read tool and an external, keyed tool that asks for approval
above $50. Without a provider key it talks to the **offline demo model**: a local server that
speaks the Anthropic Messages API and answers from a script (clearly labelled in what it says),
so the whole loop (model calls, tool intents and results, an approval that parks the run, the
cost receipt) runs on a machine with no network.
"""

from __future__ import annotations

import json
import re
from typing import Any

from toren import Agent, ToolContext, tool
from toren.testing import (
    ModelRequest,
    Reply,
    Text,
    ToolCall,
    ToolResult,
    Usage,
    latest_results,
    latest_text,
    turns,
)

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
    """The offline demo model (a model script, see :mod:`toren.testing`): it reads the
    conversation as an agent would, one tool call at a time.

    A task (or a later message) naming an order has the order looked up; a found order, its
    refund asked for; a refund's result is answered as it went: done, or why not (a denial's
    reason, which a later message may answer: the refund is then asked for again). A message
    once the refund is issued is answered about that refund.
    """
    answered = turns(request)
    usage = Usage(input_tokens=400 + 150 * answered, output_tokens=60)
    call_id = f"demo-{answered + 1}"  # each call an id of its own
    results = latest_results(request)
    if results:
        return _after(_calls(request).get(results[-1].tool_call_id), results[-1], call_id, usage)
    named = _ORDER_ID.search(latest_text(request))
    refund = _last_refund(request)
    if refund is not None:
        call, result = refund
        args = call.arguments or {}
        order, amount = args.get("order_id"), args.get("amount")
        if named is None or named[0] == order:  # a message about the refund, not a new order
            if not result.is_error:
                return _say(
                    f"Your ${amount} refund for order {order} was issued already; banks "
                    "usually show a refund within a few days.",
                    usage,
                )
            return Reply(
                [
                    Text(text=f"{LABEL} Thank you; I will ask again to refund the ${amount}."),
                    ToolCall(id=call_id, name="issue_refund", arguments=args),
                ],
                usage=usage,
            )
    if named is None:
        return _say("Which order is it? Tell me its id (such as A-17).", usage)
    return Reply(
        [
            Text(text=f"{LABEL} Let me look at order {named[0]} first."),
            ToolCall(id=call_id, name="lookup_order", arguments={"order_id": named[0]}),
        ],
        usage=usage,
    )


_ORDER_ID = re.compile(r"\b[A-Z]-\d+\b")


def _after(call: ToolCall | None, result: ToolResult, call_id: str, usage: Usage) -> Reply:
    """The answer to ``call``'s result."""
    if call is None:  # a result without its call: not a conversation this demo made
        return _say("I lost track of this conversation; please start a new run.", usage)
    args = call.arguments or {}
    order = args.get("order_id")
    if call.name == "lookup_order":
        if result.is_error:
            return _say(f"I could not find order {order}: {result.content}.", usage)
        found = json.loads(result.content)
        paid = found["paid"]
        amount = int(paid) if float(paid).is_integer() else paid
        return Reply(
            [
                Text(text=f"{LABEL} It {found['status']}; I will refund the ${amount} paid."),
                ToolCall(
                    id=call_id,
                    name="issue_refund",
                    arguments={"order_id": order, "amount": amount},
                ),
            ],
            usage=usage,
        )
    amount = args.get("amount")
    if result.content.startswith("denied by "):
        return _say(
            f"I have not refunded order {order}: the refund was {result.content}. Write back "
            "and I will ask again.",
            usage,
        )
    if result.is_error:
        return _say(f"The refund of order {order} failed: {result.content}.", usage)
    return _say(f"Done: your ${amount} refund for order {order} is on its way.", usage)


def _say(text: str, usage: Usage) -> Reply:
    return Reply(f"{LABEL} {text}", usage=usage)


def _calls(request: ModelRequest) -> dict[str, ToolCall]:
    """The tool calls the model made in this conversation, by id."""
    return {
        block.id: block
        for message in request.messages
        for block in message.content
        if isinstance(block, ToolCall)
    }


def _last_refund(request: ModelRequest) -> tuple[ToolCall, ToolResult] | None:
    """The latest refund asked for in this conversation and its result, if it has one."""
    calls = _calls(request)
    found = None
    for message in request.messages:
        for block in message.content:
            if isinstance(block, ToolResult):
                call = calls.get(block.tool_call_id)
                if call is not None and call.name == "issue_refund":
                    found = (call, block)
    return found
