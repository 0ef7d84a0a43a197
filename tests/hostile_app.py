"""Agents and tools for the hostile-data and failure tests (tests/test_hostile.py).

Every tool records what it did in ``ledger`` (in this process), so a test can count effects and
see the exact values a tool received.
"""

from __future__ import annotations

import enum
import os
import uuid
from datetime import datetime
from decimal import Decimal
from pathlib import Path
from typing import Any

import anyio
import pydantic

from toren import Agent, ToolContext, durable_sleep, tool

ledger: list[dict[str, Any]] = []
predicate_broken = False  # the approval predicate of `guarded` raises while this is set


def _record(ctx: ToolContext, tool_name: str, **values: Any) -> None:
    ledger.append(
        {
            "tool": tool_name,
            "call_id": ctx.tool_call_id,
            "key": ctx.idempotency_key,
            "fencing_token": ctx.fencing_token,
            **values,
        }
    )


@tool(effects="external", idempotency="keyed", approval="always")
async def pay(ctx: ToolContext, to: str, amount: float) -> str:
    """Pay someone (a person approves every payment)."""
    _record(ctx, "pay", to=to, amount=amount)
    return f"paid {amount:g} to {to}"


@tool(effects="external", idempotency="unkeyed")
async def hostile_result(ctx: ToolContext, x: str) -> str:
    """An external, unkeyed effect whose result holds what jsonb refuses."""
    _record(ctx, "hostile_result", x=x)
    return "a\x00b\ud800c"


@tool(effects="read")
async def big_result(ctx: ToolContext, size: int) -> str:
    """A result of `size` bytes."""
    _record(ctx, "big_result", size=size)
    return "y" * size


class Color(enum.Enum):
    RED = "red"
    BLUE = "blue"


class Inner(pydantic.BaseModel):
    name: str
    tags: tuple[str, ...]


@tool(effects="external", idempotency="keyed")
async def book(
    ctx: ToolContext,
    when: datetime,
    amount: Decimal,
    color: Color,
    ident: uuid.UUID,
    pair: tuple[int, int],
    inner: Inner,
) -> str:
    """Book something, with typed arguments."""
    _record(
        ctx,
        "book",
        types={
            "when": type(when).__name__,
            "amount": type(amount).__name__,
            "color": type(color).__name__,
            "ident": type(ident).__name__,
            "pair": type(pair).__name__,
            "inner": type(inner).__name__,
        },
        amount=amount,
        when=when,
    )
    return f"booked {amount} on {when.isoformat()}"


def _guard(arguments: Any) -> bool:
    if predicate_broken:
        raise RuntimeError("the approval policy service is down")
    return False


@tool(effects="external", idempotency="keyed", approval=_guard)
async def guarded(ctx: ToolContext, what: str) -> str:
    """An effect behind an approval predicate (which can break)."""
    _record(ctx, "guarded", what=what)
    return f"did {what}"


@tool(effects="external", idempotency="keyed", timeout=120)
async def careful(ctx: ToolContext, what: str) -> str:
    """Waits (a slow upstream), then checks its lease right before its effect."""
    marker = Path(os.environ["TOREN_TEST_LEDGER"])
    with marker.with_suffix(f".started.{os.getpid()}").open("a") as f:
        f.write(f"{ctx.fencing_token}\n")
    await anyio.sleep(float(os.environ.get("TOREN_TEST_CAREFUL_WAIT", "3")))
    ctx.ensure_lease()
    with marker.open("a") as f:
        f.write(f"{os.getpid()} {ctx.fencing_token} {ctx.idempotency_key} {what}\n")
    return f"did {what}"


MODEL = "anthropic/claude-sonnet-4-6"

payer = Agent(name="payer", model=MODEL, tools=[pay])
hostile = Agent(name="hostile", model=MODEL, tools=[hostile_result, durable_sleep])
capped = Agent(
    name="capped",
    model=MODEL,
    tools=[big_result],
    max_tool_result_bytes=4096,
    max_response_bytes=64 * 1024,
)
booker = Agent(name="booker", model=MODEL, tools=[book, pay])
policy = Agent(
    name="policy",
    model=MODEL,
    tools=[guarded],
    description="Does a guarded thing.",
    accepts=["policy_caller"],
)
# a caller of policy: a child run it waits on can fail by a dead letter
policy_caller = Agent(name="policy_caller", model=MODEL, calls=["policy"])
confused = Agent(name="confused", model=MODEL, tools=[big_result], max_attempts=3)
zombie = Agent(name="zombie", model=MODEL, tools=[careful])


policy_says_ask = True  # the approval predicate of `transfer` (a policy that can change)


@tool(effects="external", idempotency="keyed", approval=lambda args: policy_says_ask)
async def transfer(ctx: ToolContext, to: str, amount: float) -> str:
    """Transfer money (a policy decides whether a person approves it)."""
    _record(ctx, "transfer", to=to, amount=amount)
    return f"transferred {amount:g} to {to}"


class Hostile:
    def __str__(self) -> str:
        raise RuntimeError("no")

    __repr__ = __str__


@tool(effects="external", idempotency="unkeyed")
async def misbehave(ctx: ToolContext, how: str) -> Any:
    """Leaks a cancellation, or returns what cannot be shown."""
    _record(ctx, "misbehave", how=how)
    if how == "cancel":
        raise anyio.get_cancelled_exc_class()("leaked")
    return {"obj": Hostile()}


banker = Agent(name="banker", model=MODEL, tools=[transfer])
misfit = Agent(name="misfit", model=MODEL, tools=[misbehave])
