"""What the CLI, the API and the console show of Telegram channels, and the webhook Telegram
posts updates to: ``toren channels list | pair | unpair | observe | messages``, ``GET
/channels``, ``GET /channels/{bot}/messages``, ``POST /telegram/{bot}`` and the console's
Channels page.

The webhook tests need no worker: the channel actor's row is spawned as a worker spawns it, and
what the route enqueued is read from its mailbox. The listings are read from real channels: a
worker runs the test bots against the local Bot API server."""

from __future__ import annotations

import io
import json
import os
import re
import socket
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import anyio
import pytest

from tests import telegram_app
from tests.conftest import ROOT, person, running_worker, wait_for
from tests.telegram_support import TELLER, channel_row, chat_model, received, telegram
from tests.test_api import api, session
from tests.test_cli import toren
from tests.test_console import (  # noqa: F401  (chromium: a fixture)
    ARTIFACTS,
    _launch,
    _signed_in,
    chromium,
)
from toren import Client
from toren._agent.app import load_app
from toren._core.codec import decode
from toren._surfaces.http import ServerOptions
from toren._surfaces.serve import serving
from toren._surfaces.tokens import SCOPES, create_token
from toren.channels import CHANNEL_KIND, Inbound, channel_address, channel_route
from toren.channels.client import ChannelError, pair
from toren.runs import start_run
from toren.testing.telegram_server import TelegramServer

pytestmark = pytest.mark.anyio

SECRET = "webhook-secret-for-the-tests_0123456789"
HEADER = "X-Telegram-Bot-Api-Secret-Token"
ALICE = 501
HOSTILE = (
    "\x1b[2J\x1b]8;;http://evil.example\x07click\x1b]8;;\x07 <img src=x onerror=window.__owned=1>"
)


# --- the webhook ------------------------------------------------------------------------------


async def spawn_channel(client: Client, bot: str = "hooked", **args: Any) -> str:
    """The channel actor of ``bot`` as a worker spawns it (no worker runs it here)."""
    address = channel_address(bot)
    await client.spawn(
        CHANNEL_KIND, address, {"bot": bot, "agent": "teller", **args}, route=channel_route(bot)
    )
    return address


async def updates(client: Client) -> list[Inbound]:
    rows = await client.pool.fetch(
        "SELECT kind, body FROM toren.mailbox WHERE kind = 'channel.update' ORDER BY id"
    )
    return [decode(r["kind"], r["body"]) for r in rows]


def update(update_id: int, text: str = "hello") -> dict[str, Any]:
    return {
        "update_id": update_id,
        "message": {
            "message_id": 1,
            "date": 0,
            "chat": {"id": 100, "type": "private"},
            "from": {"id": ALICE, "is_bot": False, "first_name": "alice"},
            "text": text,
        },
    }


async def post(
    base: str, bot: str, body: Any, secret: str | None = SECRET
) -> tuple[int, dict[str, Any]]:
    headers = {"Content-Type": "application/json"}
    if secret is not None:
        headers[HEADER] = secret
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    async with (
        aiohttp.ClientSession() as http,
        http.post(f"{base}/telegram/{bot}", data=io.BytesIO(data), headers=headers) as r,
    ):
        return r.status, await r.json(content_type=None)


@pytest.fixture
def secret(monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("TELEGRAM_WEBHOOK_SECRET", SECRET)
    return SECRET


async def test_a_right_secret_enqueues_the_update_once(
    client: Client, db_url: str, secret: str
) -> None:
    await spawn_channel(client)
    async with api(db_url) as base:
        first = await post(base, "hooked", update(7))
        again = await post(base, "hooked", update(7))  # Telegram sends it again: a no-op
        other = await post(base, "hooked", update(8, "second"))
    assert first == again == other == (200, {"ok": True})
    assert [u.update for u in await updates(client)] == [update(7), update(8, "second")]
    lanes = await client.pool.fetch("SELECT lane, dedupe_key FROM toren.mailbox ORDER BY id")
    assert [r["dedupe_key"] for r in lanes] == ["update:7", "update:8"]
    assert {r["lane"] for r in lanes} == {0}  # the system lane


async def test_a_missing_or_wrong_secret_is_refused_and_enqueues_nothing(
    client: Client, db_url: str, secret: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    await spawn_channel(client)
    async with api(db_url) as base:
        refused = [
            await post(base, "hooked", update(1), secret=None),
            await post(base, "hooked", update(2), secret=""),
            await post(base, "hooked", update(3), secret=SECRET + "x"),
            await post(base, "hooked", update(4), secret=SECRET[:-1]),
            await post(base, "nobody", update(5)),  # no such channel: the same answer
            await post(base, "bad%20name", update(6)),
        ]
        monkeypatch.delenv("TELEGRAM_WEBHOOK_SECRET")  # unset here: nothing can match
        refused.append(await post(base, "hooked", update(7)))
        monkeypatch.setenv("TELEGRAM_WEBHOOK_SECRET", "short")  # too weak to be a secret
        refused.append(await post(base, "hooked", update(8), secret="short"))
    for status, body in refused:
        assert (status, body["detail"]) == (401, "unauthorized")
    assert await updates(client) == []


async def test_the_secret_is_read_from_the_variable_the_channel_names(
    client: Client, db_url: str, secret: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    other = "another-secret-for-the-other-bot_42"
    monkeypatch.setenv("OTHER_BOT_SECRET", other)
    await spawn_channel(client, "other", webhook_secret_env="OTHER_BOT_SECRET")
    async with api(db_url) as base:
        assert (await post(base, "other", update(1)))[0] == 401  # the default variable's
        assert (await post(base, "other", update(2), secret=other))[0] == 200
    assert [u.update["update_id"] for u in await updates(client)] == [2]


async def test_a_body_that_is_not_an_update_is_400_and_enqueues_nothing(
    client: Client, db_url: str, secret: str
) -> None:
    await spawn_channel(client)
    bodies: list[Any] = [
        {},
        {"message": {"text": "hi"}},
        {"update_id": "7"},
        {"update_id": True},
        {"update_id": 1.5},
        {"update_id": -1},
        {"update_id": 2**63},
        [{"update_id": 1}],
        b"not json",
        b'{"update_id": NaN}',
        b"\xff\xfe",
        b'{"update_id": 1, "deep": ' + b"[" * 100 + b"]" * 100 + b"}",
    ]
    async with api(db_url) as base:
        answers = [await post(base, "hooked", body) for body in bodies]
    assert [status for status, _ in answers] == [400] * len(bodies)
    assert await updates(client) == []


async def test_a_body_over_1_mib_is_413_and_enqueues_nothing(
    client: Client, db_url: str, secret: str
) -> None:
    await spawn_channel(client)
    big = update(1, "x" * (2 * 1024 * 1024))
    fits = update(2, "y" * (1024 * 1024 - 500))
    async with api(db_url) as base:
        status, body = await post(base, "hooked", big)
        assert (status, body["title"]) == (413, "Too large")

        # Sent in chunks, without a length: cut off all the same.
        async def chunks() -> AsyncIterator[bytes]:
            raw = json.dumps(big).encode()
            for i in range(0, len(raw), 256 * 1024):
                yield raw[i : i + 256 * 1024]

        async with (
            aiohttp.ClientSession() as http,
            http.post(f"{base}/telegram/hooked", data=chunks(), headers={HEADER: SECRET}) as r,
        ):
            assert r.status == 413
        assert (await post(base, "hooked", fits))[0] == 200
    assert [u.update["update_id"] for u in await updates(client)] == [2]


async def test_hostile_text_in_an_update_is_enqueued_exactly(
    client: Client, db_url: str, secret: str
) -> None:
    await spawn_channel(client)
    raw = b'{"update_id": 9, "message": {"text": "a\\u0000b\\ud800c\\u202e' + b'\xc3\xa9"}}'
    async with api(db_url) as base:
        assert (await post(base, "hooked", raw))[0] == 200
    [got] = await updates(client)
    assert got.update == {"update_id": 9, "message": {"text": "a\x00b\ud800c\u202e\xe9"}}


async def test_failed_secrets_are_limited_per_address_but_a_known_bot_gets_through(
    client: Client, db_url: str, secret: str
) -> None:
    await spawn_channel(client)
    await spawn_channel(client, "quiet")
    options = ServerOptions(failed_auth_per_minute=3)
    async with serving(db_url, port=0, options=options) as base:
        assert (await post(base, "hooked", update(1)))[0] == 200
        for i in range(3):
            assert (await post(base, "hooked", update(10 + i), secret="guess"))[0] == 401
        status, body = await post(base, "hooked", update(20), secret="guess")
        assert status == 429
        assert "try again in" in body["detail"]
        assert (await post(base, "quiet", update(21)))[0] == 429  # not seen pass: not checked
        assert (await post(base, "hooked", update(2)))[0] == 200  # seen pass lately: checked
    assert [u.update["update_id"] for u in await updates(client)] == [1, 2]


async def test_the_webhook_needs_no_bearer_token_but_nothing_else_under_telegram_is_open(
    client: Client, db_url: str, secret: str
) -> None:
    await spawn_channel(client)
    async with api(db_url) as base, aiohttp.ClientSession() as http:
        async with http.get(f"{base}/telegram/hooked") as r:
            assert r.status == 401  # not the webhook: a bearer token is asked for
        async with http.post(f"{base}/telegram/hooked/x", json=update(1)) as r:
            assert r.status == 401


# --- the read routes, without data --------------------------------------------------------------


async def test_the_channel_routes_need_a_token_with_the_read_scope(
    client: Client, db_url: str
) -> None:
    await spawn_channel(client)
    _, reader = await create_token(client.pool, "reader", scopes=["read"])
    _, operator = await create_token(client.pool, "operator", scopes=["operate"])
    paths = ["/channels", "/channels/hooked/messages"]
    async with api(db_url) as base:
        for path in paths:
            async with session() as http, http.get(base + path) as r:
                assert r.status == 401
            async with session(operator) as http, http.get(base + path) as r:
                assert r.status == 403
                assert "'read' scope" in (await r.json())["detail"]
        async with session(reader) as http:
            async with http.get(base + "/channels") as r:
                assert r.status == 200
                [channel] = (await r.json())["channels"]
            async with http.get(base + "/channels/hooked/messages") as r:
                assert (r.status, await r.json()) == (200, {"bot": "hooked", "messages": []})
            async with http.get(base + "/channels/nobody/messages") as r:
                assert r.status == 404
            async with http.get(base + "/channels/hooked/messages?chat=abc") as r:
                assert r.status == 422
    assert channel["bot"] == "hooked"
    assert channel["channel"] == "channel/telegram/hooked"
    assert (channel["agent"], channel["status"], channel["chats"]) == ("teller", "live", [])


# --- the CLI's errors -------------------------------------------------------------------------


async def cli(db_url: str, *args: str) -> Any:
    return await anyio.to_thread.run_sync(lambda: toren("channels", *args, db_url=db_url))


async def test_pair_for_an_agent_without_a_channel_exits_1_saying_what_to_do(
    db_url: str,
) -> None:
    done = await cli(db_url, "pair", "nobody")
    assert done.returncode == 1
    assert "agent 'nobody' has no Telegram channel" in done.stderr
    assert "[agents.nobody.telegram]" in done.stderr
    assert "Traceback" not in done.stderr


async def test_pair_for_an_agent_whose_bot_token_is_not_set_names_the_variable(
    client: Client, db_url: str, tmp_path: Path
) -> None:
    settings = tmp_path / "toren.toml"
    settings.write_text(
        '[agents.support.telegram]\nbot = "support"\ntoken_env = "SUPPORT_BOT_TOKEN"\n'
    )
    done = await anyio.to_thread.run_sync(
        lambda: toren("--config", str(settings), "channels", "pair", "support", db_url=db_url)
    )
    assert done.returncode == 1
    assert "SUPPORT_BOT_TOKEN is not set" in done.stderr, done.stderr
    assert "give it [agents.support.telegram]" not in done.stderr
    assert "Traceback" not in done.stderr
    # The default variable, and a token file, are named the same way (as asked in-process).
    for table, named in (
        ({"bot": "support"}, "TELEGRAM_BOT_TOKEN is not set"),
        (
            {"bot": "support", "token_file": str(tmp_path / "none")},
            "token_file '.+' cannot be read here",
        ),
    ):
        with pytest.raises(ChannelError, match=named):
            await pair(client, "support", by=person("op"), telegram=table)


async def test_pair_with_no_worker_running_the_bot_exits_1_and_names_the_next_step(
    client: Client, db_url: str
) -> None:
    await spawn_channel(client)
    done = await cli(db_url, "pair", "teller")
    assert done.returncode == 1
    assert "did not answer" in done.stderr
    assert "toren workers" in done.stderr


async def test_observe_needs_exactly_one_of_run_and_agent(db_url: str) -> None:
    neither = await cli(db_url, "observe", "teller", "100")
    both = await cli(db_url, "observe", "teller", "100", "--run", "x", "--agent", "y")
    for done in (neither, both):
        assert done.returncode == 2
        assert "exactly one of --run RUN and --agent AGENT" in done.stderr


async def test_list_without_channels_says_how_to_get_one(db_url: str) -> None:
    done = await cli(db_url, "list")
    assert done.returncode == 0, done.stderr
    assert "no channels" in done.stdout
    assert "[agents.NAME.telegram]" in done.stdout
    assert json.loads((await cli(db_url, "list", "--json")).stdout) == []


# --- the surfaces over a real channel ---------------------------------------------------------


@pytest.fixture
async def bots(
    db_url: str, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[tuple[TelegramServer, Any]]:
    load_app("tests.telegram_app")
    async with (
        telegram(monkeypatch) as server,
        chat_model(monkeypatch) as model,
        running_worker(db_url, telegram_api_url=server.url),
    ):
        yield server, model


async def talked(client: Client, server: TelegramServer, db_url: str) -> None:
    """Chat 100 paired with teller through the CLI's code, and a hostile message echoed."""
    done = await cli(db_url, "pair", "teller")
    assert done.returncode == 0, done.stderr
    [code] = re.findall(r"^/pair (\S+)$", done.stdout, re.MULTILINE)
    server.push_message(100, f"/pair {code}", user_id=ALICE, username="alice")
    await received(server, 100, lambda t: t.startswith("Paired with teller"))
    server.push_message(100, HOSTILE, user_id=ALICE)
    await received(server, 100, lambda t: t.startswith("echo: "))

    async def recorded() -> bool:
        summary = await channel_row(client, "teller")
        return bool(summary and summary["sent"] >= 2 and summary["chats"][0]["run"])

    await wait_for(recorded, what="both messages recorded sent")


async def test_pair_prints_the_code_its_expiry_and_the_line_to_send(
    client: Client, db_url: str, bots: tuple[TelegramServer, Any]
) -> None:
    done = await cli(db_url, "pair", "teller")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert re.fullmatch(r"pairing code for agent teller \(@\w+\): [A-Z0-9]{10}", lines[0])
    assert re.fullmatch(
        r"single use; expires at \d{4}-\d\d-\d\d \d\d:\d\d:\d\d \S+ \(in 10 minutes\)", lines[1]
    )
    code = lines[0].rsplit(" ", 1)[1]
    assert f"/pair {code}" in lines


async def test_list_and_messages_show_the_chat_and_each_delivery_state(
    client: Client, db_url: str, bots: tuple[TelegramServer, Any]
) -> None:
    server, _ = bots
    await talked(client, server, db_url)
    listed = await cli(db_url, "list", "--json")
    assert listed.returncode == 0, listed.stderr
    teller = next(c for c in json.loads(listed.stdout) if c["bot"] == "teller")
    [chat] = teller["chats"]
    assert (chat["chat_id"], chat["type"], chat["paired_by_id"]) == (
        100,
        "private",
        f"telegram:{ALICE}",
    )
    assert chat["run"].startswith("run/")
    assert teller["username"]

    table = await cli(db_url, "list")
    assert table.returncode == 0, table.stderr
    assert f"@{teller['username']}" in table.stdout
    assert chat["run"] in table.stdout
    assert "chats paired with teller" in table.stdout

    shown = json.loads((await cli(db_url, "messages", "teller", "--chat", "100", "--json")).stdout)
    assert [(m["kind"], m["state"]) for m in shown] == [("notice", "sent"), ("text", "sent")]
    assert shown[1]["text"] == f"echo: {HOSTILE}"
    assert (
        json.loads((await cli(db_url, "messages", "teller", "--chat", "7", "--json")).stdout) == []
    )

    printed = await cli(db_url, "messages", "teller")
    assert printed.returncode == 0, printed.stderr
    assert "\x1b" not in printed.stdout
    assert "\x07" not in printed.stdout
    assert "\\x1b[2J" in printed.stdout  # the escape, shown inert
    assert "sent" in printed.stdout


async def test_the_api_shows_the_chat_and_each_delivery_state(
    client: Client, db_url: str, bots: tuple[TelegramServer, Any]
) -> None:
    server, _ = bots
    await talked(client, server, db_url)
    _, token = await create_token(client.pool, "reader", scopes=["read"])
    async with api(db_url) as base, session(token) as http:
        async with http.get(base + "/channels") as r:
            assert r.status == 200
            teller = next(c for c in (await r.json())["channels"] if c["bot"] == "teller")
        async with http.get(base + "/channels/teller/messages?chat=100") as r:
            assert r.status == 200
            page = await r.json()
    [chat] = teller["chats"]
    assert chat["chat_id"] == 100
    assert chat["paired_by"] == "alice"
    assert (teller["agent"], teller["sent"], teller["pending"]) == ("teller", 2, 0)
    states = [(m["kind"], m["state"], m["chat_id"]) for m in page["messages"]]
    assert states == [("notice", "sent", 100), ("text", "sent", 100)]
    assert page["messages"][1]["text"] == f"echo: {HOSTILE}"
    assert all(m["message_ids"] for m in page["messages"])


async def test_unpair_and_observe_from_the_cli(
    client: Client, db_url: str, bots: tuple[TelegramServer, Any]
) -> None:
    server, _ = bots
    await talked(client, server, db_url)
    run_id = await start_run(client, "teller", "watched")
    watched = await cli(db_url, "observe", "teller", "100", "--run", run_id.removeprefix("run/"))
    assert watched.returncode == 0, watched.stderr
    assert f"chat 100 observes (read-only) run {run_id}" in watched.stdout
    await received(server, 100, lambda t: t.startswith("This chat observes"))
    group = await cli(db_url, "unpair", "teller", "-1001234")  # a group's id: negative
    assert group.returncode == 1
    assert "chat -1001234 is not paired" in group.stderr
    done = await cli(db_url, "unpair", "teller", "100")
    assert done.returncode == 0, done.stderr
    assert "chat 100 unpaired" in done.stdout
    await received(server, 100, lambda t: "unpaired by" in t)
    assert (await channel_row(client, "teller") or {})["chats"] == []


async def test_the_console_lists_channels_chats_and_delivery_states_escaped(
    client: Client,
    db_url: str,
    bots: tuple[TelegramServer, Any],
    chromium: Path,  # noqa: F811  (the fixture imported above)
) -> None:
    from playwright.async_api import async_playwright

    server, _ = bots
    await talked(client, server, db_url)
    _, token = await create_token(client.pool, "alice", scopes=SCOPES)
    async with api(db_url) as base, async_playwright() as pw:
        browser = await _launch(pw, chromium)
        try:
            page = await _signed_in(browser, base, token)
            await page.wait_for_selector("#runs-body")
            await page.click("#nav-channels")
            box = page.locator('.channel[data-bot="teller"]')
            await box.locator("td >> text=alice (telegram:501)").wait_for()
            chats = await box.locator("table").nth(0).locator("tbody tr").all_inner_texts()
            assert len(chats) == 1
            assert chats[0].startswith("100\t")
            rows = box.locator("table").nth(1).locator("tbody tr")
            assert await rows.count() == 2
            newest = await rows.nth(0).locator("td").all_inner_texts()
            assert newest[2:4] == ["text", "sent"]
            assert newest[5].startswith("echo: \\x1b[2J\\x1b]8;;http://evil.example\\x07click")
            assert await box.locator(".badge.state.sent").count() == 2
            assert await page.locator("#channels img").count() == 0
            assert await page.evaluate("window.__owned") is None
            link = box.locator("table").nth(0).locator("a")
            assert (await link.get_attribute("href") or "").startswith("#/runs/")
            ARTIFACTS.mkdir(parents=True, exist_ok=True)
            await page.screenshot(path=str(ARTIFACTS / "console-channels.png"), full_page=True)
        finally:
            await browser.close()


async def test_a_webhook_bot_takes_its_updates_through_the_route(
    client: Client, db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """End to end: the worker sets the webhook at the API's address; Telegram's posts there
    reach the channel, and a repeated post is handled once."""
    from toren._agent import registry as _agents

    monkeypatch.setattr(_agents.PROCESS_AGENTS, "_registry", {})
    monkeypatch.setenv("TELEGRAM_WEBHOOK_SECRET", SECRET)
    async with api(db_url) as base, telegram(monkeypatch) as server:
        _agents.register_agents([webhook_agent("hooked", base)])
        async with running_worker(db_url, telegram_api_url=server.url):
            await wait_for(lambda: _webhook_set(server), what="the webhook set")
            first = server.push_message(100, "hello", user_id=ALICE)
            assert await server.deliver(first) == 200
            await received(server, 100, lambda t: "not paired" in t)
            assert await server.deliver(server.push_message(100, "x", user_id=ALICE)) == 200
            assert await server.deliver({**update(first), "update_id": first}) == 200  # again

            async def handled() -> bool:  # every update taken from the mailbox, committed
                summary = await channel_row(client, "hooked")
                waiting = await client.pool.fetchval(
                    "SELECT count(*) FROM toren.mailbox "
                    "WHERE actor_id = 'channel/telegram/hooked' AND kind = 'channel.update'"
                )
                return bool(summary and summary["updates"] >= 1 and waiting == 0)

            await wait_for(handled, what="both updates handled")
            assert await server.deliver(server.push_message(100, "y"), secret="wrong") == 401
    handled_ids = await client.pool.fetch(
        "SELECT data->>'update_id' AS id FROM toren.journal "
        "WHERE actor_id = 'channel/telegram/hooked' AND type = 'update.handled'"
    )
    # The hint is recorded; the stranger's second message, ignored, leaves no row (issue 26).
    assert sorted(int(r["id"]) for r in handled_ids) == [first]
    assert len(server.sent(100, token=TELLER)) == 1  # one hint a day


def webhook_agent(name: str, base: str) -> Any:
    """An agent whose bot (named as it) takes its updates at ``base``'s webhook route."""
    from toren import Agent
    from toren.channels import Telegram

    telegram = Telegram(
        bot=name,
        token_env=telegram_app.TOKEN_ENV,
        mode="webhook",
        webhook_url=f"{base}/telegram/{name}",
        poll_timeout=1,
        chat_interval=0,
    )
    return Agent(name=name, model=telegram_app.MODEL, system=name, telegram=telegram)


async def _webhook_set(server: TelegramServer) -> bool:
    return bool(server.calls("setWebhook"))


async def test_a_crash_between_the_enqueue_and_the_200_loses_nothing_and_doubles_nothing(
    client: Client, db_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``toren serve`` frozen right after it enqueued an update, before its 200, and killed:
    Telegram gets no answer and posts the update again to the next server; the channel handles
    it once."""
    from toren._agent import registry as _agents

    monkeypatch.setattr(_agents.PROCESS_AGENTS, "_registry", {})
    monkeypatch.setenv("TELEGRAM_WEBHOOK_SECRET", SECRET)
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    env = {
        **os.environ,
        "TOREN_DATABASE_URL": db_url,
        "TELEGRAM_WEBHOOK_SECRET": SECRET,
        "TOREN_KILL_POINT": "telegram.enqueued",
        "TOREN_KILL_POINT_DIR": str(tmp_path),
    }
    async with telegram(monkeypatch) as server:
        _agents.register_agents([webhook_agent("crashed", base)])
        async with running_worker(db_url, telegram_api_url=server.url):
            await wait_for(lambda: _webhook_set(server), what="the webhook set")
            statuses: list[int] = []
            first = _serve(port, env)
            try:
                await wait_for(lambda: _answers(base), timeout=60, what="the first server")
                update_id = server.push_message(100, "hello", user_id=ALICE)
                async with anyio.create_task_group() as tg:
                    tg.start_soon(_deliver_into, server, update_id, statuses)
                    await wait_for(lambda: _hit(tmp_path), timeout=30, what="the kill point")
                    first.kill()  # frozen after the enqueue, before the 200
                assert statuses == [0]  # Telegram got no answer
            finally:
                first.kill()
                first.wait(10)
            del env["TOREN_KILL_POINT"]
            second = _serve(port, env)
            try:
                await wait_for(lambda: _answers(base), timeout=60, what="the second server")
                assert await server.deliver(update_id) == 200  # Telegram's retry
                await received(server, 100, lambda t: "not paired" in t)

                async def handled() -> list[Any]:
                    return await client.pool.fetch(
                        "SELECT data->>'update_id' AS id FROM toren.journal "
                        "WHERE actor_id = 'channel/telegram/crashed' AND type = 'update.handled'"
                    )

                assert [int(r["id"]) for r in await wait_for(handled)] == [update_id]
            finally:
                second.kill()
                second.wait(10)
    assert len(server.sent(100, token=TELLER)) == 1


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _serve(port: int, env: dict[str, str]) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "toren", "serve", "--port", str(port)],
        env=env,
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


async def _answers(base: str) -> bool:
    try:
        async with aiohttp.ClientSession() as s, s.get(f"{base}/healthz") as r:
            return r.status == 200
    except aiohttp.ClientError:
        return False


async def _hit(folder: Path) -> bool:
    return (folder / "hit").exists()


async def _deliver_into(server: TelegramServer, update_id: int, statuses: list[int]) -> None:
    statuses.append(await server.deliver(update_id))
