"""The console in headless Chromium (Debian's, driven by Playwright): sign in, approve a parked
run, watch it finish without reloading; cross-site and CSRF-less writes are refused; a run's
transcript reads as a conversation, hostile text shown as text, its raw events one click away,
a long run's events read a page at a time."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import attrs
import pytest
from aiohttp import web

from tests.conftest import ROOT, wait_for
from tests.test_api import api, refund_agent
from toren import Client
from toren._agent.model import Text, ToolCall
from toren._agent.principal import Principal
from toren._core.codec import message
from toren._surfaces.tokens import SCOPES, create_token
from toren.runs import (
    ApprovalDecided,
    ApprovalRequested,
    ChildFinished,
    ChildStarted,
    ContextCompacted,
    MessageReceived,
    RunCompleted,
    ToolIntended,
    ToolResulted,
    read_run,
    start_run,
)

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
                # The transcript followed the run live: the call, who approved it and why, its
                # result, the output.
                await page.wait_for_selector("#transcript .entry.output >> text=Refunded.")
                assert await page.evaluate("window.__noReload") is True  # no reload happened
                assert await page.inner_text("#run-output") == "Refunded."
                transcript = page.locator("#transcript")
                assert (
                    "My parcel never came; refund me."
                    in await transcript.locator(".entry.input").inner_text()
                )
                card = transcript.locator(".entry.call[data-call=r1]")
                text = await card.inner_text()
                assert "Tool call refund" in text
                assert '"amount": 500' in text
                assert "approval asked" in text
                assert "approved by alice via console" in text
                assert ": parcel lost" in text
                assert await card.locator(".step.result:not(.bad)").count() == 1
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
    from toren._agent.app import load_app

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
                # The call that started the child links to the child's own page.
                child = page.locator("#transcript .step.child").last
                await child.locator("text=completed").wait_for()
                assert "child run of editor" in await child.inner_text()
                ARTIFACTS.mkdir(parents=True, exist_ok=True)
                await page.screenshot(path=str(ARTIFACTS / "console-child.png"), full_page=True)
                await child.locator("a").first.click()
                await page.wait_for_selector("#transcript .entry.input >> text=Input from")
                # The child's page replaces the parent's as its state arrives: wait for it.
                await page.wait_for_function(
                    "document.querySelector('#run-agent')?.innerText === 'editor'",
                    timeout=20_000,
                )
                # The transcript is drawn again as events arrive: wait for it, don't read it once.
                await page.locator("#transcript >> text=a cross-agent call from").wait_for()
            finally:
                await browser.close()
    assert (await read_run(client, run_id)).output == "desk: editor: published 'n'"


# --- the transcript ---------------------------------------------------------------------------


@message("test.later_kind")
@attrs.frozen(kw_only=True)
class LaterKind:
    """An event of a kind the console does not know (as a later version's would be)."""

    note: str


MEGABYTE = "<script>window.__owned=1</script>\x00NUL\udc00" + "m" * 1_000_000
BOB = Principal(kind="token", id="tok-bob", name="bob", via="console")
CAROL = Principal(kind="token", id="tok-carol", name="carol", via="http")


@contextlib.asynccontextmanager
async def _console(client: Client, db_url: str, chromium: Path) -> AsyncIterator[tuple[str, Any]]:
    """The console's address and a page of it signed in with every scope, showing the runs."""
    from playwright.async_api import async_playwright

    _, token = await create_token(client.pool, "alice", scopes=SCOPES)
    async with api(db_url) as base, async_playwright() as pw:
        browser = await _launch(pw, chromium)
        try:
            page = await _signed_in(browser, base, token)
            await page.wait_for_selector("#runs-body tr")
            yield base, page
        finally:
            await browser.close()


async def _journal_run(client: Client, agent: str, events: list[Any]) -> str:
    """A run of ``agent`` whose journal holds ``events`` (written as the run writes them)."""
    from tests.test_sandbox_surfaces import new_id, new_run  # that module imports this one

    return await new_run(client, new_id(), agent, events)


async def test_the_transcript_reads_as_a_conversation_and_shows_hostile_text_as_text(
    client: Client, db_url: str, chromium: Path
) -> None:
    from tests.test_sandbox_surfaces import called

    child = await _journal_run(client, "tr-helper", [RunCompleted(output="helped")])
    lookup = ToolCall(id="k1", name="lookup", arguments={"order": "A-17"})
    fetch = ToolCall(id="k2", name="fetch_page", arguments={"url": "http://example.invalid/"})
    ask = ToolCall(id="k3", name="call_helper", arguments={"task": "help"})
    run_id = await _journal_run(
        client,
        "tr-scribe",
        [
            called(1, Text(text="Let me look that up."), lookup),
            ToolIntended(
                call_id="k1", name="lookup", arguments={"order": "A-17"}, idempotency_key="a"
            ),
            ToolResulted(call_id="k1", content="no such order", is_error=True),
            MessageReceived(
                text="<img src=x onerror=window.__owned=2> it is A-71",
                who="carol",
                channel="http",
                by=CAROL,
            ),
            called(2, fetch),
            ApprovalRequested(call_id="k2", name="fetch_page", arguments=fetch.arguments or {}),
            ApprovalDecided(
                call_id="k2",
                approved=True,
                who="bob",
                reason="looks safe",
                channel="console",
                by=BOB,
            ),
            ToolIntended(call_id="k2", name="fetch_page", arguments={}, idempotency_key="b"),
            ToolResulted(call_id="k2", content=MEGABYTE, truncated_from=2_000_000),
            ContextCompacted(
                tier="soft",
                reason="threshold",
                after_calls=2,
                base=3,
                prefix=(),
                tokens_before=9000,
                tokens_after=2000,
                elided=1,
            ),
            LaterKind(note="shown without code for it"),
            called(3, ask),
            ChildStarted(call_id="k3", run_id=child, agent="tr-helper", at=time.time()),
            ChildFinished(
                call_id="k3",
                run_id=child,
                agent="tr-helper",
                status="completed",
                output="helped",
                usd_paid="0.0001",
                calls_made=1,
                at=time.time(),
            ),
            ToolResulted(call_id="k3", content="helped"),
            called(4, Text(text="Order A-71 is on its way.")),
            RunCompleted(output="Order A-71 is on its way."),
        ],
    )
    async with _console(client, db_url, chromium) as (base, page):
        await page.goto(f"{base}/#/runs/{run_id.removeprefix('run/')}")
        await page.wait_for_selector("#transcript .entry.output >> text=Order A-71")
        t = page.locator("#transcript")
        assert "build it" in await t.locator(".entry.input").inner_text()
        said = await t.locator(".entry.assistant").all_inner_texts()
        assert "Let me look that up." in said[0]
        assert "Order A-71 is on its way." in said[3]
        # A failed call is marked as an error, with its arguments and what it returned.
        first = t.locator(".entry.call[data-call=k1]")
        assert '"order": "A-17"' in await first.locator("pre.args").inner_text()
        assert await first.locator(".step.result.bad .state").inner_text() == "error"
        assert await first.locator(".step.result pre").inner_text() == "no such order"
        human = await t.locator(".entry.human").inner_text()
        assert "Message from carol via http (token tok-carol)" in human
        assert "<img src=x onerror=window.__owned=2> it is A-71" in human
        # Who decided: the principal, its stable id, the reason.
        approved = await t.locator(".entry.call[data-call=k2] .step.approved").inner_text()
        assert approved.startswith("approved by bob via console (token tok-bob): looks safe")
        # A megabyte of markup, a NUL and a lone surrogate: text, cut, shown whole on demand.
        content = t.locator(".entry.call[data-call=k2] .step.result pre.content")
        shown = await content.text_content() or ""
        assert shown.startswith("<script>window.__owned=1</script>\\x00NUL\\udc00mmm")
        assert len(shown) < 3000
        assert f"show all ({len(MEGABYTE):,} characters)" in shown
        assert (
            "cut from 2000000 bytes"
            in await t.locator(".entry.call[data-call=k2] .step.result").inner_text()
        )
        await content.locator("button.show-all").click()
        await wait_for(
            lambda: content.evaluate("(e) => e.textContent.length > 1_000_000"),
            what="the whole result shown",
        )
        assert await t.locator("script, img").count() == 0
        assert await page.evaluate("window.__owned") is None
        assert "Context compacted (soft)" in await t.locator(".entry.note").first.inner_text()
        # A kind the page does not know shows by its name and data.
        later = await t.locator(".entry.other").inner_text()
        assert later.startswith("test.later_kind")
        assert "shown without code for it" in later
        child_step = t.locator(".entry.call[data-call=k3] .step.child").last
        assert "child run of tr-helper completed" in await child_step.inner_text()
        href = await child_step.locator("a").get_attribute("href")
        assert href == f"#/runs/{child.removeprefix('run/')}"
        # The raw JSON of an event is one click away (and written only then).
        step = t.locator(".entry.call[data-call=k2] .step.approved")
        assert await step.locator("pre.json").count() == 0
        await step.locator("details.raw summary").click()
        raw = await step.locator("pre.json").inner_text()
        assert '"type": "approval.decided"' in raw
        assert '"id": "tok-bob"' in raw
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        await page.screenshot(path=str(ARTIFACTS / "console-transcript.png"), full_page=True)


async def test_a_long_runs_events_are_read_a_page_at_a_time_then_followed_live(
    client: Client, db_url: str, chromium: Path
) -> None:
    from tests.test_sandbox_surfaces import write

    notes = [
        MessageReceived(text=f"note {i}", who="carol", channel="http", by=CAROL)
        for i in range(1204)
    ]
    run_id = await _journal_run(client, "tr-long", notes)  # 1205 events with its start
    uuid = run_id.removeprefix("run/")
    async with _console(client, db_url, chromium) as (base, page):
        reads: list[str] = []
        page.on("request", lambda r: reads.append(r.url) if "/events" in r.url else None)
        await page.goto(f"{base}/#/runs/{uuid}")
        await page.wait_for_selector("#more:not([hidden])")
        # One page: the first thousand events, and no stream yet.
        assert await page.locator("#transcript .entry").count() == 1000
        assert reads == [f"{base}/runs/{uuid}/events?after=0"]
        await page.click("#more-button")
        await page.wait_for_selector("#transcript .entry >> nth=1204")
        assert await page.locator("#more").is_hidden()
        assert f"{base}/runs/{uuid}/events?after=1000" in reads
        # Then live: an event appended now shows, a kind the page does not know included
        # (an EventSource would not have heard it).
        await write(client, run_id, [LaterKind(note="appended live")])
        await page.wait_for_selector("#transcript .entry.other >> text=appended live")
        assert await page.locator("#transcript .entry").count() == 1206


async def test_an_announced_model_call_shows_until_answered_and_a_lost_one_stays(
    client: Client, db_url: str, chromium: Path
) -> None:
    from tests.test_sandbox_surfaces import MODEL, called, write
    from toren.runs import ModelCalling, ModelLost

    def calling(step: int) -> ModelCalling:
        return ModelCalling(step=step, model=MODEL, input_tokens=1200, cost_usd="0.0036")

    run_id = await _journal_run(
        client,
        "tr-lost",
        [
            calling(1),
            ModelLost(step=1, model=MODEL, count=1, input_tokens=1200, cost_usd="0.0036"),
            called(1, Text(text="First answer.")),
            calling(2),
        ],
    )
    async with _console(client, db_url, chromium) as (base, page):
        await page.goto(f"{base}/#/runs/{run_id.removeprefix('run/')}")
        t = page.locator("#transcript")
        # The call lost in flight is on the transcript with its estimated cost; the answered
        # announcement is not; the one still waiting is.
        pending = t.locator(".entry.calling")
        await pending.wait_for()
        assert await t.locator(".entry.calling").count() == 1
        assert (await pending.inner_text()).startswith(f"Calling {MODEL} for step 2")
        lost = await t.locator(".entry.bad").inner_text()
        assert lost.startswith(
            f"1 model call(s) lost in flight at step 1 · {MODEL} · about $0.0036"
        )
        # The receipt counts it apart from what was paid, as an estimate.
        receipt = page.locator("#receipt")
        await receipt.locator("dt >> text=lost in flight").wait_for()
        assert "1 call(s), about $0.0036 estimated, not in paid" in await receipt.inner_text()
        await write(client, run_id, [called(2, Text(text="Second answer."))])
        await t.locator(".entry.assistant >> text=Second answer.").wait_for()
        assert await t.locator(".entry.calling").count() == 0


async def test_a_waiting_calls_bidi_controls_show_as_escapes_where_it_is_decided(
    client: Client, db_url: str, chromium: Path
) -> None:
    from tests.test_sandbox_surfaces import called

    # "Trojan Source" in a call's arguments: U+202E would show the path reversed beside Approve.
    hidden = ToolCall(
        id="h2", name="run_script", arguments={"path": "/home/\u202efdp.sh; rm -rf ~"}
    )
    run_id = await _journal_run(
        client,
        "tr-bidi",
        [
            called(1, ToolCall(id="h1", name="look\u202eup", arguments={})),
            ToolIntended(call_id="h1", name="look\u202eup", arguments={}, idempotency_key="a"),
            ToolResulted(call_id="h1", content="found"),
            called(2, hidden),
            ApprovalRequested(call_id="h2", name="run_script", arguments=hidden.arguments or {}),
        ],
    )
    async with _console(client, db_url, chromium) as (base, page):
        await page.goto(f"{base}/#/runs/{run_id.removeprefix('run/')}")
        await page.wait_for_selector("#decision:not([hidden])")
        await page.wait_for_selector("#timeline svg rect")
        what = await page.inner_text("#decision-what")
        assert "\u202e" not in what, f"the decision panel shows a raw U+202E: {what!r}"
        assert '"/home/\\u202efdp.sh; rm -rf ~"' in what
        # Nowhere on the page (the timeline's labels included) is the raw character shown.
        shown = await page.evaluate("document.body.textContent")
        assert "\u202e" not in shown, "the page shows a raw U+202E"
        assert "look\\u202eup" in await page.inner_html("#timeline")


async def test_cancelled_runs_have_a_filter_and_a_badge_of_their_own(
    client: Client, db_url: str, chromium: Path
) -> None:
    from toren.runs import RunFailed

    cancel = RunFailed(error_class="cancelled", message="cancelled by carol: duplicate", by=CAROL)
    run_id = await _journal_run(client, "tr-stopped", [cancel])
    await _journal_run(client, "tr-broken", [RunFailed(error_class="tool", message="broke")])
    async with _console(client, db_url, chromium) as (base, page):
        await page.select_option("#status-filter", "cancelled")
        await page.wait_for_selector("#runs-body tr:only-child .badge.cancelled")
        assert await page.inner_text("#runs-body") == await page.inner_text("#runs-body tr")
        assert "tr-stopped" in await page.inner_text("#runs-body tr")
        await page.select_option("#status-filter", "")
        await page.wait_for_selector("#runs-body .badge.failed")
        colour = "(s) => getComputedStyle(document.querySelector(s)).backgroundColor"
        cancelled_colour = await page.evaluate(colour, "#runs-body .badge.cancelled")
        assert cancelled_colour != await page.evaluate(colour, "#runs-body .badge.failed")
        assert cancelled_colour != await page.evaluate(colour, "#run-status")  # not the default
        await page.goto(f"{base}/#/runs/{run_id.removeprefix('run/')}")
        await page.wait_for_selector("#run-status.cancelled >> text=cancelled")
        await page.wait_for_selector("#transcript .entry.bad >> text=Cancelled, by carol")
        await page.wait_for_selector("#timeline svg line title", state="attached")
        assert "<title>cancelled</title>" in await page.inner_html("#timeline")  # the end mark
