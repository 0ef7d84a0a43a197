"""Agents and tools for the run fuzzer (tests/test_fuzz.py): every tool writes what it was given
into a module-level ledger, so that the fuzzer can check what ran, under which key, on which
decision and with which types.

The tools are driven by their arguments (which the scripted model chooses): ``lookup`` returns
hostile text, raises or hangs past its timeout as asked; ``typed`` takes a ``Decimal``, a
``datetime``, an ``Enum``, a ``UUID``, a ``tuple[int, int]`` and a nested pydantic model and
records whether each arrived with its declared type.
"""

from __future__ import annotations

import enum
import uuid
from collections.abc import Mapping
from datetime import datetime
from decimal import Decimal
from typing import Any

import anyio
import attrs
import pydantic

from toren import Agent, ToolContext, durable_sleep, tool

MODEL = "anthropic/claude-sonnet-4-6"
APPROVAL_FROM = 100
"""``guarded`` asks a human for amounts from this on."""


@attrs.frozen(kw_only=True)
class Effect:
    """One execution of a tool, as the tool saw it."""

    tool: str
    run_id: str
    call_id: str
    key: str
    arguments: dict[str, Any]
    types_ok: dict[str, bool] = attrs.field(factory=dict)


ledger: list[Effect] = []
"""Every execution of every tool of this app, in order (tools run in the test's process)."""


def effects_of(run_id: str, name: str | None = None) -> list[Effect]:
    """The executions recorded for ``run_id`` (of tool ``name``, if given)."""
    return [e for e in ledger if e.run_id == run_id and (name is None or e.tool == name)]


def _record(ctx: ToolContext, name: str, arguments: dict[str, Any], **types: bool) -> None:
    ledger.append(
        Effect(
            tool=name,
            run_id=ctx.run_id,
            call_id=ctx.tool_call_id,
            key=ctx.idempotency_key,
            arguments=arguments,
            types_ok=types,
        )
    )


@tool(effects="external", idempotency="keyed")
async def keyed_effect(ctx: ToolContext, note: str) -> str:
    """Write a note to an outside system that deduplicates by key."""
    _record(ctx, "keyed_effect", {"note": note})
    return f"noted {len(note)} characters"


def _over_limit(arguments: Mapping[str, Any]) -> bool:
    return bool(arguments["amount"] >= APPROVAL_FROM)


@tool(effects="external", idempotency="keyed", approval=_over_limit)
async def guarded(ctx: ToolContext, amount: int, note: str = "") -> str:
    """Pay out ``amount``; a human approves amounts of 100 and more."""
    _record(ctx, "guarded", {"amount": amount, "note": note}, amount=type(amount) is int)
    return f"paid {amount}"


@tool(effects="read", timeout=0.3)
async def lookup(ctx: ToolContext, mode: str, text: str = "", repeat: int = 1) -> Any:
    """Look something up: ``echo`` returns ``text`` ``repeat`` times, ``raise`` fails with it,
    ``hang`` outlasts the timeout, ``object`` returns a structure holding it."""
    _record(ctx, "lookup", {"mode": mode, "repeat": repeat})
    if mode == "raise":
        raise RuntimeError(text)
    if mode == "hang":
        await anyio.sleep(5)
    if mode == "object":
        return {"text": text, "big": 2**80, "nan": float("nan"), "inf": float("-inf")}
    return text * max(0, min(repeat, 5_000_000))


class Color(enum.Enum):
    RED = "red"
    GREEN = "green"


class Inner(pydantic.BaseModel):
    at: datetime
    weights: tuple[Decimal, ...] = ()


class Item(pydantic.BaseModel):
    name: str
    inner: Inner


@tool(effects="read")
async def typed(
    ctx: ToolContext,
    amount: Decimal,
    when: datetime,
    color: Color,
    ident: uuid.UUID,
    pair: tuple[int, int],
    item: Item,
) -> str:
    """Store a typed record."""
    _record(
        ctx,
        "typed",
        {},
        amount=type(amount) is Decimal,
        when=type(when) is datetime,
        color=type(color) is Color,
        ident=type(ident) is uuid.UUID,
        pair=type(pair) is tuple and all(type(v) is int for v in pair),
        item=type(item) is Item,
        inner=type(getattr(item, "inner", None)) is Inner,
        at=type(getattr(getattr(item, "inner", None), "at", None)) is datetime,
        weights=all(
            type(w) is Decimal for w in getattr(getattr(item, "inner", None), "weights", ())
        ),
    )
    return f"stored {amount} {color}"


TOOLS = (keyed_effect, guarded, lookup, typed, durable_sleep)

fuzz = Agent(name="fuzz", model=MODEL, tools=TOOLS, max_attempts=3, wall_clock=60)
"""Toren's default caps (4 MiB responses, 256 KiB tool results)."""

fuzz_small = Agent(
    name="fuzz_small",
    model=MODEL,
    tools=TOOLS,
    max_attempts=1,
    wall_clock=60,
    max_tool_result_bytes=1024,
    max_response_bytes=4096,
)
"""The smallest caps Toren takes, so that cutting is exercised without megabytes; and one
model turn whose tool calls all fail fails the run."""
