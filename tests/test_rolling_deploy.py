"""A rolling deploy with real worker processes: two deploys of one app (tests/deploy_app.py, the
system prompt changed) on one database, old and new workers side by side, the old ones drained
one by one (SIGTERM), against a model server that counts every call.

- ``pin``: runs started on the old version finish on old workers, nothing invalidated or paid
  twice; runs started once the new version runs start there; a pinned run whose workers are all
  gone waits unclaimed (its mail included) until ``upgrade_run`` moves it.
- ``next_turn``: a conversation moves to the new version at its next human message, its
  history taken by value (nothing paid again).
- ``upgrade``: as before versions, the run moves to whichever worker takes it and re-pays from
  the first call the new prompt changes.
"""

from __future__ import annotations

import json
import signal
from collections import Counter
from typing import Any

import anyio
import pytest

from tests.conftest import WorkerFactory, WorkerProcess, person, wait_for
from tests.deploy_app import deploy
from toren import Client, UnknownActor
from toren.runs import (
    RunNotInState,
    agent_version,
    decide,
    read_run,
    say,
    start_run,
    upgrade_run,
    version_route,
    waiting_on,
)
from toren.testing import AnthropicServer, Reply, ToolCall

pytestmark = pytest.mark.anyio

# Each agent's version in each deploy, by name.
OLD = {agent.name: agent_version(agent) for agent in deploy("OLD")}
NEW = {agent.name: agent_version(agent) for agent in deploy("NEW")}


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    return " ".join(b.get("text", "") for b in content if isinstance(b, dict))


def answer(body: dict[str, Any], n: int) -> Reply:
    """The model: asks for approval on ``park ...``, else echoes the last human text and names
    the build its system prompt is for; after a tool result, says it is done."""
    build = "NEW" if "NEW" in json.dumps(body.get("system")) else "OLD"
    last = body["messages"][-1]["content"]
    if isinstance(last, list) and any(b.get("type") == "tool_result" for b in last):
        return Reply(f"done [{build}]")
    text = _text(last)
    if text.startswith("park"):
        return Reply([ToolCall(id=f"ask{n}", name="ask", arguments={})])
    return Reply(f"{text.split()[-1]} [{build}]")


def calls_of(server: AnthropicServer) -> Counter[str]:
    """Requests received, by the run's input (the first text of its first message)."""
    return Counter(_first(r.body["messages"][0]["content"]) for r in server.received)


def _first(content: Any) -> str:
    return content if isinstance(content, str) else str(content[0].get("text", ""))


async def published(client: Client, versions: dict[str, str], count: int) -> bool:
    rows = await client.pool.fetch("SELECT stats FROM toren.workers")
    cards = [(r["stats"] or {}).get("agents", {}) for r in rows]
    return sum(c.get(n, {}).get("version") == v for c in cards for n, v in versions.items()) >= (
        count * len(versions)
    )


async def drained(w: WorkerProcess) -> None:
    w.signal(signal.SIGTERM)
    assert await anyio.to_thread.run_sync(w.wait, 30) == 0, w.log()


async def ended_with(client: Client, run_id: str, output: str) -> bool:
    state = await read_run(client, run_id)
    return state.status == "completed" and state.output == output


async def parked(client: Client, run_id: str) -> bool:
    return bool(waiting_on(await read_run(client, run_id)))


async def types(client: Client, run_id: str) -> list[str]:
    return [e.type for e in await client.journal(run_id)]


async def upgraded(client: Client, run_id: str) -> list[dict[str, Any]]:
    return [e.data for e in await client.journal(run_id) if e.type == "run.upgraded"]


async def test_a_rolling_deploy_moves_each_run_as_its_policy_says(
    client: Client, workers: WorkerFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert all(OLD[name] != NEW[name] for name in OLD)
    async with AnthropicServer(answer) as server:
        for name, value in server.env().items():
            monkeypatch.setenv(name, value)
        old = [workers("tests.deploy_old_app"), workers("tests.deploy_old_app")]
        await wait_for(lambda: published(client, OLD, 2), timeout=60, what="old workers up")

        # On the old deploy: two pinned runs park on an approval; two conversations end a turn.
        kept = await start_run(client, "pinned", "park kept")
        stranded = await start_run(client, "pinned", "park stranded")
        convo = await start_run(client, "convo", "hello convo")
        loose = await start_run(client, "loose", "hello loose")
        for run in (kept, stranded):
            await wait_for(lambda run=run: parked(client, run), what=f"{run} parked")
        await wait_for(lambda: ended_with(client, convo, "convo [OLD]"), what="turn 1")
        await wait_for(lambda: ended_with(client, loose, "loose [OLD]"), what="loose turn 1")
        row = await client.actor(kept)
        assert row["route"] == version_route("pinned", OLD["pinned"])

        # The new deploy beside the old: a run started now starts on the new version.
        workers("tests.deploy_new_app")
        workers("tests.deploy_new_app")
        await wait_for(lambda: published(client, NEW, 2), timeout=60, what="new workers up")
        fresh = await start_run(client, "pinned", "hello fresh")
        await wait_for(lambda: ended_with(client, fresh, "fresh [NEW]"), what="a new run")
        [started] = [e.data for e in await client.journal(fresh) if e.type == "run.started"]
        assert started["version"] == NEW["pinned"]

        # One old worker drained: the pinned run finishes on the other, on its own version.
        await drained(old[0])
        await decide_waiting(client, kept)
        await wait_for(lambda: ended_with(client, kept, "done [OLD]"), what="kept run done")
        assert "steps.invalidated" not in await types(client, kept)
        assert await upgraded(client, kept) == []
        assert calls_of(server)["park kept"] == 2  # the call that asked, the one after

        # The conversation's next message moves it to the new version, its history by value.
        await say(client, convo, "more convo", by=person("ann"))
        await wait_for(lambda: ended_with(client, convo, "convo [NEW]"), what="turn 2")
        assert "steps.invalidated" not in await types(client, convo)
        [move] = await upgraded(client, convo)
        assert (move["from_version"], move["to_version"], move["how"]) == (
            OLD["convo"],
            NEW["convo"],
            "value",
        )
        assert calls_of(server)["hello convo"] == 2  # one per turn: nothing paid again
        assert (await read_run(client, convo)).settled_calls == 1

        # The last old worker drained: a message to the pinned run waits, unclaimed.
        await drained(old[1])
        await say(client, stranded, "park more stranded", by=person("ann"))
        # Under upgrade, a run moves as before versions: the new prompt re-pays from step 1.
        await say(client, loose, "more loose", by=person("ann"))
        await wait_for(lambda: ended_with(client, loose, "loose [NEW]"), what="loose moved")
        journal = await client.journal(loose)
        assert [e.data["from_step"] for e in journal if e.type == "steps.invalidated"] == [1]
        [move] = await upgraded(client, loose)
        assert (move["from_version"], move["to_version"], move["how"]) == (
            OLD["loose"],
            NEW["loose"],
            "replay",
        )
        assert (await client.actor(loose))["route"] == "agent:loose"
        row = await client.actor(stranded)  # polled by two new workers all the while
        assert (row["route"], row["owner"]) == (version_route("pinned", OLD["pinned"]), None)
        assert "message.received" not in await types(client, stranded)

        # Upgraded by an operator: a new worker takes it, re-checks it, and it goes on.
        [asked] = waiting_on(await read_run(client, stranded))
        assert await upgrade_run(client, stranded, by=person("ops")) == NEW["pinned"]

        async def asked_again() -> bool:
            waiting = waiting_on(await read_run(client, stranded))
            return bool(waiting) and waiting[0].id != asked.id

        await wait_for(asked_again, what="the stranded run asks again")
        await decide_waiting(client, stranded)
        await wait_for(lambda: ended_with(client, stranded, "done [NEW]"), what="stranded done")
        [move] = await upgraded(client, stranded)
        assert (move["to_version"], move["how"], move["by"]["name"]) == (
            NEW["pinned"],
            "replay",
            "ops",
        )
        assert calls_of(server)["park stranded"] == 3  # step 1 on OLD, again on NEW, step 2

        # What upgrade_run refuses: nothing is changed.
        with pytest.raises(RunNotInState, match="only a run that has not ended"):
            await upgrade_run(client, stranded)
        with pytest.raises(UnknownActor):
            await upgrade_run(client, "run/00000000-0000-0000-0000-000000000000")


async def decide_waiting(client: Client, run_id: str) -> None:
    [call] = waiting_on(await read_run(client, run_id))
    await decide(client, run_id, call_id=call.id, approved=True, by=person("ann"), wait=None)
