"""Forks on the surfaces: `toren jobs fork`, `POST /runs/{id}/fork` and the console's "Fork
from here", against a real worker and a counting model server; every bad fork refused with
nothing stored; a `read` token refused."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import pytest

from tests import run_app
from tests.conftest import ROOT, running_worker, wait_for
from tests.test_api import api, session
from tests.test_cli import toren
from tests.test_console import (  # noqa: F401  (chromium: a fixture)
    ARTIFACTS,
    _launch,
    _signed_in,
    chromium,
)
from tests.test_sandbox_surfaces import called, new_id, new_run
from toren import Client
from toren._agent.app import load_app
from toren._agent.model import Text, ToolCall
from toren._agent.principal import Principal
from toren._surfaces.tokens import create_token
from toren.runs import (
    MessageReceived,
    RunCompleted,
    ToolIntended,
    ToolResulted,
    read_run,
)
from toren.testing import AnthropicServer, Reply

pytestmark = pytest.mark.anyio

CAP = 64 * 1024  # max_message_bytes, as the API and the CLI run here


def _answer(request: dict[str, Any], n: int) -> Reply:
    """Two tickets, then done: the answer depends only on how far the conversation is."""
    turns = sum(m["role"] == "assistant" for m in request["messages"])
    if turns < 2:
        return Reply([ToolCall(id=f"t{turns + 1}", name="create_ticket", arguments={"title": "x"})])
    return Reply("Done.")


@contextlib.asynccontextmanager
async def _ticket_agent(
    monkeypatch: pytest.MonkeyPatch, db_url: str
) -> AsyncIterator[AnthropicServer]:
    """A worker running `support`, whose model makes three calls (two tickets, then done)."""
    load_app("tests.run_app")
    run_app.applied.clear()
    async with AnthropicServer(_answer) as server:
        for name, value in server.env().items():
            monkeypatch.setenv(name, value)
        async with running_worker(db_url):
            yield server


async def _completed(client: Client, run_id: str) -> bool:
    return (await read_run(client, run_id)).status == "completed"


async def _journal(client: Client, run_id: str) -> list[tuple[int, str, str]]:
    rows = await client.pool.fetch(
        "SELECT seq, type, data::text FROM toren.journal WHERE actor_id = $1 ORDER BY seq", run_id
    )
    return [(r["seq"], r["type"], r["data"]) for r in rows]


async def _stored(client: Client) -> tuple[int, int, int]:
    """Actors, journal rows and mailbox rows: what a refused fork must not add to."""
    return (
        await client.pool.fetchval("SELECT count(*) FROM toren.actors"),
        await client.pool.fetchval("SELECT count(*) FROM toren.journal"),
        await client.pool.fetchval("SELECT count(*) FROM toren.mailbox"),
    )


def _toren(db_url: str, *args: str) -> subprocess.CompletedProcess[str]:
    return toren(*args, db_url=db_url)


async def test_forks_from_the_cli_and_the_api_replay_their_prefix_and_pay_only_from_the_step(
    client: Client, db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, token = await create_token(client.pool, "olga", scopes=["read", "operate"])
    async with (
        _ticket_agent(monkeypatch, db_url) as server,
        api(db_url) as base,
        session(token) as http,
    ):
        async with http.post(f"{base}/runs", json={"agent": "support", "input": "go"}) as r:
            source = (await r.json())["id"]
        await wait_for(lambda: _completed(client, source), what="the source completed")
        assert len(server.requests) == 3
        before = await _journal(client, source)
        # From the CLI, by a prefix of the id: step 3 made again, the two before replayed.
        prefix = source.removeprefix("run/")[:12]
        cli = await anyio.to_thread.run_sync(
            lambda: _toren(db_url, "jobs", "fork", prefix, "--at", "3", "--json")
        )
        assert cli.returncode == 0, cli.stderr
        shown = json.loads(cli.stdout)
        by_cli = shown["id"]
        paid = (await read_run(client, source)).kept_cost[1]  # its first two calls
        assert paid > 0
        assert shown["forked_from"] == {
            "run": source,
            "step": 3,
            "calls_replayed": 2,
            "usd_not_repaid": str(paid),
        }
        await wait_for(lambda: _completed(client, by_cli), what="the CLI's fork completed")
        assert len(server.requests) == 4  # only step 3 paid again
        # From the API: step 2 made again with another input.
        body = {"at": 2, "input": "go again"}
        async with http.post(f"{base}/runs/{source[4:]}/fork", json=body) as r:
            assert r.status == 201, await r.text()
            made = await r.json()
        by_api = made["id"]
        assert made["forked_from"]["run"] == source
        assert (made["forked_from"]["step"], made["forked_from"]["calls_replayed"]) == (2, 1)
        await wait_for(lambda: _completed(client, by_api), what="the API's fork completed")
        assert len(server.requests) == 6  # steps 2 and 3 of the fork
        async with http.get(f"{base}/runs/{by_api[4:]}") as r:
            run = await r.json()
        assert run["forked_from"]["run"] == source
        assert (run["input"], run["output"]) == ("go again", "Done.")
        async with http.get(f"{base}/runs/{source[4:]}") as r:
            assert (await r.json())["forked_from"] is None
    # Both forks name their origin first on their timeline; the source is untouched.
    show = await anyio.to_thread.run_sync(lambda: _toren(db_url, "jobs", "show", by_cli))
    assert show.returncode == 0, show.stderr
    first = show.stdout.splitlines()[0]
    assert first == f"forked from {source} at step 3 (2 calls replayed, ${paid} not paid again)"
    assert await _journal(client, source) == before
    forked = [e for e in await client.journal(by_api) if e.type == "run.forked"]
    assert len(forked) == 1
    assert forked[0].data["by"]["name"] == "olga"


async def _source(client: Client) -> str:
    """A completed run of two model calls, a human message between them (written as a run
    writes its journal: no worker needed to fork it)."""
    who = Principal(kind="token", id="tok-carol", name="carol", via="http")
    ticket = ToolCall(id="k1", name="create_ticket", arguments={"title": "x"})
    return await new_run(
        client,
        new_id(),
        "support",
        [
            called(1, ticket),
            ToolIntended(
                call_id="k1", name="create_ticket", arguments={"title": "x"}, idempotency_key="a"
            ),
            ToolResulted(call_id="k1", content="ticket"),
            MessageReceived(text="the parcel is blue", who="carol", channel="http", by=who),
            called(2, Text(text="Noted.")),
            RunCompleted(output="Noted."),
        ],
    )


async def test_bad_forks_are_refused_over_http_and_nothing_is_stored(
    client: Client, db_url: str
) -> None:
    source = await _source(client)
    uuid = source.removeprefix("run/")
    _, operator = await create_token(client.pool, "olga", scopes=["read", "operate"])
    _, reader = await create_token(client.pool, "rita", scopes=["read"])
    stored = await _stored(client)
    bad: list[tuple[Any, str]] = [
        ({"at": "2"}, "at"),
        ({"at": 1.5}, "at"),
        ({"at": True}, "at"),
        ({"at": 0}, "at"),
        ({"at": 3}, "at"),  # past the end: the run made two calls
        ({"at": 2**40}, "at"),
        ({}, "at"),
        ({"at": 2, "message": "a\x00b"}, "message"),
        ({"at": 2, "input": "x" * (CAP + 1)}, "input"),
        ({"at": 2, "message": "m", "input": "i"}, "message"),
        ({"at": 2, "colour": "red"}, "colour"),
    ]
    async with api(db_url) as base:
        async with session(operator) as http:
            for body, field in bad:
                async with http.post(f"{base}/runs/{uuid}/fork", json=body) as r:
                    problem = await r.json()
                    assert r.status == 422, (body, problem)
                assert field in [e["field"] for e in problem["errors"]], (body, problem)
            # A lone surrogate, which JSON can carry as an escape.
            raw = b'{"at": 2, "message": "a\\ud800b"}'
            headers = {"Content-Type": "application/json"}
            async with http.post(f"{base}/runs/{uuid}/fork", data=raw, headers=headers) as r:
                assert r.status == 422, await r.text()
            async with http.post(f"{base}/runs/{new_id()[4:]}/fork", json={"at": 1}) as r:
                assert r.status == 404
        async with (
            session(reader) as http,
            http.post(f"{base}/runs/{uuid}/fork", json={"at": 1}) as r,
        ):
            assert r.status == 403
            assert "lacks the 'operate' scope" in (await r.json())["detail"]
    assert await _stored(client) == stored


async def test_bad_forks_are_refused_by_the_cli_with_exit_2_and_nothing_is_stored(
    client: Client, db_url: str
) -> None:
    source = await _source(client)
    stored = await _stored(client)
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOREN_")}
    env |= {"PYTHONPATH": str(ROOT), "TOREN_DATABASE_URL": db_url}

    def fork(*args: str | bytes) -> subprocess.CompletedProcess[bytes]:
        return subprocess.run(
            [sys.executable, "-m", "toren", "jobs", "fork", *args],
            env=env,
            cwd=ROOT,
            capture_output=True,
            timeout=60,
            check=False,
        )

    cases: list[tuple[tuple[str | bytes, ...], str]] = [
        ((source, "--at", "two"), "'two' is not a valid integer"),
        ((source, "--at", "0"), "--at"),
        ((source, "--at", "3"), "step 3"),
        ((source, "--at", "2", "--message", "m", "--input", "i"), "not both"),
        ((source, "--at", "2", "--message", b"a\xffb"), "surrogate"),
        ((source, "--at", "2", "--input", "x" * (CAP + 1)), "over the cap"),
        ((new_id(), "--at", "1"), "no run"),
        ((source,), "--at"),
    ]
    for args, said in cases:
        result = await anyio.to_thread.run_sync(lambda args=args: fork(*args))
        stderr = result.stderr.decode(errors="replace")
        assert result.returncode == 2, (args[1:], stderr)
        assert said in stderr, (args[1:], stderr)
    assert await _stored(client) == stored
    # A good one: the new run's id alone on stdout, what it replayed on stderr.
    made = await anyio.to_thread.run_sync(
        lambda: fork(source[4:12], "--at", "2", "--message", "the parcel is red")
    )
    assert made.returncode == 0, made.stderr
    fork_id = made.stdout.decode().strip()
    [forked] = [e for e in await client.journal(fork_id) if e.type == "run.forked"]
    assert (forked.data["source"], forked.data["message"]) == (source, "the parcel is red")
    line = f"forked from {source} at step 2 (1 call replayed, $0.000105 not paid again)"
    assert line in made.stderr.decode()


async def test_the_console_forks_from_a_model_call_with_an_edited_message(
    client: Client,
    db_url: str,
    chromium: Path,  # noqa: F811  (the fixture imported above)
) -> None:
    from playwright.async_api import async_playwright

    source = await _source(client)
    _, operator = await create_token(client.pool, "olga", scopes=["read", "operate"])
    _, reader = await create_token(client.pool, "rita", scopes=["read"])
    async with api(db_url) as base, async_playwright() as pw:
        browser = await _launch(pw, chromium)
        try:
            # A read-only session is offered no fork.
            page = await _signed_in(browser, base, reader)
            await page.wait_for_selector("#runs-body tr")
            await page.goto(f"{base}/#/runs/{source}")
            await page.wait_for_selector("#events-body tr >> text=model.called")
            assert await page.locator("button.fork-here").count() == 0
            await page.close()
            page = await _signed_in(browser, base, operator)
            await page.wait_for_selector("#runs-body tr")
            await page.goto(f"{base}/#/runs/{source}")
            await page.click("button.fork-here[data-step='2']")
            await page.wait_for_selector("#fork-form:not([hidden])")
            assert await page.input_value("#fork-text") == "the parcel is blue"
            await page.fill("#fork-text", "the parcel is red")
            await page.click("#fork-submit")
            await page.wait_for_selector("#run-links >> text=forked from")
            fork = "run/" + page.url.rsplit("/", 1)[1]
            assert fork != source
            assert f"forked from {source} at step 2" in await page.inner_text("#run-links")
            # Its copied call is drawn as replayed from the journal, not paid.
            await page.wait_for_selector("#timeline rect[fill='var(--replayed)']")
            ARTIFACTS.mkdir(parents=True, exist_ok=True)
            await page.screenshot(path=str(ARTIFACTS / "console-fork.png"), full_page=True)
        finally:
            await browser.close()
    [forked] = [e for e in await client.journal(fork) if e.type == "run.forked"]
    assert (forked.data["source"], forked.data["step"]) == (source, 2)
    assert forked.data["message"] == "the parcel is red"
    assert forked.data["by"]["name"] == "olga"
