"""An agent's version (:func:`toren.agent_version`): what changes it, what does not, that it is
the same in every process; the routes a worker serves for it; the version policy's settings."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import attrs
import pytest

from tests.conftest import ROOT
from toren import Agent, ConfigError, Retention, Settings, ToolContext, tool
from toren._agent.registry import Agents
from toren._agent.routes import agent_route, route_version, version_route
from toren._agent.version import agent_version, version_document
from toren.channels import Telegram
from toren.sandboxes import Sandbox
from toren.schedules import Schedule

MODEL = "anthropic/claude-sonnet-4-6"


@tool(effects="read")
async def lookup(ctx: ToolContext, order: str) -> str:
    """Look an order up."""
    return order


def needs_approval(arguments: Mapping[str, Any]) -> bool:
    return bool(arguments)


def another_predicate(arguments: Mapping[str, Any]) -> bool:
    return not arguments


BASE = Agent(
    name="support",
    model=MODEL,
    system="Be brief.",
    tools=[lookup],
    description="Answers support questions.",
    accepts=["triage"],
)


def with_tool(**declared: Any) -> Agent:
    return attrs.evolve(BASE, tools=[attrs.evolve(lookup, **declared)])


# Each input of the version, changed one at a time: each change makes a new version.
CHANGES: dict[str, Callable[[], Agent]] = {
    "model": lambda: attrs.evolve(BASE, model="anthropic/claude-opus-4-1"),
    "system": lambda: attrs.evolve(BASE, system="Be very brief."),
    "max_tokens": lambda: attrs.evolve(BASE, max_tokens=1000),
    "tool name": lambda: with_tool(name="find"),
    "tool description": lambda: with_tool(description="Find an order."),
    "tool schema": lambda: attrs.evolve(BASE, tools=[tool(effects="read")(_lookup_by_id)]),
    "tool effects": lambda: with_tool(effects="write"),
    "tool idempotency": lambda: with_tool(idempotency="keyed"),
    "tool approval": lambda: with_tool(approval="always"),
    "tool approval predicate": lambda: with_tool(approval=needs_approval),
    "tool timeout": lambda: with_tool(timeout=5.0),
    "calls": lambda: attrs.evolve(BASE, calls=["billing"]),
    "accepts": lambda: attrs.evolve(BASE, accepts=["triage", "sales"]),
    "description": lambda: attrs.evolve(BASE, description="Answers questions."),
    "max_call_depth": lambda: attrs.evolve(BASE, max_call_depth=2),
    "sandbox": lambda: attrs.evolve(BASE, sandbox=Sandbox()),
    "context_window": lambda: attrs.evolve(BASE, context_window=100_000),
    "compact_soft": lambda: attrs.evolve(BASE, compact_soft=0.4),
    "compact_hard": lambda: attrs.evolve(BASE, compact_hard=0.8),
    "max_tool_result_bytes": lambda: attrs.evolve(BASE, max_tool_result_bytes=4096),
    "max_response_bytes": lambda: attrs.evolve(BASE, max_response_bytes=4096),
}

SANDBOXED = attrs.evolve(BASE, sandbox=Sandbox())
SANDBOX_CHANGES: dict[str, Sandbox] = {
    "image": Sandbox(image="local/other:1"),
    "allow rules": Sandbox(allow=("ls *",)),
    "network": Sandbox(network="host"),
    "memory": Sandbox(memory="1GiB"),
    "cpus": Sandbox(cpus=2),
    "pids": Sandbox(pids=64),
    "command_timeout": Sandbox(command_timeout="10m"),
    "rerunnable": Sandbox(rerunnable=True),
}

# What a run's requests do not depend on: the same version.
SAME: dict[str, Callable[[], Agent]] = {
    "budget_usd": lambda: attrs.evolve(BASE, budget_usd=2.5),
    "wall_clock": lambda: attrs.evolve(BASE, wall_clock="2h"),
    "max_attempts": lambda: attrs.evolve(BASE, max_attempts=9),
    "max_runs": lambda: attrs.evolve(BASE, max_runs=3, max_runs_per_key=2),
    "telegram": lambda: attrs.evolve(BASE, telegram=Telegram(bot="helpdesk")),
    "schedules": lambda: attrs.evolve(BASE, schedules=[Schedule(name="n", cron="@hourly")]),
    "version_policy": lambda: attrs.evolve(BASE, version_policy="next_turn"),
    "retention": lambda: attrs.evolve(
        BASE, retention=Retention(keep_for="30d", keep_last=10, archive=True)
    ),
    "the same predicate again": lambda: with_tool(approval=needs_approval),
    "sandbox idle_stop": lambda: attrs.evolve(BASE, sandbox=Sandbox(idle_stop="1h")),
}


async def _lookup_by_id(ctx: ToolContext, order_id: int) -> str:
    """Look an order up."""
    return str(order_id)


_lookup_by_id.__name__ = "lookup"


def test_a_version_is_twelve_lowercase_hex_characters() -> None:
    version = agent_version(BASE)
    assert len(version) == 12
    assert version == version.lower()
    int(version, 16)


@pytest.mark.parametrize("what", CHANGES)
def test_each_input_changes_the_version(what: str) -> None:
    changed = CHANGES[what]()
    assert version_document(changed) != version_document(BASE)
    assert agent_version(changed) != agent_version(BASE)


@pytest.mark.parametrize("what", SANDBOX_CHANGES)
def test_each_sandbox_setting_that_decides_the_container_changes_the_version(what: str) -> None:
    changed = attrs.evolve(SANDBOXED, sandbox=SANDBOX_CHANGES[what])
    assert agent_version(changed) != agent_version(SANDBOXED)


def test_two_predicates_are_two_versions() -> None:
    one = agent_version(with_tool(approval=needs_approval))
    assert one != agent_version(with_tool(approval=another_predicate))


@pytest.mark.parametrize("what", ["sandbox idle_stop"])
def test_a_sandbox_lifecycle_setting_keeps_the_version(what: str) -> None:
    assert agent_version(SAME[what]()) == agent_version(SANDBOXED)


@pytest.mark.parametrize("what", [w for w in SAME if w != "sandbox idle_stop"])
def test_limits_budgets_channels_and_schedules_keep_the_version(what: str) -> None:
    base = BASE if what != "the same predicate again" else with_tool(approval=needs_approval)
    assert agent_version(SAME[what]()) == agent_version(base)


def test_a_log_level_keeps_the_version() -> None:
    before = agent_version(BASE)
    import logging

    logger = logging.getLogger("toren")
    level = logger.level
    logger.setLevel(logging.DEBUG)
    try:
        assert agent_version(BASE) == before
    finally:
        logger.setLevel(level)


def test_a_version_is_the_same_in_another_process() -> None:
    # Another interpreter (another hash seed, other ids): the same agent, the same version.
    script = textwrap.dedent(
        """
        from tests.test_versions import BASE, needs_approval, with_tool
        from toren._agent.version import agent_version
        print(agent_version(BASE), agent_version(with_tool(approval=needs_approval)))
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
        env={"PYTHONHASHSEED": "12345", "PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)},
    )
    here = f"{agent_version(BASE)} {agent_version(with_tool(approval=needs_approval))}"
    assert out.stdout.split() == here.split()


def test_a_worker_serves_the_agent_and_its_version() -> None:
    agents = Agents()
    agents.register([BASE])
    version = agent_version(BASE)
    assert agents.served_routes() == [agent_route("support"), f"agent:support@{version}"]
    assert agents.version("support") == version
    assert version_route("support", version) == f"agent:support@{version}"
    assert route_version(f"agent:support@{version}") == ("support", version)
    assert route_version("agent:support") == ("support", None)
    with pytest.raises(ValueError, match="not an agent's route"):
        route_version("sandbox")


def test_the_policy_defaults_to_pin_and_to_the_workers_default() -> None:
    agents = Agents()
    assert agents.version_policy(BASE) == "pin"
    agents.default_version_policy = "upgrade"
    assert agents.version_policy(BASE) == "upgrade"
    assert agents.version_policy(attrs.evolve(BASE, version_policy="next_turn")) == "next_turn"


def test_an_unknown_policy_is_refused() -> None:
    with pytest.raises(ConfigError, match="version_policy must be pin, upgrade or next_turn"):
        Agent(name="a", model=MODEL, version_policy="sometimes")  # type: ignore[arg-type]


def test_the_policy_is_read_from_the_agents_table(tmp_path: Path) -> None:
    config = tmp_path / "toren.toml"
    config.write_text(
        'default_version_policy = "next_turn"\n[agents.support]\nversion_policy = "upgrade"\n'
    )
    settings = Settings.load(config_file=config, env={})
    assert settings.default_version_policy == "next_turn"
    agents = Agents()
    (registered,) = agents.register([BASE], settings.agents)
    assert registered.version_policy == "upgrade"
    assert agent_version(registered) == agent_version(BASE)
    config.write_text('[agents.support]\nversion_policy = "never"\n')
    with pytest.raises(ConfigError, match=r"version_policy .* must be one of pin, upgrade"):
        Settings.load(config_file=config, env={})
    config.write_text('default_version_policy = "never"\n')
    with pytest.raises(ConfigError, match="default_version_policy must be"):
        Settings.load(config_file=config, env={})
