"""Attacks on versions and forks (issue 31's review): one test per finding, each against real
Postgres and an in-process worker; a finding not fixed is an ``xfail(strict=True)`` naming why."""

from __future__ import annotations

import functools
import json
import uuid
from collections.abc import AsyncIterator, Awaitable
from typing import Any

import anyio
import attrs
import pytest

from tests.conftest import person, running_worker, wait_for
from tests.test_api import api, session
from toren import Agent, Client, ConfigError, ToolContext, tool
from toren._surfaces.tokens import create_token
from toren.directory import Directory
from toren.runs import (
    Agents,
    agent_version,
    cancel,
    fork_run,
    newest_version,
    read_run,
    say,
    start_run,
    version_route,
    waiting_on,
)
from toren.runs.limits import concurrency
from toren.runs.listing import list_runs
from toren.runs.version_listing import agent_versions
from toren.runs.version_moves import move
from toren.testing import AnthropicServer, Reply, ToolCall

pytestmark = pytest.mark.anyio

MODEL = "anthropic/claude-sonnet-4-6"

_GATES: dict[str, anyio.Event] = {}
"""The gate the ``hold`` tool waits at (one per test: set by the ``gate`` fixture)."""


@tool(effects="read")
async def hold(ctx: ToolContext) -> str:
    """Wait until let through (keeps its run working, so it holds its run permits)."""
    await _GATES["gate"].wait()
    return "held"


@pytest.fixture
async def gate() -> AsyncIterator[anyio.Event]:
    _GATES["gate"] = event = anyio.Event()
    try:
        yield event
    finally:
        event.set()
        _GATES.pop("gate", None)


def agents(*defined: Agent) -> Agents:
    registry = Agents()
    registry.register(defined)
    return registry


def answer(body: dict[str, Any], n: int) -> Reply:
    """``hold`` calls the tool; a tool's result is echoed; any other text is heard."""
    last = body["messages"][-1]["content"]
    if isinstance(last, list) and any(b.get("type") == "tool_result" for b in last):
        return Reply("result: " + json.dumps(last[-1].get("content")))
    text = last if isinstance(last, str) else " ".join(b.get("text", "") for b in last)
    if "park" in text:
        return Reply([ToolCall(id=f"a{n}", name="ask", arguments={})])
    if "hold" in text:
        return Reply([ToolCall(id=f"h{n}", name="hold", arguments={})])
    return Reply(f"heard {text}")


@pytest.fixture
async def model(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[AnthropicServer]:
    async with AnthropicServer(answer) as server:
        for name, value in server.env().items():
            monkeypatch.setenv(name, value)
        yield server


async def _in_tool(client: Client, run_id: str) -> bool:
    return bool((await read_run(client, run_id)).calls)


async def _output(client: Client, run_id: str) -> str | None:
    state = await read_run(client, run_id)
    return state.output if state.status == "completed" else None


async def test_a_fork_keeps_its_sources_concurrency_key(
    client: Client, db_url: str, model: AnthropicServer, gate: anyio.Event
) -> None:
    """Finding: ``fork_run`` dropped the source's ``concurrency_key``, so a fork of a keyed run
    (one chat, one customer) ran beside the source under the same key, past
    ``max_runs_per_key``. Fixed: the fork is started under the source's key."""
    helper = Agent(name="helper", model=MODEL, tools=[hold])
    async with running_worker(db_url, agents=agents(helper)):
        source = await start_run(client, "helper", "hold on", concurrency_key="chat-1")
        await wait_for(lambda: _in_tool(client, source), what="the source in its tool")
        fork = await fork_run(client, source, at=1)
        found = await concurrency(client, fork)
        assert found.key == "chat-1"
        assert found.wait is not None  # behind the source, which holds the key's one slot
        gate.set()
        await wait_for(lambda: _output(client, fork), what="the fork done after the source")
    assert len(model.received) == 4  # two calls each: the fork made step 1 again, live


def _limit(args: dict[str, Any], limit: int) -> bool:
    return int(args.get("amount", 0)) > limit


@pytest.mark.xfail(
    strict=True,
    reason="agent_version names an approval predicate by module.qualname only: every "
    "functools.partial is 'predicate:functools.partial' and every lambda '<lambda>', so "
    "changing a partial's bound threshold (or a lambda's body) makes no new version and a "
    "pinned run moves to a worker whose approval rule differs. A fix needs a stable name for "
    "a predicate's configuration (e.g. the partial's func and canonical arguments).",
)
async def test_a_changed_approval_threshold_makes_a_new_version() -> None:
    @tool(effects="external", approval=functools.partial(_limit, limit=1000))
    async def pay(ctx: ToolContext, amount: int) -> str:
        """Pay."""
        return "paid"

    lax = Agent(name="payer", model=MODEL, tools=[pay])
    strict = Agent(
        name="payer",
        model=MODEL,
        tools=[attrs.evolve(pay, approval=functools.partial(_limit, limit=10))],
    )
    assert agent_version(lax) != agent_version(strict)


async def test_a_fork_on_the_current_version_is_pinned_to_it(
    client: Client, db_url: str, model: AnthropicServer
) -> None:
    """Finding: ``fork_run(..., upgrade=True)`` spawned the fork on the unpinned route
    ``agent:NAME``; a worker of the source's own version took it, saw nothing to move, and
    left it unpinned under ``pin`` (free to float between versions in a rolling deploy, each
    move invalidating it; an old worker could take an "upgraded" fork). Fixed: the fork is
    routed to the newest version a live worker serves."""
    helper = Agent(name="helper", model=MODEL, tools=[hold])
    pinned = version_route("helper", agent_version(helper))
    async with running_worker(db_url, agents=agents(helper)):
        source = await start_run(client, "helper", "hello")
        await wait_for(lambda: _output(client, source), what="the source done")
        fork = await fork_run(client, source, at=1, upgrade=True)
        assert (await client.actor(fork))["route"] == pinned
        await wait_for(lambda: _output(client, fork), what="the fork done")
    assert (await client.actor(fork))["route"] == pinned


async def test_a_later_upgrade_supersedes_one_no_worker_took(
    client: Client, db_url: str, model: AnthropicServer
) -> None:
    """Finding: upgraded to V2 (whose worker died before taking the run) and then to V3, the
    run was taken by V3's worker, which handled the first Upgrade by handing the run back to
    V2: it parked on the version the operator had moved it off (with V2 and V3 workers both
    up, the two Upgrades would bounce it between them). Fixed: an Upgrade that a later
    request superseded (the row's ``args.upgrade``, asked later by the database's clock) is
    dropped."""
    old = Agent(name="helper", model=MODEL, tools=[hold])
    new = attrs.evolve(old, system="Be brief.")
    async with running_worker(db_url, agents=agents(old)):
        run_id = await start_run(client, "helper", "hello")
        await wait_for(lambda: _output(client, run_id), what="turn 1")
    # Moved to a version whose worker died before taking it, then to the one deployed next.
    async with client.pool.acquire() as conn, conn.transaction():
        await move(client, conn, run_id, "helper", "0123456789ab", person("ops"))
    async with client.pool.acquire() as conn, conn.transaction():
        await move(client, conn, run_id, "helper", agent_version(new), person("ops"))
    await say(client, run_id, "again", by=person("ann"))
    async with running_worker(db_url, agents=agents(new)):
        # Moved by replay, the new prompt re-asks from step 1: both messages in one turn.
        await wait_for(lambda: _said(client, run_id, "heard hello again"), what="turn 2")
    assert (await client.actor(run_id))["route"] == version_route("helper", agent_version(new))
    [moved] = [e.data for e in await client.journal(run_id) if e.type == "run.upgraded"]
    assert (moved["to_version"], moved["by"]["name"]) == (agent_version(new), "ops")


async def _said(client: Client, run_id: str, output: str) -> bool:
    state = await read_run(client, run_id)
    return state.status == "completed" and state.output == output


async def test_a_deeply_nested_fork_body_is_a_bad_request_not_a_server_error(
    client: Client, db_url: str
) -> None:
    """Finding: the fork route re-reads a body orjson refuses with the standard library's
    reader (to take lone surrogates as text); a body of nested arrays deeper than orjson's
    limit made that reader raise RecursionError, which escaped as a 500. Fixed: it is not
    JSON, a 400, as on every route."""
    _, token = await create_token(client.pool, "olga", scopes=["read", "operate"])
    deep = b"[" * 100_000 + b"]" * 100_000
    async with (
        api(db_url) as base,
        session(token) as http,
        http.post(
            f"{base}/runs/{uuid.uuid4()}/fork",
            data=deep,
            headers={"Content-Type": "application/json"},
        ) as r,
    ):
        assert r.status == 400, await r.text()


async def _parked_on(client: Client, run_id: str, route: str) -> bool:
    row = await client.actor(run_id)
    return bool(row["route"] == route and row["owner"] is None)


@pytest.mark.xfail(
    strict=True,
    reason="a run that has recorded nothing is pinned all the same: a worker that takes a new "
    "run while a newer version runs elsewhere hands it to that version "
    "(versions.handed_over re-routes it to agent:NAME@NEWEST before run.started), so if "
    "those workers then go (a rollback, a crash, or within Directory.NEWEST_SECONDS of one) "
    "the run parks on a version it never ran on and needs `toren jobs upgrade`, though a live "
    "worker serves its agent. A fix: hand over on the agent's route with a preference, or "
    "let a worker take a run that has not started when no live worker serves its pin.",
)
async def test_a_run_handed_to_a_newer_version_that_goes_away_still_starts(
    client: Client, db_url: str, model: AnthropicServer, gate: anyio.Event
) -> None:
    old = Agent(name="helper", model=MODEL, tools=[hold])
    new = attrs.evolve(old, system="Be brief.")
    async with running_worker(db_url, agents=agents(old)):
        async with running_worker(db_url, agents=agents(new), max_actors=1, grace_seconds=0.5):
            held = await start_run(client, "helper", "hold on")  # fills the new worker
            await wait_for(lambda: _in_tool(client, held), what="the new worker busy")
            run_id = await start_run(client, "helper", "hello")  # the old worker takes it
            pinned = version_route("helper", agent_version(new))
            await wait_for(lambda: _parked_on(client, run_id, pinned), what="handed over")
        # The new version rolled back: the old worker is the only one serving the agent.
        await wait_for(lambda: _output(client, run_id), timeout=15, what="started on the old")


@tool(effects="external", approval="always")
async def ask(ctx: ToolContext) -> str:
    """Ask first."""
    return "asked"


async def _waiting(client: Client, run_id: str) -> bool:
    return bool(waiting_on(await read_run(client, run_id)))


async def test_a_parked_run_can_be_cancelled(
    client: Client, db_url: str, model: AnthropicServer
) -> None:
    old = Agent(name="helper", model=MODEL, tools=[ask])
    new = attrs.evolve(old, system="Be brief.")
    async with running_worker(db_url, agents=agents(old)):
        run_id = await start_run(client, "helper", "park here")
        await wait_for(lambda: _waiting(client, run_id), what="waiting on an approval")
    async with running_worker(db_url, agents=agents(new)):
        await cancel(client, run_id, by=person("ops"))
        await wait_for(lambda: _status_is(client, run_id, "cancelled"), timeout=15, what="gone")
        types = [e.type for e in await client.journal(run_id)]
        assert "run.upgraded" not in types  # ended where it was taken, moved nowhere first


async def _status_is(client: Client, run_id: str, status: str) -> bool:
    return (await read_run(client, run_id)).status == status


async def _started_on(client: Client, run_id: str) -> str | None:
    for entry in await client.journal(run_id):
        if entry.type == "run.started":
            return str(entry.data.get("version") or "")
    return None


async def test_an_old_worker_restarting_during_a_ramp_does_not_take_new_runs(
    client: Client, db_url: str, model: AnthropicServer
) -> None:
    """Finding: "newest" was the version of the live worker that started last, so an old
    worker that restarted during a ramp (a crash, an OOM kill, a node drain) made the old
    version the newest again: new runs went to the old code, ``next_turn`` conversations moved
    back to it, until a new worker restarted. Fixed: the newest is, of the versions live
    workers serve, the one first seen latest (``toren.agent_versions``); rolling back is
    stopping the new workers."""
    old = Agent(name="helper", model=MODEL, tools=[hold])
    new = attrs.evolve(old, system="Be brief.")
    async with running_worker(db_url, agents=agents(old)) as first:
        async with (
            running_worker(db_url, agents=agents(new)),  # the ramp: new workers beside the old
            running_worker(db_url, agents=agents(old)),  # an old pod restarted
        ):
            await wait_for(lambda: _served_by(client, 3), what="three workers published")
            assert await newest_version(client, "helper") == agent_version(new)
            run_id = await start_run(client, "helper", "hello")
            await wait_for(lambda: _output(client, run_id), what="done")
            assert await _started_on(client, run_id) == agent_version(new)
        # Rolling back: the new workers stopped, the old version is the newest again.
        assert await newest_version(client, "helper") == agent_version(old)
        [found] = await agent_versions(client.pool, agent="helper")
        assert found.newest == agent_version(old)
        directory = first.resources.get(Directory)  # as the old worker reads it (kept a moment)
        await wait_for(
            lambda: _is(directory.newest_version("helper"), agent_version(old)),
            what="the old worker reads the old version as the newest",
        )
        back = await start_run(client, "helper", "again")
        await wait_for(lambda: _output(client, back), what="done on the old version")
        assert await _started_on(client, back) == agent_version(old)


async def _is(value: Awaitable[str | None], expected: str) -> bool:
    return await value == expected


async def _served_by(client: Client, n: int) -> bool:
    rows = await client.pool.fetch("SELECT stats FROM toren.workers")
    return sum(1 for r in rows if "helper" in ((r["stats"] or {}).get("agents") or {})) >= n


def test_an_agent_named_with_the_version_separator_is_refused() -> None:
    """Finding: ``Agent(name="a@b")`` was accepted (though ``start_run`` refuses the name), and
    a run of it (a child, a schedule's) is routed ``agent:a@b``, which ``route_version`` reads
    as agent ``a`` pinned to version ``b`` and the listing's route filter (the route before
    ``@``) misses. Fixed: the name is refused where the agent is defined."""
    with pytest.raises(ConfigError, match="holds no '@'"):
        Agent(name="a@b", model=MODEL)


async def test_a_conversation_whose_message_waits_on_a_gone_version_shows_parked(
    client: Client, db_url: str, model: AnthropicServer
) -> None:
    """Finding: a completed conversation pinned to a version no live worker serves, with a
    human's message waiting, was listed as ``completed``: only runs that had not ended were
    checked, so the message waited forever with no reason shown (the Telegram case: drain
    the old workers, and the next message to an old conversation goes unanswered, silently).
    Fixed: such a run shows ``parked``, with the reason, in the listing and in its API view."""
    old = Agent(name="helper", model=MODEL, tools=[hold])
    new = attrs.evolve(old, system="Be brief.")
    async with running_worker(db_url, agents=agents(old)):
        run_id = await start_run(client, "helper", "hello")
        await wait_for(lambda: _output(client, run_id), what="turn 1")
    _, token = await create_token(client.pool, "olga", scopes=["read"])
    async with running_worker(db_url, agents=agents(new)), api(db_url) as base:
        await wait_for(lambda: _published(client, agent_version(new)), what="the new worker")
        [row] = await list_runs(client, agent="helper")
        assert row.status == "completed"  # nothing waits on it: an ended conversation
        await say(client, run_id, "again", by=person("ann"))
        [row] = await list_runs(client, agent="helper")
        reason = f"waiting for a worker serving version {agent_version(old)}"
        assert (row.status, row.waiting_for) == ("parked", reason)
        async with session(token) as http, http.get(f"{base}/runs/{run_id[4:]}") as r:
            shown = await r.json()
        assert (shown["status"], shown["waiting_for"]) == ("parked", reason)


async def _published(client: Client, version: str) -> bool:
    rows = await client.pool.fetch("SELECT stats FROM toren.workers")
    return any(
        ((r["stats"] or {}).get("agents", {}).get("helper") or {}).get("version") == version
        for r in rows
    )
