"""Agent and tool declarations: schemas from type hints, validation, approval rules, the check."""

from __future__ import annotations

import types
from typing import Any

import pydantic
import pytest

from toren import Agent, ConfigError, ToolContext, tool
from toren._agent.agents import agents_in, check, parse_duration


@tool(effects="external", idempotency="keyed", approval="never")
async def create_ticket(ctx: ToolContext, title: str, priority: int = 3) -> str:
    """Open a ticket in the tracker."""
    return f"T-{ctx.idempotency_key[:6]}:{title}:{priority}"


@tool(effects="external", approval=lambda args: args["amount"] > 100)
async def refund(ctx: ToolContext, amount: float) -> str:
    """Refund a customer."""
    return f"refunded {amount}"


@tool(effects="external")
async def send_email(ctx: ToolContext, to: str, body: str) -> str:
    """Send an email (no key, no approval: flagged)."""
    return "sent"


def test_a_tools_schema_comes_from_its_type_hints() -> None:
    assert create_ticket.name == "create_ticket"
    assert create_ticket.description == "Open a ticket in the tracker."
    schema = create_ticket.input_schema
    assert schema["required"] == ["title"]
    assert schema["properties"]["title"]["type"] == "string"
    assert schema["properties"]["priority"] == {
        "default": 3,
        "title": "Priority",
        "type": "integer",
    }
    assert schema["additionalProperties"] is False


def test_arguments_are_validated_against_the_signature() -> None:
    assert create_ticket.validate({"title": "x"}) == {"title": "x", "priority": 3}
    for bad in ({}, {"title": 5}, {"title": "x", "nope": 1}, {"title": "x", "priority": "high"}):
        with pytest.raises(pydantic.ValidationError):
            create_ticket.validate(bad)


def test_approval_rules() -> None:
    assert not create_ticket.needs_approval({"title": "x"})
    assert refund.needs_approval({"amount": 500})
    assert not refund.needs_approval({"amount": 5})


def test_check_flags_external_unkeyed_tools_that_ask_nobody() -> None:
    agent = Agent(name="support", model="anthropic/claude-sonnet-4-6",
                  tools=[create_ticket, refund, send_email])  # fmt: skip
    findings = {f.tool: f for f in check([agent])}
    assert [name for name, f in findings.items() if f.flagged] == ["send_email"]
    assert findings["refund"].approval == "per call"
    assert findings["create_ticket"].idempotency == "keyed"


def test_agents_are_found_in_an_app_module() -> None:
    module = types.ModuleType("app")
    module.a = Agent(name="a", model="openai/gpt-5")  # type: ignore[attr-defined]
    module.b = Agent(name="b", model="bedrock/anthropic.claude-sonnet-4-6", wall_clock="1h30m")  # type: ignore[attr-defined]
    found = agents_in(module)
    assert sorted(found) == ["a", "b"]
    assert found["b"].wall_clock == 5400.0


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"model": "claude"}, "provider prefix"),
        ({"model": "openai/x", "tools": [send_email, send_email]}, "duplicate tool"),
        ({"model": "openai/x", "wall_clock": "soon"}, "not a duration"),
        ({"model": "openai/x", "budget_usd": 0}, "budget_usd"),
    ],
)
def test_bad_agent_declarations_are_refused(kwargs: dict[str, Any], needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        Agent(name="bad", **kwargs)


def test_bad_tool_declarations_are_refused() -> None:
    def sync_tool(ctx: ToolContext) -> str:
        return ""

    async def no_ctx(x: int) -> str:
        return ""

    async def no_hint(ctx: ToolContext, x) -> str:  # type: ignore[no-untyped-def]
        return ""

    for fn, needle in ((sync_tool, "async"), (no_ctx, "ctx"), (no_hint, "type hint")):
        with pytest.raises(ConfigError, match=needle):
            tool(fn)
    with pytest.raises(ConfigError, match="effects"):
        tool(effects="dangerous")(no_hint)  # type: ignore[arg-type]


def test_durations() -> None:
    assert parse_duration("30m") == 1800.0
    assert parse_duration("45s") == 45.0
    assert parse_duration(12) == 12.0
    with pytest.raises(ConfigError):
        parse_duration("")
