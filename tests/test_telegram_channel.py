"""The Telegram channel against a local Bot API server, through the real python-telegram-bot
client: pairing, conversations, approvals by button and by reply, the outbox's limits and
refusals, hostile text, groups."""

from __future__ import annotations

import hashlib
import json
import time
from typing import Any

import pytest

import toren.providers.anthropic  # noqa: F401  (the SDK import is paid here, not in a step)
from tests.conftest import WorkerFactory, person, wait_for
from tests.telegram_support import ALICE, BRIEF, TELLER, bots, channel_row, paired, received
from toren import Client
from toren.channels.client import ChannelError, pair
from toren.runs import read_run
from toren.testing.telegram_server import TelegramServer

pytestmark = pytest.mark.anyio

__all__ = ["bots"]  # the fixture


async def test_an_unpaired_chat_is_hinted_once_and_reaches_no_agent(
    client: Client, bots: tuple[TelegramServer, Any]
) -> None:
    server, model = bots
    server.push_message(100, "hello", user_id=ALICE)
    await received(server, 100, lambda t: "not paired" in t)
    server.push_message(100, "hello again", user_id=ALICE)

    async def handled() -> bool:
        summary = await channel_row(client, "teller")
        return bool(summary and summary["updates"] >= 2)

    await wait_for(handled, what="both updates handled")
    assert len(server.sent(100)) == 1  # one hint a minute at most
    assert model.requests == []  # nothing reached the agent
    runs = await client.pool.fetchval("SELECT count(*) FROM toren.actors WHERE kind = 'toren.run'")
    assert runs == 0


async def test_wrong_expired_and_reused_codes_fail_and_a_paired_chat_talks_to_its_agent(
    client: Client, bots: tuple[TelegramServer, Any]
) -> None:
    server, model = bots
    server.push_message(100, "/pair WRONGCODE1", user_id=ALICE)
    await received(server, 100, lambda t: "wrong, used or expired" in t)

    code, _expires = await pair(client, "teller", by=person("op"))
    server.push_message(100, f"/pair {code.lower()}", user_id=ALICE)  # typed in lower case
    await received(server, 100, lambda t: t.startswith("Paired with teller"))
    server.push_message(200, f"/pair {code}", user_id=ALICE + 1)  # used already
    await received(server, 200, lambda t: "wrong, used or expired" in t)

    brief_code, brief_expires = await pair(client, "brief", by=person("op"))
    await wait_for(lambda: _past(brief_expires), what="the brief code's expiry")
    server.push_message(300, f"/pair {brief_code}", user_id=ALICE, token=BRIEF)
    await received(server, 300, lambda t: "wrong, used or expired" in t, token=BRIEF)

    server.push_message(100, "hello teller", user_id=ALICE)
    await received(server, 100, lambda t: t == "echo: hello teller")
    server.push_message(100, "and again", user_id=ALICE)
    await received(server, 100, lambda t: t == "echo: and again")

    summary = await channel_row(client, "teller")
    assert summary is not None
    [chat] = summary["chats"]
    assert chat["chat_id"] == 100
    assert chat["paired_by_id"] == f"telegram:{ALICE}"
    state = await read_run(client, chat["run"])  # one conversation, both messages in it
    assert state.status == "completed"
    assert len(model.requests) == 2


async def test_failed_pairs_are_rate_limited_per_chat(
    client: Client, bots: tuple[TelegramServer, Any]
) -> None:
    server, _ = bots
    for i in range(5):
        server.push_message(100, f"/pair GUESS{i:05d}", user_id=ALICE)
    await wait_for(lambda: _count(server, 100, "wrong, used or expired", 5), what="5 failures")
    assert "none is checked for ten minutes" in (server.sent(100)[-1].text or "")  # told once
    code, _ = await pair(client, "teller", by=person("op"))
    server.push_message(100, f"/pair {code}", user_id=ALICE)  # right, but too late: silence
    server.push_message(101, f"/pair {code}", user_id=ALICE)  # another chat is not held back
    await received(server, 101, lambda t: t.startswith("Paired with teller"))
    summary = await channel_row(client, "teller")
    assert summary is not None
    assert [c["chat_id"] for c in summary["chats"]] == [101]
    assert len(server.sent(100)) == 5  # no answer to the attempt past the limit


async def test_the_journal_holds_a_code_only_as_a_keyed_hash_and_never_the_key(
    client: Client, bots: tuple[TelegramServer, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    server, _ = bots
    code, _ = await pair(client, "teller", by=person("op"))
    server.push_message(100, f"/pair {code}", user_id=ALICE)
    await received(server, 100, lambda t: t.startswith("Paired with teller"))
    rows = await client.pool.fetch(
        "SELECT type, data FROM toren.journal WHERE actor_id = 'channel/telegram/teller'"
    )
    journal = json.dumps([dict(r) for r in rows])
    sha256 = hashlib.sha256(code.encode()).hexdigest()  # about 50 bits: found offline
    assert sha256 not in journal, "the journal holds the code's unkeyed SHA-256"
    assert code not in journal

    from toren.channels import pairing_key

    key = await pairing_key(client.pool)  # the database's: the test sets no TOREN_PAIRING_KEY
    [issued] = [r["data"] for r in rows if r["type"] == "code.issued"]
    assert issued["code_hash"] == key.digest(code)
    for table in ("journal", "mailbox", "snapshots"):
        held = await client.pool.fetchval(
            f"SELECT count(*) FROM toren.{table} t WHERE t::text LIKE $1", f"%{key.secret.hex()}%"
        )
        assert held == 0, table

    # `toren channels pair` with another key than the worker's: refused, not a code that
    # could never pair.
    monkeypatch.setenv("TOREN_PAIRING_KEY", "k" * 32)
    with pytest.raises(ChannelError, match="another pairing key than this worker's"):
        await pair(client, "teller", by=person("op"))


async def test_pair_needs_a_channel(client: Client, bots: tuple[TelegramServer, Any]) -> None:
    with pytest.raises(ChannelError, match="has no Telegram channel"):
        await pair(client, "nobody", by=person("op"))


async def _past(when: float) -> bool:
    return time.time() > when


async def _count(server: TelegramServer, chat: int, text: str, n: int) -> bool:
    return sum(text in (m.text or "") for m in server.sent(chat)) >= n


async def test_odd_and_hostile_updates_are_recorded_and_the_bot_goes_on(
    client: Client, bots: tuple[TelegramServer, Any]
) -> None:
    server, model = bots
    await paired(client, server, 100)
    server.push_message(100, "first", user_id=ALICE)
    await received(server, 100, lambda t: t == "echo: first")
    [first] = [m for m in server.sent(100) if m.text == "echo: first"]
    server.push_edited_message(100, first.message_id, "edited")  # not a new message
    server.push_raw({"message": {"chat": {"id": "100"}, "text": 5, "from": []}})
    server.push_raw({"callback_query": {"id": 5, "data": {"a": 1}, "message": "x"}})
    server.push_raw({"poll": {"id": "1"}, "message": None})
    server.push_message(100, "second", user_id=ALICE)
    await received(server, 100, lambda t: t == "echo: second")
    rows = await client.pool.fetch(
        "SELECT data->>'outcome' AS outcome FROM toren.journal "
        "WHERE actor_id = 'channel/telegram/teller' AND type = 'update.handled' ORDER BY seq"
    )
    outcomes = [r["outcome"] for r in rows]
    assert outcomes[-5:] == ["ignored", "ignored", "ignored", "ignored", "forwarded"]
    assert len(model.requests) == 2  # only the two real messages reached the agent


async def test_the_token_is_in_no_table(client: Client, bots: tuple[TelegramServer, Any]) -> None:
    server, _ = bots
    await paired(client, server, 100)
    server.push_message(100, "hello", user_id=ALICE)
    await received(server, 100, lambda t: t == "echo: hello")
    secret = TELLER.split(":", 1)[1]
    for table in ("journal", "mailbox", "deadletters", "actors", "snapshots"):
        found = await client.pool.fetchval(
            f"SELECT count(*) FROM toren.{table} t WHERE t::text LIKE $1",
            f"%{secret}%",
        )
        assert found == 0, table


def test_log_lines_are_redacted_of_bot_tokens(capsys: pytest.CaptureFixture[str]) -> None:
    import logging

    from toren._logging import configure

    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    try:
        configure("DEBUG")
        logging.getLogger("telegram.Bot").debug("Set Bot API URL: %s", f"https://x/bot{TELLER}")
        try:
            raise ValueError(f"refused https://x/bot{TELLER}/getMe")
        except ValueError:
            logging.getLogger("toren.channel").exception("failed")
    finally:
        root.handlers[:], root.level = handlers, level
    err = capsys.readouterr().err
    assert "Set Bot API URL: https://x/bot<bot token>" in err
    assert "refused https://x/bot<bot token>/getMe" in err  # in the traceback too
    assert TELLER.split(":", 1)[1] not in err


async def test_one_poller_per_bot_across_workers_and_another_takes_over(
    client: Client, workers: WorkerFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two worker processes run the bot: only the channel's owner polls (Telegram would end one
    of two polls with 409). SIGKILLed, the owner's channel is taken over by the other."""
    from tests.telegram_support import chat_model, telegram

    async with telegram(monkeypatch) as server, chat_model(monkeypatch):
        started = [workers("tests.telegram_app", telegram_api_url=server.url) for _ in range(2)]
        await wait_for(lambda: channel_row(client, "teller"), timeout=60, what="the channel")
        await paired(client, server, 100)
        for i in range(5):
            server.push_message(100, f"m{i}", user_id=ALICE)
        await received(server, 100, lambda t: t.startswith("echo:") and "m4" in t, timeout=60)
        owner = await client.pool.fetchval(
            "SELECT w.pid FROM toren.actors a JOIN toren.workers w ON w.worker_id = a.owner "
            "WHERE a.actor_id = 'channel/telegram/teller'"
        )
        [victim] = [w for w in started if w.pid == owner]
        victim.kill()
        server.push_message(100, "after", user_id=ALICE)
        await received(server, 100, lambda t: t == "echo: after", timeout=60)
    conflicts = [c for c in server.calls("getUpdates") if c.status == 409]
    assert conflicts == []  # never two pollers at once
    rows = await client.pool.fetch(
        "SELECT data->>'update_id' AS id FROM toren.journal "
        "WHERE actor_id = 'channel/telegram/teller' AND type = 'update.handled'"
    )
    ids = [r["id"] for r in rows]
    assert len(ids) == len(set(ids)) == 7  # /pair, five messages, one after: each once


async def test_with_per_thread_each_forum_topic_has_its_own_conversation(
    client: Client, bots: tuple[TelegramServer, Any]
) -> None:
    from tests.telegram_support import TOPICS

    server, _ = bots
    forum = -100500
    server.add_chat(forum, "supergroup", "forum", token=TOPICS)
    code, _ = await pair(client, "topics", by=person("op"))
    server.push_message(forum, f"/pair@topics_test_bot {code}", user_id=ALICE, token=TOPICS)
    await received(server, forum, lambda t: t.startswith("Paired with topics"), token=TOPICS)

    def topic_message(thread: int, text: str) -> dict[str, Any]:
        return {
            "message": {
                "message_id": 1000 + thread,
                "message_thread_id": thread,
                "is_topic_message": True,
                "date": 1,
                "chat": {"id": forum, "type": "supergroup", "title": "forum", "is_forum": True},
                "from": {"id": ALICE, "is_bot": False, "first_name": "alice"},
                "text": f"@topics_test_bot {text}",
                "entities": [{"type": "mention", "offset": 0, "length": 16}],
            }
        }

    server.push_raw(topic_message(11, "in eleven"), token=TOPICS)
    server.push_raw(topic_message(22, "in twenty-two"), token=TOPICS)
    eleven = await received(server, forum, lambda t: t == "echo: in eleven", token=TOPICS)
    twenty_two = await received(server, forum, lambda t: t == "echo: in twenty-two", token=TOPICS)
    assert (eleven.thread_id, twenty_two.thread_id) == (11, 22)  # each answer in its topic
    summary = await channel_row(client, "topics")
    assert summary is not None
    runs = await client.pool.fetch(
        "SELECT data->>'key' AS key, data->>'run' AS run FROM toren.journal "
        "WHERE actor_id = 'channel/telegram/topics' AND type = 'conversation.started'"
    )
    assert sorted(r["key"] for r in runs) == [f"{forum}/11", f"{forum}/22"]
    assert len({r["run"] for r in runs}) == 2
