"""A channel whose bot cannot reach Telegram is shown failing, since when and why, by ``toren
channels list``, ``GET /channels`` and the console, without its token; once Telegram answers
again it is shown live. The bot is pointed at a closed port on 127.0.0.1 (nothing listens
there), then at the local Bot API server started on that port."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import pytest

from tests import telegram_app
from tests.conftest import running_worker, wait_for
from tests.telegram_support import TELLER, TOKENS, channel_row
from tests.test_api import api, session
from tests.test_cli import toren
from tests.test_console import _launch, _signed_in, chromium  # noqa: F401  (a fixture)
from toren import Client
from toren._agent.app import load_app
from toren._surfaces.tokens import SCOPES, create_token
from toren.testing.telegram_server import TelegramServer

pytestmark = pytest.mark.anyio


def closed_port() -> int:
    """A port on 127.0.0.1 that nothing listens on (bound once to find it free, then closed)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
    return port


async def failing(client: Client) -> dict[str, Any] | None:
    summary = await channel_row(client, "teller")
    found = (summary or {}).get("failing")
    return found if isinstance(found, dict) else None


@pytest.fixture
async def unreachable(
    client: Client, db_url: str, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[int]:
    """A worker running the teller's bot (only it) against a closed port on 127.0.0.1; the
    port, once the channel recorded that it fails."""
    load_app("tests.telegram_app")
    for name in TOKENS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(telegram_app.TOKEN_ENV, TELLER)
    port = closed_port()
    async with running_worker(db_url, telegram_api_url=f"http://127.0.0.1:{port}"):
        await wait_for(lambda: failing(client), what="the channel recorded failing")
        yield port


async def test_a_channel_that_cannot_reach_telegram_is_listed_failing_and_why_until_it_answers(
    client: Client, db_url: str, unreachable: int
) -> None:
    port = unreachable
    found = await failing(client) or {}
    assert f"http://127.0.0.1:{port}" in found["error"]
    assert "ConnectError" in found["error"]
    assert 0 < time.time() - found["since"] < 60

    table = await anyio.to_thread.run_sync(lambda: toren("channels", "list", db_url=db_url))
    assert table.returncode == 0, table.stderr
    [line] = [t for t in table.stdout.splitlines() if t.startswith("│ teller ")]
    assert "failing" in line, table.stdout
    assert "live" not in line
    assert "teller: failing since" in table.stdout
    assert f"127.0.0.1:{port}" in table.stdout
    listed = await anyio.to_thread.run_sync(
        lambda: toren("channels", "list", "--json", db_url=db_url)
    )
    [row] = json.loads(listed.stdout)
    assert row["failing"]["error"] == (await failing(client) or {}).get("error")

    _, token = await create_token(client.pool, "reader", scopes=["read"])
    async with api(db_url) as base, session(token) as http, http.get(base + "/channels") as r:
        assert r.status == 200
        [shown] = (await r.json())["channels"]
    assert shown["failing"]["error"] == row["failing"]["error"]
    assert shown["failing"]["since"].startswith("20")  # an ISO time

    secret = TELLER.split(":", 1)[1]
    for where in ("journal", "actors", "mailbox"):
        count = await client.pool.fetchval(
            f"SELECT count(*) FROM toren.{where} t WHERE t::text LIKE $1", f"%{secret}%"
        )
        assert count == 0, where

    async with TelegramServer(token=TELLER, port=port):

        async def recovered() -> bool:
            summary = await channel_row(client, "teller") or {}
            return bool(summary.get("username")) and summary.get("failing") is None

        await wait_for(recovered, timeout=30, what="the channel recorded Telegram answering")
    kinds = await client.pool.fetch(
        "SELECT type FROM toren.journal WHERE actor_id = 'channel/telegram/teller' "
        "AND type IN ('channel.failing', 'channel.recovered') ORDER BY seq"
    )
    # One row for the outage (the same reason again is not recorded), one for its end.
    assert [k["type"] for k in kinds] == ["channel.failing", "channel.recovered"]


async def test_the_console_shows_a_failing_channel_and_why(
    client: Client,
    db_url: str,
    unreachable: int,
    chromium: Path,  # noqa: F811  (the fixture imported above)
) -> None:
    from playwright.async_api import async_playwright

    _, token = await create_token(client.pool, "alice", scopes=SCOPES)
    async with api(db_url) as base, async_playwright() as pw:
        browser = await _launch(pw, chromium)
        try:
            page = await _signed_in(browser, base, token)
            await page.click("#nav-channels")  # waits until signed in: the nav shows
            box = page.locator('.channel[data-bot="teller"]')
            why = box.locator("p.failing")
            await why.wait_for()
            assert await box.locator("h2 .badge").inner_text() == "failing"
            text = await why.inner_text()
            assert text.startswith("Failing since ")
            assert f"no answer from the Bot API at http://127.0.0.1:{unreachable}" in text
        finally:
            await browser.close()


def test_flood_control_counting_down_is_one_reason_not_a_row_a_poll() -> None:
    """Telegram's 429 says how many seconds to wait, a different number at each poll of the
    same outage: the reason recorded leaves the number out, so the outage stays one
    ``channel.failing`` row (a reason is recorded again only when it changes)."""
    from telegram.error import NetworkError, RetryAfter

    from toren.actors.channels.actor import failure_reason

    api = "http://127.0.0.1:8081"
    reasons = {failure_reason(RetryAfter(n), api, "TELLER_TOKEN") for n in (28, 14, 3)}
    assert len(reasons) == 1, reasons
    [reason] = reasons
    assert "flood control" in reason.lower()
    assert api in reason
    # Other reasons still say what Telegram said.
    down = failure_reason(NetworkError("httpx.ConnectError: refused"), api, "TELLER_TOKEN")
    assert down == f"no answer from the Bot API at {api} (httpx.ConnectError: refused)"
