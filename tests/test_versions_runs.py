"""Runs and versions on in-process workers: a run started before versions is pinned at its next
activation; ``retry(upgrade=True)`` moves a failed run to the version with the fix; what
``upgrade_run`` refuses, with nothing changed."""

from __future__ import annotations

import json
from typing import Any

import anyio
import attrs
import pytest

from tests.conftest import person, running_worker, wait_for
from toren import Agent, Client, ToolContext, durable_sleep, tool
from toren.runs import (
    Agents,
    RunNotInState,
    VersionNotServed,
    agent_version,
    read_run,
    retry,
    say,
    start_run,
    upgrade_run,
    version_route,
    waiting_on,
)
from toren.testing import AnthropicServer, Reply, ToolCall

pytestmark = pytest.mark.anyio

MODEL = "anthropic/claude-sonnet-4-6"


@tool(effects="read")
async def lookup(ctx: ToolContext) -> str:
    """Look it up."""
    raise RuntimeError("the lookup is broken")


@tool(effects="read", description="Look it up (fixed).")
async def fixed_lookup(ctx: ToolContext) -> str:
    return "found"


@tool(effects="external", approval="always")
async def ask(ctx: ToolContext) -> str:
    """Ask first."""
    return "asked"


fixed_lookup = attrs.evolve(fixed_lookup, name="lookup")


def agents(*defined: Agent) -> Agents:
    registry = Agents()
    registry.register(defined)
    return registry


BROKEN = Agent(name="helper", model=MODEL, tools=[lookup, ask], max_attempts=1)
FIXED = Agent(name="helper", model=MODEL, tools=[fixed_lookup, ask], max_attempts=1)


def answer(body: dict[str, Any], n: int) -> Reply:
    """Look up on ``look``, ask on ``park``, else say what the last tool said."""
    last = body["messages"][-1]["content"]
    if isinstance(last, list) and any(b.get("type") == "tool_result" for b in last):
        return Reply("result: " + json.dumps(last[-1].get("content")))
    text = last if isinstance(last, str) else " ".join(b.get("text", "") for b in last)
    if "park" in text:
        return Reply([ToolCall(id=f"a{n}", name="ask", arguments={})])
    if "look" in text:
        return Reply([ToolCall(id=f"l{n}", name="lookup", arguments={})])
    return Reply(f"heard {text}")


async def published(client: Client, version: str) -> bool:
    rows = await client.pool.fetch("SELECT stats FROM toren.workers")
    return any(
        ((r["stats"] or {}).get("agents", {}).get("helper") or {}).get("version") == version
        for r in rows
    )


async def status(client: Client, run_id: str) -> str:
    return (await read_run(client, run_id)).status


async def unowned(client: Client, run_id: str) -> bool:
    return (await client.actor(run_id))["owner"] is None


@pytest.fixture
async def model(monkeypatch: pytest.MonkeyPatch) -> Any:
    async with AnthropicServer(answer) as server:
        for name, value in server.env().items():
            monkeypatch.setenv(name, value)
        yield server


async def test_a_run_started_before_versions_is_pinned_at_its_next_activation(
    client: Client, db_url: str, model: AnthropicServer
) -> None:
    async with running_worker(db_url, agents=agents(FIXED)):
        run_id = await start_run(client, "helper", "hello")
        await wait_for(lambda: _completed(client, run_id), what="turn 1")
        await wait_for(lambda: unowned(client, run_id), what="passivated")
        # As an earlier release left it: no version recorded, the run on its agent's route.
        await client.pool.execute(
            "UPDATE toren.journal SET data = data - 'version' "
            "WHERE actor_id = $1 AND type = 'run.started'",
            run_id,
        )
        await client.pool.execute(
            "UPDATE toren.actors SET route = 'agent:helper', summary = summary - 'version' "
            "WHERE actor_id = $1",
            run_id,
        )
        assert (await read_run(client, run_id)).version == ""
        await say(client, run_id, "again", by=person("ann"))
        await wait_for(lambda: _said(client, run_id, "heard again"), what="turn 2")
    journal = await client.journal(run_id)
    [move] = [e.data for e in journal if e.type == "run.upgraded"]
    version = agent_version(FIXED)
    assert (move["from_version"], move["to_version"], move["how"]) == ("", version, "replay")
    assert "steps.invalidated" not in [e.type for e in journal]  # the same code: nothing differs
    assert (await client.actor(run_id))["route"] == version_route("helper", version)
    assert len(model.received) == 2


async def _completed(client: Client, run_id: str) -> bool:
    return await status(client, run_id) == "completed"


async def _said(client: Client, run_id: str, output: str) -> bool:
    state = await read_run(client, run_id)
    return state.status == "completed" and state.output == output


async def test_a_failed_run_is_retried_on_the_version_with_the_fix(
    client: Client, db_url: str, model: AnthropicServer
) -> None:
    async with running_worker(db_url, agents=agents(BROKEN)):
        run_id = await start_run(client, "helper", "look it up")
        await wait_for(lambda: _failed(client, run_id), what="failed on the broken tool")
    async with running_worker(db_url, agents=agents(FIXED)):
        await wait_for(lambda: published(client, agent_version(FIXED)), what="the fix is up")
        # Plainly retried, the run waits for its own version: no worker serves it now.
        route = (await client.actor(run_id))["route"]
        assert route == version_route("helper", agent_version(BROKEN))
        await retry(client, run_id, by=person("ops"), upgrade=True)
        await wait_for(lambda: _said(client, run_id, 'result: "found"'), what="done on the fix")
    journal = await client.journal(run_id)
    [move] = [e.data for e in journal if e.type == "run.upgraded"]
    assert (move["to_version"], move["how"], move["by"]["name"]) == (
        agent_version(FIXED),
        "replay",
        "ops",
    )
    # The tool's description is in every request: re-asked from step 1.
    assert [e.data["from_step"] for e in journal if e.type == "steps.invalidated"] == [1]


async def _failed(client: Client, run_id: str) -> bool:
    return await status(client, run_id) == "failed"


async def test_upgrade_refuses_a_run_on_the_newest_version_or_one_nobody_serves(
    client: Client, db_url: str, model: AnthropicServer
) -> None:
    async with running_worker(db_url, agents=agents(FIXED)):
        await wait_for(lambda: published(client, agent_version(FIXED)), what="worker up")
        run_id = await start_run(client, "helper", "park here")
        await wait_for(lambda: _waiting(client, run_id), what="parked on an approval")
        with pytest.raises(RunNotInState, match="already on version"):
            await upgrade_run(client, run_id)
    before = await client.actor(run_id)
    with pytest.raises(VersionNotServed, match="no live worker runs agent 'helper'"):
        await upgrade_run(client, run_id)
    after = await client.actor(run_id)
    assert (after["route"], after["args"]) == (before["route"], before["args"])
    assert (
        await client.pool.fetchval("SELECT count(*) FROM toren.mailbox WHERE actor_id = $1", run_id)
        == 0
    )


async def _waiting(client: Client, run_id: str) -> bool:
    return bool(waiting_on(await read_run(client, run_id)))


async def test_a_conversation_waiting_on_a_gone_version_is_upgraded_once_a_message_waits(
    client: Client, db_url: str, model: AnthropicServer
) -> None:
    async with running_worker(db_url, agents=agents(FIXED)):
        run_id = await start_run(client, "helper", "hello")
        await wait_for(lambda: _completed(client, run_id), what="turn 1")
    renewed = attrs.evolve(FIXED, system="Be kind.")
    async with running_worker(db_url, agents=agents(renewed)):
        await wait_for(lambda: published(client, agent_version(renewed)), what="new worker")
        with pytest.raises(RunNotInState, match="has completed"):
            await upgrade_run(client, run_id)  # a completed run, nothing waiting: done
        await say(client, run_id, "again", by=person("ann"))
        assert await upgrade_run(client, run_id) == agent_version(renewed)
        await wait_for(lambda: _answered(client, run_id, "again"), what="turn 2, moved")
    [move] = [e.data for e in await client.journal(run_id) if e.type == "run.upgraded"]
    assert (move["from_version"], move["to_version"]) == (
        agent_version(FIXED),
        agent_version(renewed),
    )


async def _answered(client: Client, run_id: str, text: str) -> bool:
    state = await read_run(client, run_id)
    return state.status == "completed" and state.output.endswith(text)


def slow_agent(system: str, gate: anyio.Event) -> Agent:
    @tool(effects="read", name="slow")
    async def slow(ctx: ToolContext) -> str:
        """Take a while."""
        await gate.wait()
        return "slept"

    return Agent(name="slowpoke", model=MODEL, system=system, tools=[slow])


def slow_answer(body: dict[str, Any], n: int) -> Reply:
    last = body["messages"][-1]["content"]
    if isinstance(last, list) and any(b.get("type") == "tool_result" for b in last):
        return Reply("done " + str(body.get("system")))
    return Reply([ToolCall(id=f"s{n}", name="slow", arguments={})])


async def test_an_upgrade_sent_while_an_old_worker_holds_the_run_is_handed_to_the_new(
    client: Client, db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    gate = anyio.Event()
    old, new = slow_agent("old", gate), slow_agent("new", gate)
    async with AnthropicServer(slow_answer) as server:
        for name, value in server.env().items():
            monkeypatch.setenv(name, value)
        async with running_worker(db_url, agents=agents(old)):
            run_id = await start_run(client, "slowpoke", "go")
            await wait_for(lambda: _received(server, 1), what="the tool call asked for")
            async with running_worker(db_url, agents=agents(new)):
                await wait_for(lambda: _published(client, "slowpoke", new), what="new worker")
                # The old worker is inside the tool's step, holding the run.
                assert await upgrade_run(client, run_id, by=person("ops")) == agent_version(new)
                gate.set()
                await wait_for(lambda: _said(client, run_id, "done new"), what="done on new")
    journal = await client.journal(run_id)
    [move] = [e.data for e in journal if e.type == "run.upgraded"]
    assert (move["from_version"], move["to_version"], move["by"]["name"]) == (
        agent_version(old),
        agent_version(new),
        "ops",
    )
    # The tool's step committed on the old worker; the new one re-checked and re-asked step 1.
    assert [e.data["from_step"] for e in journal if e.type == "steps.invalidated"] == [1]


async def _received(server: AnthropicServer, count: int) -> bool:
    return len(server.received) >= count


async def _published(client: Client, name: str, agent: Agent) -> bool:
    rows = await client.pool.fetch("SELECT stats FROM toren.workers")
    version = agent_version(agent)
    return any(
        ((r["stats"] or {}).get("agents", {}).get(name) or {}).get("version") == version
        for r in rows
    )


def sleep_answer(body: dict[str, Any], n: int) -> Reply:
    last = body["messages"][-1]["content"]
    if isinstance(last, list) and any(b.get("type") == "tool_result" for b in last):
        return Reply("woke " + str(body.get("system")))
    return Reply([ToolCall(id=f"z{n}", name="sleep", arguments={"seconds": 1.5})])


async def test_a_next_turn_run_moves_when_its_timer_fires_and_pays_nothing_again(
    client: Client, db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    def sleeper(system: str) -> Agent:
        return Agent(
            name="sleeper",
            model=MODEL,
            system=system,
            tools=[durable_sleep],
            version_policy="next_turn",
        )

    old, new = sleeper("old"), sleeper("new")
    async with AnthropicServer(sleep_answer) as server:
        for name, value in server.env().items():
            monkeypatch.setenv(name, value)
        async with running_worker(db_url, agents=agents(old)):
            run_id = await start_run(client, "sleeper", "nap")
            await wait_for(lambda: _received(server, 1), what="asked to sleep")
            async with running_worker(db_url, agents=agents(new)):
                await wait_for(lambda: _published(client, "sleeper", new), what="new worker")
                await wait_for(lambda: _said(client, run_id, "woke new"), what="woke on new")
    journal = await client.journal(run_id)
    [move] = [e.data for e in journal if e.type == "run.upgraded"]
    assert (move["from_version"], move["to_version"], move["how"]) == (
        agent_version(old),
        agent_version(new),
        "value",
    )
    assert "steps.invalidated" not in [e.type for e in journal]
    assert len(server.received) == 2  # the call that asked to sleep, the one after: no more
