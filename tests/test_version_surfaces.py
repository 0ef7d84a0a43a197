"""What the surfaces show of agent versions, with real workers of two apps whose agent ``twin``
differs only in its system prompt (two versions): the listing (CLI, API, ``/healthz``,
``toren workers``), a pinned run whose version no live worker serves shown parked with the
reason (list, show, API, the console, the timeline's last line), and upgrading it from the CLI,
the API and the console's button; a ``read`` token refused (nothing sent), an ended run and an
unknown one refused clearly."""

from __future__ import annotations

import contextlib
import functools
import json
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import pytest

import toren.providers.anthropic  # noqa: F401  (the SDK import is paid here, not in a step)
from tests.conftest import running_worker, wait_for
from tests.test_api import api, session
from tests.test_cli import toren as run_toren
from tests.test_console import _launch, _signed_in, chromium  # noqa: F401  (a fixture)
from toren import Agent, Client, ToolContext, tool
from toren._agent.model import ToolCall
from toren._core.rows import actor_row
from toren._surfaces.tokens import create_token
from toren.runs import RUN_KIND, Agents, agent_version, read_run, start_run
from toren.runs.version_listing import agent_versions
from toren.testing import AnthropicServer, Reply

pytestmark = pytest.mark.anyio

MODEL = "anthropic/claude-sonnet-4-6"
PROMPT_A = "You are the twin, version A."
PROMPT_B = "You are the twin, version B."
ASK = "ask first"  # a run on this input waits for an approval (it stays unfinished)


@tool(effects="external", idempotency="keyed", approval="always")
async def refund(ctx: ToolContext, amount: float) -> str:
    """Refund the customer."""
    return f"refunded {amount:g}"


def twin(system: str) -> tuple[Agents, str]:
    """An app of one agent, ``twin`` (pinned), with the prompt ``system``; and its version."""
    agent = Agent(name="twin", model=MODEL, system=system, tools=[refund], version_policy="pin")
    agents = Agents()
    [registered] = agents.register([agent])
    return agents, agent_version(registered)


def answer(request: dict[str, Any], n: int) -> Reply:
    """Asked to: a refund that needs approval; then (or else) an answer."""
    asked = ASK in json.dumps(request["messages"][0])
    if asked and not any(m["role"] == "assistant" for m in request["messages"]):
        return Reply([ToolCall(id="r1", name="refund", arguments={"amount": 5})])
    return Reply("done")


async def route(client: Client, run_id: str) -> str | None:
    row = await actor_row(client.pool, run_id, kind=RUN_KIND)
    return row.route if row is not None else None


async def cli(db_url: str, *args: str) -> Any:
    """``toren ARGS`` in a process of its own, off the event loop (the workers run on it)."""
    return await anyio.to_thread.run_sync(functools.partial(run_toren, *args, db_url=db_url))


@contextlib.asynccontextmanager
async def model() -> AsyncIterator[AnthropicServer]:
    async with AnthropicServer(answer) as server:
        yield server


async def test_a_run_on_a_version_no_worker_serves_is_parked_listed_and_upgraded(
    client: Client,
    db_url: str,
    monkeypatch: pytest.MonkeyPatch,
    chromium: Path,  # noqa: F811  (the fixture imported above)
) -> None:
    a_agents, va = twin(PROMPT_A)
    b_agents, vb = twin(PROMPT_B)
    assert va != vb
    _, operator = await create_token(client.pool, "olga", scopes=["read", "operate"])
    _, reader = await create_token(client.pool, "rita", scopes=["read"])
    async with model() as server:
        for name, value in server.env().items():
            monkeypatch.setenv(name, value)
        async with running_worker(db_url, a_agents) as a:
            # Three runs start on A and wait for an approval: pinned to A's version. Another
            # completes there.
            first = await start_run(client, "twin", f"{ASK} (one)")
            second = await start_run(client, "twin", f"{ASK} (two)")
            third = await start_run(client, "twin", f"{ASK} (three)")
            done = await start_run(client, "twin", "just answer")
            for rid in (first, second, third):
                await wait_for(
                    lambda rid=rid: _status(client, rid, "parked"), what=f"{rid} asks first"
                )
            await wait_for(lambda: _status(client, done, "completed"), what="a run completes")
            assert await route(client, first) == f"agent:twin@{va}"
            async with running_worker(db_url, b_agents):
                await a.stop()  # A is gone: nothing serves version A any more
                await wait_for(lambda: _served_only(client, vb), what="only B serves twin")
                await _a_is_listed_without_a_worker(client, db_url, va, vb, first)
                await _upgrades(client, db_url, operator, reader, first, second, done, va, vb)
                await _console(client, db_url, operator, third, va, vb, chromium)


async def _status(client: Client, run_id: str, status: str) -> bool:
    return (await read_run(client, run_id)).status == status


async def _served_only(client: Client, version: str) -> bool:
    [found] = await agent_versions(client.pool, agent="twin")
    return [v.version for v in found.versions if v.served] == [version]


async def _a_is_listed_without_a_worker(
    client: Client, db_url: str, va: str, vb: str, first: str
) -> None:
    """Version A, with two runs and no worker, is flagged everywhere; B is the newest."""
    [found] = await agent_versions(client.pool)
    assert (found.agent, found.newest) == ("twin", vb)
    [b, a] = found.versions
    assert (b.version, b.newest, b.served, b.unfinished_runs) == (vb, True, True, 0)
    assert b.policy == "pin"
    assert (a.version, a.newest, a.served, a.unfinished_runs) == (va, False, False, 3)
    assert found.stranded_runs == 3

    shown = await cli(db_url, "agents", "versions", "--json")
    assert shown.returncode == 0, shown.stderr
    [listed] = json.loads(shown.stdout)
    assert [(v["version"], v["served"], v["unfinished_runs"]) for v in listed["versions"]] == [
        (vb, True, 0),
        (va, False, 3),
    ]
    assert listed["versions"][0]["workers"][0]["code_version"]
    table = await cli(db_url, "agents", "versions")
    assert "NO WORKER: 3 run(s) parked" in table.stdout, table.stdout
    workers = await cli(db_url, "workers")
    assert f"twin@{va}: 3 run(s), NO LIVE WORKER serves it" in workers.stdout, workers.stdout

    # The run is parked, with the reason: in the list, its page, the API, the timeline.
    reason = f"waiting for a worker serving version {va}"
    listing = await cli(db_url, "jobs", "list", "--agent", "twin")
    assert f"parked: {reason}" in listing.stdout, listing.stdout
    show = await cli(db_url, "jobs", "show", first)
    lines = show.stdout.splitlines()
    assert f"status parked ({reason})" in show.stdout, show.stdout
    [last] = [line for line in lines if line.strip().startswith("--  parked")]
    assert reason in last
    assert f"jobs upgrade {first}" in last
    as_json = json.loads((await cli(db_url, "jobs", "show", first, "--json")).stdout)
    assert (as_json["status"], as_json["version"], as_json["waiting_for"]) == ("parked", va, reason)
    async with api(db_url) as base, session(None) as anonymous:
        async with session(await _token(client)) as http:
            async with http.get(f"{base}/runs/{_uuid(first)}") as r:
                run = await r.json()
            assert (run["status"], run["version"], run["waiting_for"]) == ("parked", va, reason)
            async with http.get(f"{base}/runs?agent=twin") as r:
                page = {row["id"]: row for row in (await r.json())["runs"]}
            assert page[first]["waiting_for"] == reason
            async with http.get(f"{base}/agents/versions") as r:
                [listed] = (await r.json())["agents"]
            assert (listed["newest"], listed["stranded_runs"]) == (vb, 3)
            async with http.get(f"{base}/healthz") as r:
                health = await r.json()
            assert {"agent": "twin", "version": va, "unfinished_runs": 3, "served": False} in (
                health["agent_versions"]
            )
            async with http.get(f"{base}/agents/versions?agent=a%00b") as r:
                assert r.status == 422
        async with anonymous.get(f"{base}/healthz") as r:
            assert (await r.json())["agent_versions"] is None  # names versions: not to anyone


async def _upgrades(
    client: Client,
    db_url: str,
    operator: str,
    reader: str,
    first: str,
    second: str,
    done: str,
    va: str,
    vb: str,
) -> None:
    async with api(db_url) as base:
        # A read token is refused, and nothing is sent: the run stays where it was.
        before = await client.journal(first)
        async with session(reader) as http, http.post(f"{base}/runs/{_uuid(first)}/upgrade") as r:
            assert r.status == 403
            assert "lacks the 'operate' scope" in (await r.json())["detail"]
        assert await route(client, first) == f"agent:twin@{va}"
        assert len(await client.journal(first)) == len(before)

        async with session(operator) as http:
            # An unknown run, an ended run, a body that is not empty: refused.
            async with http.post(f"{base}/runs/{uuid.uuid4()}/upgrade") as r:
                assert r.status == 404
            async with http.post(f"{base}/runs/{_uuid(done)}/upgrade") as r:
                assert r.status == 409
                assert "completed" in (await r.json())["detail"]
            async with http.post(f"{base}/runs/{_uuid(first)}/upgrade", json={"to": "x"}) as r:
                assert r.status == 422
            assert await route(client, first) == f"agent:twin@{va}"
            # Upgraded over the API: moved to B, recorded with the caller.
            async with http.post(f"{base}/runs/{_uuid(first)}/upgrade", json={}) as r:
                assert r.status == 202, await r.text()
                moved = await r.json()
            assert (moved["from_version"], moved["to_version"]) == (va, vb)
            assert await route(client, first) == f"agent:twin@{vb}"
            async with http.get(f"{base}/runs/{_uuid(first)}") as r:
                assert (await r.json())["waiting_for"] is None
            # Again: it is on the newest version already.
            async with http.post(f"{base}/runs/{_uuid(first)}/upgrade") as r:
                assert r.status == 409

    # The CLI: the other run moves; an ended run and an unknown one are clear errors.
    moved = await cli(db_url, "jobs", "upgrade", second)
    assert moved.returncode == 0, moved.stderr
    assert f"{second} moves from version {va} to version {vb}" in moved.stdout
    assert await route(client, second) == f"agent:twin@{vb}"
    ended = await cli(db_url, "jobs", "upgrade", done)
    assert (ended.returncode, "completed" in ended.stderr) == (1, True), ended.stderr
    unknown = await cli(db_url, "jobs", "upgrade", str(uuid.uuid4()))
    assert (unknown.returncode, "no run" in unknown.stderr) == (2, True), unknown.stderr

    # Each records its move once a worker serving B takes it.
    for rid, who in ((first, "olga"), (second, None)):
        [upgraded] = await wait_for(lambda rid=rid: _upgraded(client, rid), what="run.upgraded")
        assert (upgraded["from_version"], upgraded["to_version"]) == (va, vb)
        if who is not None:
            assert upgraded["by"]["name"] == who


async def _console(
    client: Client, db_url: str, operator: str, third: str, va: str, vb: str, browser_path: Path
) -> None:
    """The Versions page flags A; the parked run's page says why and upgrades it."""
    from playwright.async_api import async_playwright

    async with api(db_url) as base, async_playwright() as pw:
        browser = await _launch(pw, browser_path)
        try:
            page = await _signed_in(browser, base, operator)
            await page.wait_for_selector("#runs-body tr")
            await page.goto(f"{base}/#/versions")
            flagged = page.locator("#versions-list .bad")
            await flagged.wait_for()
            assert await flagged.inner_text() == "no live worker: 1 run(s) parked"
            assert vb in await page.inner_text("#versions-list")
            await page.goto(f"{base}/#/runs/{third}")
            reason = f"waiting for a worker serving version {va}"
            await page.wait_for_selector("#upgrade:not([hidden])")
            assert await page.inner_text("#run-status") == f"parked: {reason}"
            assert await page.inner_text("#run-waiting") == f"parked: {reason}"
            await page.click("#upgrade")
            await page.wait_for_selector("#steer-done:not([hidden])")
            await page.wait_for_selector("#upgrade", state="hidden")
        finally:
            await browser.close()
    assert await route(client, third) == f"agent:twin@{vb}"
    [upgraded] = await wait_for(lambda: _upgraded(client, third), what="run.upgraded")
    assert (upgraded["to_version"], upgraded["by"]["name"]) == (vb, "olga")
    [found] = await agent_versions(client.pool)
    assert found.stranded_runs == 0


async def _upgraded(client: Client, run_id: str) -> list[Any]:
    return [e.data for e in await client.journal(run_id) if e.type == "run.upgraded"]


async def _token(client: Client) -> str:
    _, token = await create_token(client.pool, f"t{uuid.uuid4().hex[:6]}", scopes=["read"])
    return token


def _uuid(run_id: str) -> str:
    return run_id.removeprefix("run/")
