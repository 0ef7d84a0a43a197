"""What a console session may do besides approving, in headless Chromium: a token with
`operate` starts a run, sends it a message, cancels it and retries a failed one from the page;
a read-only token is offered none of it and the API refuses it (403) when the page is bypassed.
A run's page opens from the id the CLI prints (`#/runs/run/<uuid>`)."""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import wait_for
from tests.test_api import api, refund_agent
from tests.test_console import (  # noqa: F401  (chromium: a fixture)
    ARTIFACTS,
    _console,
    _journal_run,
    _launch,
    _signed_in,
    chromium,
)
from toren import Client
from toren._surfaces.tokens import create_token
from toren.runs import RunCompleted, read_run, start_run
from toren.testing import Fail, Reply

pytestmark = pytest.mark.anyio

OUTAGE = "report the outage"


def _outage(refused: list[int]) -> Callable[[dict[str, Any], int], Reply | Fail | None]:
    """The model's answers to a run on OUTAGE: the provider refuses its first request (the run
    fails), then it answers; to any other run, nothing (the refund goes on)."""

    def answer(request: dict[str, Any], n: int) -> Reply | Fail | None:
        if OUTAGE not in json.dumps(request["messages"][0]):
            return None
        if not refused:
            refused.append(n)
            return Fail(status=400, message="scripted outage")
        return Reply("Recovered.")

    return answer


async def _status(client: Client, run_id: str, status: str) -> bool:
    return (await read_run(client, run_id)).status == status


# Writes posted from the page's own script with the session's CSRF token, as the page would:
# the answer's status and detail, for each.
_WRITES = """async ([uuid]) => {
  const me = await (await fetch("/session")).json();
  const post = async (path, body) => {
    const r = await fetch(path, { method: "POST", body: JSON.stringify(body),
      headers: { "Content-Type": "application/json", "X-CSRF-Token": me.csrf } });
    return [path, r.status, (await r.json()).detail];
  };
  return [
    await post("/runs", { agent: "support", input: "started by a reader" }),
    await post(`/runs/${uuid}/messages`, { text: "from a reader" }),
    await post(`/runs/${uuid}/cancel`, {}),
    await post(`/runs/${uuid}/retry`, {}),
  ];
}"""


async def test_an_operate_token_starts_sends_cancels_and_retries_and_a_read_token_cannot(
    client: Client,
    db_url: str,
    monkeypatch: pytest.MonkeyPatch,
    chromium: Path,  # noqa: F811  (the fixture imported above)
) -> None:
    from playwright.async_api import async_playwright

    operator_id, operator = await create_token(client.pool, "olga", scopes=["read", "operate"])
    _, reader = await create_token(client.pool, "rita", scopes=["read"])
    async with refund_agent(monkeypatch, db_url, first=_outage([])), api(db_url) as base:
        broken = await start_run(client, "support", OUTAGE)
        await wait_for(lambda: _status(client, broken, "failed"), what="failed on a 400")
        broken_uuid = broken.removeprefix("run/")
        async with async_playwright() as pw:
            browser = await _launch(pw, chromium)
            try:
                # A read-only session: offered nothing to start or steer, and refused by the
                # API when it tries anyway.
                page = await _signed_in(browser, base, reader)
                await page.wait_for_selector("#runs-body tr")
                assert await page.locator("#start").is_hidden()
                assert "operate" in await page.inner_text("#start-not-allowed")
                await page.goto(f"{base}/#/runs/{broken_uuid}")
                await page.wait_for_selector("#run-status.failed")
                assert await page.locator("#steer-controls").is_hidden()
                assert "operate" in await page.inner_text("#steer-not-allowed")
                refused = await page.evaluate(_WRITES, [broken_uuid])
                assert [status for _, status, _ in refused] == [403] * 4, refused
                for path, _, detail in refused:
                    assert "lacks the 'operate' scope" in detail, path
                await page.close()
                # An operating session: start a run from the list page.
                page = await _signed_in(browser, base, operator)
                await page.wait_for_selector("#start:not([hidden])")
                await page.fill("#start-agent", "support")
                await page.fill("#start-input", "My parcel never came; refund me.")
                await page.click("#start-button")
                await page.wait_for_selector("#run-status.parked", timeout=20_000)
                started = "run/" + page.url.rsplit("/", 1)[1]
                assert await page.inner_text("#run-input") == "My parcel never came; refund me."
                assert await page.locator("#decision-controls").is_hidden()  # no approve scope
                # Send it a message.
                await page.fill("#message-text", "please hurry")
                await page.click("#send")
                await page.wait_for_selector("#transcript .entry.human >> text=please hurry")
                assert await page.input_value("#message-text") == ""
                ARTIFACTS.mkdir(parents=True, exist_ok=True)
                await page.screenshot(path=str(ARTIFACTS / "console-operate.png"), full_page=True)
                # Cancel it: it ends, and offers neither cancel nor retry any more.
                await page.fill("#steer-reason", "sent by mistake")
                await page.click("#cancel")
                await page.wait_for_selector(
                    "#run-status.failed, #run-status.cancelled", timeout=20_000
                )
                await page.wait_for_selector("#cancel-form", state="hidden")
                assert await page.locator("#retry").is_hidden()
                # Retry the failed run, opened by the id as the CLI prints it.
                await page.goto(f"{base}/#/runs/{broken}")
                await page.wait_for_selector("#retry:not([hidden])")
                assert await page.locator("#message-form").is_hidden()  # failed: retry first
                await page.click("#retry")
                await page.wait_for_selector("#run-status.completed", timeout=20_000)
                assert await page.inner_text("#run-output") == "Recovered."
            finally:
                await browser.close()
    # Each write is recorded with the operating token as its principal, via the console.
    steered = await read_run(client, started)
    [said] = [e for e in await client.journal(started) if e.type == "message.received"]
    assert (said.data["text"], said.data["who"], said.data["channel"]) == (
        "please hurry",
        "olga",
        "console",
    )
    assert said.data["by"]["id"] == operator_id
    assert steered.error_class == "cancelled"
    assert "cancelled by olga: sent by mistake" in (steered.error or "")
    [retried] = [e for e in await client.journal(broken) if e.type == "run.retried"]
    assert retried.data["by"]["id"] == operator_id
    # Nothing the reader tried reached a run: two runs, no message but olga's.
    assert (
        await client.pool.fetchval("SELECT count(*) FROM toren.actors WHERE kind = 'toren.run'")
        == 2
    )
    assert "from a reader" not in json.dumps([e.data for e in await client.journal(broken)])


async def test_a_runs_page_opens_from_the_id_the_cli_prints(
    client: Client,
    db_url: str,
    chromium: Path,  # noqa: F811  (the fixture imported above)
) -> None:
    run_id = await _journal_run(client, "tr-ids", [RunCompleted(output="done")])
    async with _console(client, db_url, chromium) as (base, page):
        for shown in (run_id, run_id.removeprefix("run/"), run_id.upper()):
            await page.goto(f"{base}/#/runs/{shown}")
            await page.wait_for_selector("#run-status.completed")
            assert await page.inner_text("#run-agent") == "tr-ids", shown
            await page.goto(f"{base}/#/")
            await page.wait_for_selector("#runs:not([hidden])")
        # An id of no run, or no id at all: the list, saying why.
        missing = f"run/{uuid.uuid4()}"
        await page.goto(f"{base}/#/runs/{missing}")
        await page.wait_for_selector("#runs-notice:not([hidden])")
        assert f"no run {missing}" in await page.inner_text("#runs-notice")
        assert await page.locator("#runs").is_visible()
        await page.goto(f"{base}/#/runs/8146c6")
        await page.wait_for_selector("#runs-notice >> text=8146c6 is not a run id")
        # A stray % (a link cut short, a hand-typed address) is said too, not thrown.
        await page.goto(f"{base}/#/runs/{run_id.removeprefix('run/')}")
        await page.wait_for_selector("#run-status.completed")
        await page.goto(f"{base}/#/runs/8146%E0%A4%A")
        await page.wait_for_selector("#runs-notice >> text=8146%E0%A4%A is not a run id")
        assert await page.locator("#run").is_hidden()


async def _child_run(client: Client, parent: str, events: list[Any]) -> str:
    """A child run of ``parent`` (its call c1) that has ended with ``events``, as runs write
    them."""
    from tests.test_sandbox_surfaces import new_id, write
    from toren.runs import RUN_KIND, RunStarted
    from toren.runs import summary as run_summary

    child = new_id()
    args = {"agent": "tr-helper", "parent": parent}
    await client.spawn(RUN_KIND, child, args, route="agent:tr-helper")
    started = RunStarted(agent="tr-helper", input="help", at=1.0, parent=parent, parent_call="c1")
    await write(client, child, [started, *events])
    summary = run_summary(await read_run(client, child))
    await client.pool.execute(
        "UPDATE toren.actors SET summary = $2 WHERE actor_id = $1", child, summary
    )
    return child


async def test_an_ended_child_run_is_offered_no_retry_nor_message(
    client: Client,
    db_url: str,
    chromium: Path,  # noqa: F811  (the fixture imported above)
) -> None:
    """A child run's end went to its parent: the server refuses to retry it or write to it
    (409), so its page offers neither; a parent's page still does."""
    from toren.runs import RunFailed

    parent = await _journal_run(client, "tr-parent", [RunFailed(error_class="tool", message="x")])
    failed = await _child_run(client, parent, [RunFailed(error_class="tool", message="broke")])
    completed = await _child_run(client, parent, [RunCompleted(output="helped")])
    async with _console(client, db_url, chromium) as (base, page):
        await page.goto(f"{base}/#/runs/{parent}")
        await page.wait_for_selector("#run-status.failed")
        assert await page.locator("#retry").is_visible()
        await page.goto(f"{base}/#/runs/{failed}")
        await page.wait_for_selector("#run-agent >> text=tr-helper")  # the page drawn
        assert await page.inner_text("#run-status") == "failed"
        assert await page.locator("#steer-not-allowed").is_hidden()  # it may operate
        assert await page.locator("#retry").is_hidden()
        assert await page.locator("#message-form").is_hidden()
        await page.goto(f"{base}/#/runs/{completed}")
        await page.wait_for_selector("#run-status.completed")
        assert await page.locator("#message-form").is_hidden()
        assert await page.locator("#cancel-form").is_hidden()


async def test_the_sign_in_page_suggests_a_token_that_can_operate_and_says_what_scopes_allow(
    db_url: str,
) -> None:
    import aiohttp

    async with api(db_url) as base, aiohttp.ClientSession() as http, http.get(base) as r:
        page = await r.text()
    signin = page[page.index('<section id="signin"') : page.index("</section>")]
    assert "toren tokens create NAME --scope read,operate,approve" in signin
    scopes = signin[signin.index('id="signin-scopes"') :]
    for scope, allows in (
        ("read", "see runs"),
        ("operate", "start runs, send them messages, cancel and retry them"),
        ("approve", "approve or deny"),
    ):
        assert f"<dt><code>{scope}</code></dt><dd>{allows}" in scopes, scope


async def test_the_retry_route_resumes_only_a_failed_run_that_was_not_cancelled(
    client: Client, db_url: str
) -> None:
    import aiohttp

    from toren.runs import RunFailed

    _, token = await create_token(client.pool, "olga", scopes=["read", "operate"])
    failed = await _journal_run(
        client, "tr-retry", [RunFailed(error_class="provider", message="x")]
    )
    cancelled = await _journal_run(
        client, "tr-retry", [RunFailed(error_class="cancelled", message="cancelled by olga")]
    )
    running = await _journal_run(client, "tr-retry", [])
    headers = {"Authorization": f"Bearer {token}"}
    async with api(db_url) as base, aiohttp.ClientSession(headers=headers) as http:

        async def retry(run_id: str, body: Any = None) -> tuple[int, dict[str, Any]]:
            url = f"{base}/runs/{run_id.removeprefix('run/')}/retry"
            async with http.post(url, json=body) as r:
                return r.status, await r.json()

        assert await retry(failed, {}) == (202, {"run": failed, "accepted": True})
        status, problem = await retry(cancelled)
        assert status == 409
        assert "cancelled" in problem["detail"]
        status, problem = await retry(running)
        assert status == 409
        assert "only a failed run is retried" in problem["detail"]
        status, problem = await retry(failed, {"reason": "no such field"})
        assert status == 422
        status, _ = await retry(f"run/{uuid.uuid4()}")
        assert status == 404
    mail = await client.pool.fetch(
        "SELECT actor_id, kind FROM toren.mailbox WHERE kind = 'run.retry'"
    )
    assert [(r["actor_id"], r["kind"]) for r in mail] == [(failed, "run.retry")]
