"""What the CLI, the API and MCP do with schedules: ``toren schedules ...``, the ``/schedules``
routes, the schedule tools; their scopes; and bad input, refused with nothing stored.

Changes are messages a worker's schedule actor handles: the round trips run a worker in the
test's process (its agents ``alpha`` and ``beta``, whose runs are not the point: a triggered
run is checked to exist)."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import pytest

from tests.conftest import running_worker, wait_for
from tests.test_api import api, session
from tests.test_cli import toren
from tests.test_console import (  # noqa: F401  (chromium: a fixture)
    _launch,
    _signed_in,
    chromium,
)
from toren import Agent, Client
from toren._agent.registry import Agents
from toren._core.rows import actor_row
from toren._core.workers import served_agents
from toren._surfaces.mcp_server import build
from toren._surfaces.tokens import SCOPES, create_token
from toren.schedules import Schedule
from toren.schedules.client import create, list_schedules, pause, show, trigger

pytestmark = pytest.mark.anyio

MODEL = "anthropic/claude-sonnet-4-6"
DAILY = {"cron": "0 9 * * 1-5", "timezone": "Europe/Berlin", "input": "digest for {date}"}


def _agents() -> Agents:
    agents = Agents()
    agents.register([Agent(name=n, model=MODEL, system=n) for n in ("alpha", "beta")])
    return agents


@contextlib.asynccontextmanager
async def worker(db_url: str) -> AsyncIterator[None]:
    async with running_worker(db_url, agents=_agents()):
        yield


async def schedule_rows(client: Client) -> int:
    count: int = await client.pool.fetchval(
        "SELECT count(*) FROM toren.actors WHERE actor_id LIKE 'schedule/%'"
    )
    return count


async def declared(client: Client, name: str) -> bool:
    return any(v.name == name for v in await list_schedules(client))


async def _token(client: Client, scopes: Any = SCOPES, agents: Any = None) -> str:
    name = f"t-{'-'.join(scopes)}-{'-'.join(agents or ['all'])}"
    _, token = await create_token(client.pool, name, scopes=scopes, agents=agents)
    return token


def cli(db_url: str, *args: str) -> Any:
    return toren("schedules", *args, db_url=db_url)


# --- bad input: a clear error, nothing stored --------------------------------------------------

BAD_BODIES = {
    "cron": {"cron": "61 * * * *"},
    "timezone": {"cron": "0 9 * * *", "timezone": "Mars/Olympus_Mons"},
    "every": {"every": 0},
    "cron ": {"cron": "0 9 * * *", "every": "1h"},  # both
    "input": {"every": "1h", "input": "nul \x00 inside"},
    "concurrency_key": {"every": "1h", "concurrency_key": "k" * 100_000},
    "jitter": {"every": "1h", "jitter": "soon"},
    "start": {"every": "1h", "start": "2026-01-05T09:00:00"},  # no offset
    "name": {"every": "1h", "name": "Not A Name"},
    "when": {"every": "1h", "when": "now"},  # an unknown field
}


async def test_bad_schedules_over_http_are_422_naming_the_field_and_store_nothing(
    client: Client, db_url: str
) -> None:
    token = await _token(client)
    async with api(db_url) as base, session(token) as http:
        for what, fields in BAD_BODIES.items():
            body = {"agent": "alpha", "name": "digest", **fields}
            async with http.post(f"{base}/schedules", json=body) as r:
                problem = await r.json()
                assert r.status == 422, (what, problem)
            assert problem["errors"], what
            assert problem["errors"][0]["field"] == what.strip(), problem
        # A lone surrogate is not JSON (as on every route): 400, nothing stored either.
        raw = b'{"agent": "alpha", "name": "digest", "every": "1h", "input": "\\ud800"}'
        headers = {"Content-Type": "application/json"}
        async with http.post(f"{base}/schedules", data=raw, headers=headers) as r:
            assert r.status == 400
        for path, body in [
            ("/schedules/alpha/digest/pause", {"reason": "x"}),
            ("/schedules/alpha/digest/trigger", {}),
            ("/schedules/alpha/Bad%20Name/resume", {}),
        ]:
            async with http.post(f"{base}{path}", json=body) as r:
                assert r.status == 404, path
        async with http.get(f"{base}/schedules?agent=%00") as r:
            assert r.status == 422
    assert await schedule_rows(client) == 0


async def test_bad_schedules_on_the_cli_exit_2_and_store_nothing(
    client: Client, db_url: str
) -> None:
    cases = [
        ("create", "alpha", "digest", "--cron", "61 * * * *"),
        ("create", "alpha", "digest", "--cron", "0 9 * * *", "--timezone", "Mars/Olympus_Mons"),
        ("create", "alpha", "digest", "--every", "1h", "--concurrency-key", "k" * 100_000),
        ("create", "alpha", "Not_A_Name", "--every", "1h"),
        ("create", "alpha", "digest"),  # neither --cron nor --every
        ("backfill", "alpha/digest", "--from", "yesterday", "--to", "2026-01-01T00:00:00Z"),
    ]

    def run_all() -> list[Any]:
        return [cli(db_url, *case) for case in cases]

    for case, done in zip(cases, await anyio.to_thread.run_sync(run_all), strict=True):
        assert done.returncode == 2, (case[:4], done.stdout, done.stderr)
        assert done.stderr.startswith("error:"), done.stderr
        assert "Traceback" not in done.stderr
    assert await schedule_rows(client) == 0


async def test_a_schedule_for_an_agent_no_live_worker_runs_is_refused(
    client: Client, db_url: str
) -> None:
    token = await _token(client)
    async with worker(db_url), api(db_url) as base, session(token) as http:

        async def served() -> bool:
            return "alpha" in (await served_agents(client.pool) or ())

        await wait_for(served, what="the worker says what it runs")
        body = {"agent": "nobody", "name": "digest", **DAILY}
        async with http.post(f"{base}/schedules", json=body) as r:
            assert r.status == 422
            assert (await r.json())["errors"][0]["field"] == "agent"
        done = await anyio.to_thread.run_sync(
            lambda: cli(db_url, "create", "nobody", "digest", "--every", "1h")
        )
        assert done.returncode == 2, done.stderr
        assert "nobody" in done.stderr
    assert await actor_row(client.pool, "schedule/nobody/digest") is None


# --- round trips --------------------------------------------------------------------------------


async def test_http_create_list_pause_resume_trigger_delete(client: Client, db_url: str) -> None:
    token = await _token(client)
    async with worker(db_url), api(db_url) as base, session(token) as http:
        body = {"agent": "alpha", "name": "digest", **DAILY, "catch_up": "1h"}
        async with http.post(f"{base}/schedules", json=body) as r:
            assert r.status == 201, await r.text()
            created = await r.json()
        assert created["name"] == "alpha/digest"
        assert created["schedule"]["catch_up"] == 3600.0
        await wait_for(lambda: declared(client, "alpha/digest"), what="the schedule declared")
        async with http.post(f"{base}/schedules", json=body) as r:
            assert r.status == 201  # the same declaration again: a no-op
        async with http.post(f"{base}/schedules", json={**body, "cron": "0 10 * * *"}) as r:
            assert r.status == 409

        async with http.get(f"{base}/schedules") as r:
            [listed] = (await r.json())["schedules"]
        assert len(listed["next"]) == 3
        for fire in listed["next"]:  # 09:00 in Berlin, on a weekday, with Berlin's offset
            assert (fire[11:19], fire[19:] in ("+01:00", "+02:00")) == ("09:00:00", True), fire
        assert listed["paused"] is False

        url = f"{base}/schedules/alpha/digest"
        async with http.post(f"{url}/pause", json={"reason": "holiday"}) as r:
            assert r.status == 202

        async def paused() -> bool:
            return (await show(client, "alpha/digest")).paused

        await wait_for(paused, what="paused")
        async with http.get(url) as r:
            shown = await r.json()
        assert (shown["paused"], shown["paused_reason"], shown["next"]) == (True, "holiday", [])
        async with http.post(f"{url}/resume") as r:
            assert r.status == 202

        async def resumed() -> bool:
            return not (await show(client, "alpha/digest")).paused

        await wait_for(resumed, what="resumed")

        async with http.post(f"{url}/trigger", json={"id": "by-hand"}) as r:
            assert r.status == 202
            run = (await r.json())["run"]

        async def run_exists() -> bool:
            return await actor_row(client.pool, run, fields=("args",)) is not None

        await wait_for(run_exists, what="the triggered run")
        row = await actor_row(client.pool, run, fields=("args",))
        assert row is not None
        assert (row.args_dict["schedule"], row.args_dict["slot"]) == (
            "alpha/digest",
            "manual-by-hand",
        )
        async with http.get(f"{base}/runs/{run.removeprefix('run/')}") as r:
            assert (await r.json())["schedule"] == {
                "name": "alpha/digest",
                "slot": "manual-by-hand",
            }

        async with http.delete(url) as r:
            assert r.status == 202

        async def gone() -> bool:
            return not await declared(client, "alpha/digest")

        await wait_for(gone, what="deleted")
        async with http.get(url) as r:
            assert r.status == 404


async def test_cli_create_list_pause_resume_trigger_delete(client: Client, db_url: str) -> None:
    async with worker(db_url):

        def run(*args: str) -> Any:
            done = cli(db_url, *args)
            assert done.returncode == 0, (args, done.stdout, done.stderr)
            return done

        async def step(*args: str) -> Any:
            return await anyio.to_thread.run_sync(lambda: run(*args))

        made = await step(
            "create", "alpha", "tick", "--every", "1h", "--timezone", "Asia/Tokyo",
            "--input", "tick {time}", "--overlap", "buffer_one", "--pause-on-failure",
        )  # fmt: skip
        assert made.stdout.strip() == "alpha/tick"
        await wait_for(lambda: declared(client, "alpha/tick"), what="declared")
        listed = json.loads((await step("list", "--json")).stdout)
        [view] = listed
        assert view["schedule"]["every"] == 3600.0
        assert view["schedule"]["overlap"] == "buffer_one"
        assert len(view["next"]) == 3
        assert view["next"][1] - view["next"][0] == 3600.0
        table = (await step("list", "--agent", "alpha")).stdout
        assert "alpha/tick" in table
        assert "JST" in table  # fire times in the schedule's zone
        assert json.loads((await step("list", "--agent", "beta", "--json")).stdout) == []

        await step("pause", "alpha/tick", "--reason", "maintenance")

        async def paused() -> bool:
            return (await show(client, "alpha/tick")).paused

        await wait_for(paused, what="paused")
        assert "paused: maintenance" in (await step("show", "alpha/tick")).stdout
        await step("resume", "alpha/tick")

        async def resumed() -> bool:
            return not (await show(client, "alpha/tick")).paused

        await wait_for(resumed, what="resumed")
        run_id = (await step("trigger", "alpha/tick")).stdout.strip()
        assert run_id.startswith("run/")

        async def run_exists() -> bool:
            return await actor_row(client.pool, run_id) is not None

        await wait_for(run_exists, what="the triggered run")
        await step("delete", "alpha/tick")

        async def gone() -> bool:
            return not await declared(client, "alpha/tick")

        await wait_for(gone, what="deleted")
        missing = await anyio.to_thread.run_sync(lambda: cli(db_url, "show", "alpha/tick"))
        assert missing.returncode == 1
        assert "no schedule" in missing.stderr


# --- scopes -------------------------------------------------------------------------------------


async def test_a_read_token_cannot_change_and_an_agent_token_touches_only_its_agent(
    client: Client, db_url: str
) -> None:
    reader = await _token(client, ["read"])
    alpha_only = await _token(client, SCOPES, ["alpha"])
    async with worker(db_url), api(db_url) as base:
        for agent in ("alpha", "beta"):
            await create(client, agent, Schedule(name="digest", **DAILY), by=_me())
        for name in ("alpha/digest", "beta/digest"):
            await wait_for(lambda n=name: declared(client, n), what=name)
        body = {"agent": "alpha", "name": "other", "every": "1h"}
        async with session(reader) as http:
            async with http.get(f"{base}/schedules") as r:
                assert len((await r.json())["schedules"]) == 2
            async with http.post(f"{base}/schedules", json=body) as r:
                assert r.status == 403
            async with http.post(f"{base}/schedules/alpha/digest/pause", json={}) as r:
                assert r.status == 403
            async with http.delete(f"{base}/schedules/alpha/digest") as r:
                assert r.status == 403
        async with session(alpha_only) as http:
            async with http.get(f"{base}/schedules") as r:
                assert [s["name"] for s in (await r.json())["schedules"]] == ["alpha/digest"]
            async with http.get(f"{base}/schedules/beta/digest") as r:
                assert r.status == 403
            async with http.post(f"{base}/schedules", json={**body, "agent": "beta"}) as r:
                assert r.status == 403
            for verb in ("pause", "resume", "trigger"):
                async with http.post(f"{base}/schedules/beta/digest/{verb}", json={}) as r:
                    assert r.status == 403, verb
            async with http.delete(f"{base}/schedules/beta/digest") as r:
                assert r.status == 403
            async with http.post(f"{base}/schedules/alpha/digest/pause", json={}) as r:
                assert r.status == 202
    assert await actor_row(client.pool, "schedule/alpha/other") is None
    assert not (await show(client, "beta/digest")).paused


async def test_mcp_lists_schedules_and_an_operator_creates_pauses_triggers_and_deletes(
    client: Client, db_url: str
) -> None:
    server = build(client)
    tools = {t.name for t in await server.list_tools()}
    assert {
        "list_schedules", "pause_schedule", "resume_schedule", "trigger_schedule",
        "create_schedule", "backfill_schedule", "delete_schedule",
    } <= tools  # fmt: skip
    async with worker(db_url):
        with pytest.raises(Exception, match="cron: Bad hour"):  # the tool's error, named
            await server.call_tool(
                "create_schedule",
                {"agent": "alpha", "name": "digest", "schedule": {"cron": "0 25 * * *"}},
            )
        assert await actor_row(client.pool, "schedule/alpha/digest") is None  # nothing stored
        await server.call_tool(
            "create_schedule", {"agent": "alpha", "name": "digest", "schedule": DAILY}
        )
        await wait_for(lambda: declared(client, "alpha/digest"), what="declared")
        listed = await server.call_tool("list_schedules", {})
        assert "alpha/digest" in str(listed)
        await server.call_tool("pause_schedule", {"name": "alpha/digest", "reason": "mcp"})

        async def paused() -> bool:
            return (await show(client, "alpha/digest")).paused

        await wait_for(paused, what="paused")
        triggered = await server.call_tool("trigger_schedule", {"name": "alpha/digest"})
        assert "run/" in str(triggered)
        filled = await server.call_tool(
            "backfill_schedule",
            {
                "name": "alpha/digest",
                "start": "2026-01-01T00:00:00Z",
                "end": "2026-01-03T00:00:00Z",
            },
        )
        assert '"slots": 2' in str(filled) or "'slots': 2" in str(filled), filled
        await server.call_tool("delete_schedule", {"name": "alpha/digest"})

        async def deleted() -> bool:
            return not any(v.name == "alpha/digest" for v in await list_schedules(client))

        await wait_for(deleted, what="deleted")


# --- the console --------------------------------------------------------------------------------

HOSTILE = "<img src=x onerror=window.__owned=1>\u202e"


async def test_the_console_lists_schedules_and_links_a_run_to_its_slot(
    client: Client,
    db_url: str,
    chromium: Path,  # noqa: F811  (the fixture)
) -> None:
    from playwright.async_api import async_playwright

    token = await _token(client)
    async with worker(db_url), api(db_url) as base:
        await create(client, "alpha", Schedule(name="digest", **DAILY), by=_me())
        await wait_for(lambda: declared(client, "alpha/digest"), what="declared")
        run = await trigger(client, "alpha/digest", by=_me(), id="console")

        async def started() -> bool:
            return any(s.run == run for s in (await show(client, "alpha/digest")).recent)

        await wait_for(started, what="the slot recorded")
        await pause(client, "alpha/digest", by=_me(), reason=HOSTILE)

        async def paused() -> bool:
            return (await show(client, "alpha/digest")).paused

        await wait_for(paused, what="paused")
        async with async_playwright() as pw:
            browser = await _launch(pw, chromium)
            page = await _signed_in(browser, base, token)
            await page.wait_for_selector("#nav-schedules")
            await page.click("#nav-schedules")
            box = page.locator("[data-schedule='alpha/digest']")
            await box.wait_for()
            text = await box.inner_text()
            assert "cron 0 9 * * 1-5 (Europe/Berlin)" in text
            assert "paused" in text
            assert "<img src=x" in text  # the reason shown as text, never as markup
            assert await page.evaluate("window.__owned") is None
            await box.locator(f"a[href='#/runs/{run.removeprefix('run/')}']").click()
            await page.wait_for_selector("#run-links:not([hidden])")
            links = await page.inner_text("#run-links")
            assert "started by schedule alpha/digest slot manual-console" in links
            await browser.close()


def _me() -> Any:
    from tests.conftest import person

    return person("tester")
