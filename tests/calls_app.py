"""Agents that call each other, for the cross-agent call tests (the model is scripted by each
agent's system prompt: see tests/test_calls.py)."""

from __future__ import annotations

from toren import Agent, ToolContext, tool

MODEL = "anthropic/claude-sonnet-4-6"


@tool(effects="external", idempotency="keyed", approval="always")
async def publish(ctx: ToolContext, text: str) -> str:
    """Publish a text (a human approves each one)."""
    return f"published {text!r}"


desk = Agent(
    name="desk",
    model=MODEL,
    system="desk",
    calls=["researcher", "editor", "ghost", "gatekeeper", "remote_helper"],
)
researcher = Agent(
    name="researcher",
    model=MODEL,
    system="researcher: SECRET PROMPT",
    description="Finds facts about a topic; give it the topic.",
    accepts=["desk", "spender"],
)
editor = Agent(
    name="editor",
    model=MODEL,
    system="editor",
    description="Publishes a text after a human approves it.",
    accepts=["desk"],
    tools=[publish],
)
# accepts nobody: a call from desk is one-sided
gatekeeper = Agent(
    name="gatekeeper",
    model=MODEL,
    system="gatekeeper",
    description="Keeps the gate.",
    accepts=["someone_else"],
)
# a cycle: ping calls pong calls ping
ping = Agent(
    name="ping", model=MODEL, system="ping", description="Ping.", calls=["pong"], accepts=["pong"]
)
pong = Agent(
    name="pong", model=MODEL, system="pong", description="Pong.", calls=["ping"], accepts=["ping"]
)
# a chain deeper than the first link allows
chain0 = Agent(name="chain0", model=MODEL, system="chain0", calls=["chain1"])
chain1 = Agent(
    name="chain1",
    model=MODEL,
    system="chain1",
    description="The second link.",
    calls=["chain2"],
    accepts=["chain0"],
    max_call_depth=1,  # it is one deep already: it may not call further
)
chain2 = Agent(
    name="chain2", model=MODEL, system="chain2", description="The third.", accepts=["chain1"]
)
# a caller with a small budget and a callee that spends
spender = Agent(
    name="spender", model=MODEL, system="spender", calls=["researcher"], budget_usd=0.05
)
# a depth limit that binds the whole chain: da allows one call below it; db, called by da, would
# allow four of its own, but the chain da started may not go deeper than one
da = Agent(name="da", model=MODEL, system="da", calls=["db"], max_call_depth=1)
db = Agent(
    name="db", model=MODEL, system="db", description="The middle.", calls=["dc"], accepts=["da"]
)
dc = Agent(name="dc", model=MODEL, system="dc", description="The end.", accepts=["db"])
