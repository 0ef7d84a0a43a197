"""The agents of tests/test_rolling_deploy.py, as two deploys define them: the same names, tools
and settings, each deploy with its own system prompt (``deploy_old_app``, ``deploy_new_app``)."""

from __future__ import annotations

from toren import Agent, ToolContext, tool

MODEL = "anthropic/claude-sonnet-4-6"


@tool(effects="external", idempotency="keyed", approval="always")
async def ask(ctx: ToolContext) -> str:
    """Ask a human before going on."""
    return "asked"


def deploy(marker: str) -> tuple[Agent, Agent, Agent]:
    """The agents of one deploy: one per version policy, their prompts naming ``marker``."""
    system = f"You are the {marker} build."
    return (
        Agent(name="pinned", model=MODEL, system=system, tools=[ask]),
        Agent(name="convo", model=MODEL, system=system, version_policy="next_turn"),
        Agent(name="loose", model=MODEL, system=system, version_policy="upgrade"),
    )
