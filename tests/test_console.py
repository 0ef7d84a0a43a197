"""The console in headless Chromium (Debian's, driven by Playwright): sign in, approve a parked
run, watch it finish without reloading; cross-site and CSRF-less writes are refused."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from tests.conftest import ROOT, wait_for
from tests.test_api import api, refund_agent
from toren import Client
from toren._tokens import SCOPES, create_token
from toren.runs import read_run, start_run

pytestmark = pytest.mark.anyio

CHROMIUM = Path("/usr/bin/chromium")
ARTIFACTS = Path(os.environ.get("TOREN_TEST_ARTIFACTS", ROOT / "test-artifacts"))


@pytest.fixture
def chromium() -> Path:
    if not CHROMIUM.exists():
        reason = "Chromium is not installed (apt-get install chromium); .ci/run installs it"
        if os.environ.get("CI") == "true":
            pytest.fail(reason)
        pytest.skip(reason)
    return CHROMIUM


async def _launch(pw: Any, chromium: Path) -> Any:
    # Root in a container: Chromium's sandbox needs user namespaces it does not get here.
    return await pw.chromium.launch(executable_path=str(chromium), args=["--no-sandbox"])


async def _signed_in(browser: Any, base: str, token: str) -> Any:
    """A new page of the console, signed in with ``token`` through its form."""
    page = await browser.new_page(viewport={"width": 1200, "height": 900})
    await page.goto(base)
    await page.fill("input[name=token]", token)
    await page.click("button[type=submit]")
    return page


async def _status(client: Client, run_id: str) -> str:
    return (await read_run(client, run_id)).status


async def test_sign_in_approve_a_parked_run_and_watch_it_finish(
    client: Client, db_url: str, monkeypatch: pytest.MonkeyPatch, chromium: Path
) -> None:
    from playwright.async_api import async_playwright

    _, token = await create_token(client.pool, "alice", scopes=SCOPES)
    async with refund_agent(monkeypatch, db_url), api(db_url) as base:
        run_id = await start_run(client, "support", "My parcel never came; refund me.")
        await wait_for(lambda: _parked(client, run_id), what="parked")
        async with async_playwright() as pw:
            browser = await _launch(pw, chromium)
            try:
                page = await _signed_in(browser, base, token)
                await page.wait_for_selector("#runs-body tr .badge.parked")
                await page.click("#runs-body tr")
                await page.wait_for_selector("#decision:not([hidden])")
                await page.wait_for_selector("#timeline svg rect")
                await page.evaluate("window.__noReload = true")
                await page.fill("#decision-reason", "parcel lost")
                await page.click("#approve")
                await page.wait_for_selector("#run-status.completed", timeout=20_000)
                # The status comes from a read of the run, the events table from the stream:
                # either may show first, so each is waited for.
                await page.wait_for_selector("#events-body >> text=approval.decided")
                await page.wait_for_selector("#events-body >> text=run.completed")
                assert await page.evaluate("window.__noReload") is True  # no reload happened
                assert await page.inner_text("#run-output") == "Refunded."
                ARTIFACTS.mkdir(parents=True, exist_ok=True)
                await page.screenshot(path=str(ARTIFACTS / "console-run.png"), full_page=True)
                cookies = await page.context.cookies()
            finally:
                await browser.close()
    [session] = [c for c in cookies if c["name"] == "toren_session"]
    assert session["httpOnly"] is True
    assert session["sameSite"] == "Strict"
    [decision] = (await read_run(client, run_id)).decisions.values()
    assert (decision.who, decision.channel, decision.reason) == ("alice", "console", "parcel lost")


async def _parked(client: Client, run_id: str) -> bool:
    return await _status(client, run_id) == "parked"


async def test_cross_site_and_csrf_less_writes_are_refused(
    client: Client, db_url: str, chromium: Path
) -> None:
    from playwright.async_api import async_playwright

    _, token = await create_token(client.pool, "alice", scopes=SCOPES)
    run_id = await start_run(client, "support", "hello")
    uuid = run_id.removeprefix("run/")
    async with api(db_url) as base:
        # Another origin (same host, another port) serves a page that posts a form to Toren.
        evil = web.Application()
        form = (
            f'<form id="f" method="post" action="{base}/runs/{uuid}/cancel">'
            '<input name="reason" value="pwned"></form>'
            "<script>document.getElementById('f').submit()</script>"
        )

        async def page_(request: web.Request) -> web.Response:
            return web.Response(text=form, content_type="text/html")

        evil.router.add_get("/", page_)
        runner = web.AppRunner(evil)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        evil_url = f"http://127.0.0.1:{runner.addresses[0][1]}/"
        try:
            async with async_playwright() as pw:
                browser = await pw.chromium.launch(
                    executable_path=str(chromium), args=["--no-sandbox"]
                )
                try:
                    page = await browser.new_page()
                    await page.goto(base)
                    await page.fill("input[name=token]", token)
                    await page.click("button[type=submit]")
                    await page.wait_for_selector("#runs-body tr")
                    async with page.expect_response(f"{base}/runs/{uuid}/cancel") as answer:
                        await page.goto(evil_url)
                    refused = await answer.value
                    assert refused.status in (401, 403)
                    cookie = next(
                        c["value"]
                        for c in await page.context.cookies()
                        if c["name"] == "toren_session"
                    )
                finally:
                    await browser.close()
        finally:
            await runner.cleanup()
        # A same-origin write with the session cookie but without the CSRF token.
        async with aiohttp.ClientSession(cookies={"toren_session": cookie}) as http:
            async with http.get(f"{base}/session") as r:
                csrf = (await r.json())["csrf"]
            async with http.post(f"{base}/runs/{uuid}/cancel", json={}) as r:
                assert r.status == 403
            headers = {"X-CSRF-Token": csrf, "Origin": "http://evil.example"}
            async with http.post(f"{base}/runs/{uuid}/cancel", json={}, headers=headers) as r:
                assert r.status == 403
            async with http.post(
                f"{base}/runs/{uuid}/cancel", json={}, headers={"X-CSRF-Token": csrf}
            ) as r:
                assert r.status == 202  # the real console's write goes through
    kinds = [r["kind"] for r in await client.pool.fetch("SELECT kind FROM toren.mailbox")]
    assert kinds.count("run.cancel") == 1


async def test_a_childs_approval_is_decided_on_its_parents_page(
    client: Client, db_url: str, monkeypatch: pytest.MonkeyPatch, chromium: Path
) -> None:
    from playwright.async_api import async_playwright

    from tests.conftest import running_worker
    from tests.test_calls import Plan, model, publisher, relay
    from toren._app import load_app

    load_app("tests.calls_app")
    plan: Plan = {
        "desk": relay("desk", "call_editor", "the news", "e1"),
        "editor": publisher,
    }
    # Limited to the child's agent: it decides the child's call, from the parent's page.
    _, token = await create_token(client.pool, "ed", scopes=["read", "approve"], agents=["editor"])
    async with model(plan, monkeypatch), running_worker(db_url), api(db_url) as base:
        run_id = await start_run(client, "desk", "publish the news")
        async with async_playwright() as pw:
            browser = await _launch(pw, chromium)
            try:
                page = await _signed_in(browser, base, token)
                await page.wait_for_selector("#runs-body tr")
                await page.goto(f"{base}/#/runs/{run_id.removeprefix('run/')}")
                await page.wait_for_selector("#decision:not([hidden])", timeout=20_000)
                await page.wait_for_selector("#decision-controls:not([hidden])")
                assert "child run" in await page.inner_text("#decision-what")
                assert "editor" in await page.inner_text("#run-links")
                await page.click("#approve")
                await page.wait_for_selector("#run-status.completed", timeout=20_000)
                await page.wait_for_selector("#events-body >> text=child.finished")
                ARTIFACTS.mkdir(parents=True, exist_ok=True)
                await page.screenshot(path=str(ARTIFACTS / "console-child.png"), full_page=True)
            finally:
                await browser.close()
    assert (await read_run(client, run_id)).output == "desk: editor: published 'n'"
