"""The Telegram channel against a local Bot API server, through the real python-telegram-bot
client: pairing, conversations, approvals by button and by reply, the outbox's limits and
refusals, hostile text, groups."""

from __future__ import annotations

import hashlib
import json
import time
from typing import Any

import anyio
import attrs
import pytest

import toren.providers.anthropic  # noqa: F401  (the SDK import is paid here, not in a step)
from tests.conftest import WorkerFactory, person, wait_for
from tests.telegram_support import (
    ALICE,
    BRIEF,
    TELLER,
    bots,
    channel_row,
    paired,
    polled_past,
    received,
    texts,
)
from toren import Client
from toren.actors.channels import inbound
from toren.channels import ChannelState, PairFailed, fold
from toren.channels._state import FORGET_AFTER
from toren.channels.client import ChannelError, pair
from toren.runs import read_run
from toren.testing.telegram_server import TelegramServer

pytestmark = pytest.mark.anyio
STRANGER = 778  # a chat that is not paired

__all__ = ["bots"]  # the fixture


async def test_an_unpaired_chat_is_hinted_once_and_reaches_no_agent(
    client: Client, bots: tuple[TelegramServer, Any]
) -> None:
    server, model = bots
    server.push_message(100, "hello", user_id=ALICE)
    await received(server, 100, lambda t: "not paired" in t)
    await polled_past(server, server.push_message(100, "hello again", user_id=ALICE))
    assert len(server.sent(100)) == 1  # one hint a day at most
    assert model.requests == []  # nothing reached the agent
    runs = await client.pool.fetchval("SELECT count(*) FROM toren.actors WHERE kind = 'toren.run'")
    assert runs == 0


async def test_strangers_add_one_row_each_and_the_offset_still_advances(
    client: Client, bots: tuple[TelegramServer, Any]
) -> None:
    """Issue 26: 50 messages from 10 unpaired chats add one journal row per chat (its hint,
    at most one a day), the offset the bot asks for still passes them all (none is handed out
    again), and a paired chat still talks to its agent after them."""
    server, _ = bots
    await paired(client, server, 100)

    async def settled() -> bool:  # the pairing notice sent and recorded
        summary = await channel_row(client, "teller")
        return bool(summary and summary["pending"] == 0 and summary["sent"] == 1)

    await wait_for(settled, what="the pairing notice recorded sent")
    before = await _rows(client)
    strangers = [9001 + i for i in range(10)]
    last = 0
    for round_ in range(5):
        for chat in strangers:
            last = server.push_message(chat, f"hello {round_}", user_id=chat)
    await polled_past(server, last)
    added = await _rows(client) - before
    assert added <= len(strangers), f"{added} journal rows for 50 messages from 10 strangers"
    assert [len(server.sent(chat)) for chat in strangers] == [1] * 10  # one hint each
    assert server.pending_updates() == []
    server.push_message(100, "still here", user_id=ALICE)
    await received(server, 100, lambda t: t == "echo: still here")


async def _rows(client: Client) -> int:
    count: int = await client.pool.fetchval(
        "SELECT count(*) FROM toren.journal WHERE actor_id = 'channel/telegram/teller'"
    )
    return count


async def test_a_chat_past_twenty_failed_codes_in_a_day_is_not_checked_and_adds_no_row() -> None:
    """Issue 26: a chat that is not paired may send five wrong codes every ten minutes, and each
    added rows (``pair.failed``, ``update.handled``, the answer queued and sent) for as long as
    it kept at it, without end over days; the attempts refused while it waited added a row
    each too. Now at most 20 failed codes a day are checked per chat (the twentieth says so),
    and an attempt refused adds nothing to the journal. (A unit test: the handler in a context
    of its own, as the channel actor builds it.)"""
    now = time.time()
    state = ChannelState(agent="dailyunit", bot_id=1008, username="dailyunit_bot")
    for i in range(19):  # four an hour, never five in ten minutes: the window never holds it
        state = fold(state, PairFailed(chat_id=STRANGER, at=now - 80_000 + i * 900.0))
    twentieth = await alone(state, 1, "/pair GUESS00001")
    assert [e[1] for e in twentieth.events] == ["pair.failed", "outbox.queued", "update.handled"]
    assert "none is checked for a day" in twentieth.events[1][3].text
    refused = await alone(twentieth.state, 2, "/pair GUESS00002")
    assert refused.events == [], [(e[1], e[3]) for e in refused.events]


async def test_a_stranger_is_hinted_once_a_day_in_one_row() -> None:
    """Issue 26: the pairing hint went through the outbox (``update.handled``, then the hint
    queued and sent: three rows) at most once a minute, so a stranger writing all day added
    rows all day. Now the hint is sent by the step that handles the update and recorded as that
    update alone, at most once a day; the messages in between add nothing."""
    api = SentTexts()
    state = ChannelState(agent="dailyunit", bot_id=1008, username="dailyunit_bot")
    hinted = await alone(state, 1, "hello", api)
    assert [e[1] for e in hinted.events] == ["update.handled"]
    assert hinted.events[0][3].outcome == "hinted"
    assert len(api.texts) == 1
    assert "not paired" in api.texts[0]
    assert hinted.state.hinted.get(str(STRANGER), 0.0) > time.time() - 60
    hour_later = attrs.evolve(  # hinted an hour ago
        hinted.state, hinted=hinted.state.hinted.set(str(STRANGER), time.time() - 3600)
    )
    quiet = await alone(hour_later, 2, "hello again", api)
    assert quiet.events == [], [(e[1], e[3]) for e in quiet.events]
    assert len(api.texts) == 1
    day_later = attrs.evolve(  # hinted a day and some ago
        hinted.state, hinted=hinted.state.hinted.set(str(STRANGER), time.time() - 86_500)
    )
    again = await alone(day_later, 3, "hello tomorrow", api)
    assert [e[1] for e in again.events] == ["update.handled"]
    assert again.events[0][3].outcome == "hinted"
    assert len(api.texts) == 2
    # The state forgets a stranger's hint and failed codes no sooner than their windows.
    assert max(inbound.HINT_EVERY, inbound.DAY) <= FORGET_AFTER


def test_the_offset_kept_in_memory_is_used_only_on_the_state_its_tick_left() -> None:
    """The offset past unrecorded updates confirms them to Telegram when asked for: it must be
    used only if the tick that reached it committed. A tick that recorded updates and then
    failed to commit is handled again on the older state: the recorded offset is asked for
    then, and Telegram gives those updates again. (A unit test of the channel actor's choice.)"""
    from toren.actors.channels.actor import ChannelActor

    actor = ChannelActor("channel/telegram/offsetunit", {"bot": "offsetunit"})
    assert actor._offset(7) == 7  # nothing held: the recorded offset
    actor._ahead = (12, 20)  # the last tick left 12 recorded, and passed 12..19 unrecorded
    assert actor._offset(12) == 20
    assert actor._offset(7) == 7  # its commit failed: its recorded updates come again
    assert actor._offset(25) == 25  # recorded past it since


class SentTexts:
    """A Bot API stand-in that keeps the texts sent."""

    def __init__(self) -> None:
        self.texts: list[str] = []

    async def send_text(self, chat_id: int, text: str, **_: Any) -> int:
        self.texts.append(text)
        return len(self.texts)


async def alone(state: ChannelState, update_id: int, text: str, api: Any = None) -> Any:
    """The context after the channel handled STRANGER's message ``text`` in a step of its own
    (no database, no lease: what it emitted is in ``events``)."""
    from toren._core.actor import Context
    from toren.actors.channels import runtime
    from toren.actors.channels.actor import ChannelActor
    from toren.actors.channels.inbound import Inbound
    from toren.channels import PairingKey, Telegram

    actor_id = "channel/telegram/dailyunit"
    actor = ChannelActor(actor_id, {"bot": "dailyunit"})
    key = PairingKey(b"k" * 32)
    bot = runtime.Bot(agent=None, settings=Telegram(bot="dailyunit"), api=api, pairing=key)  # type: ignore[arg-type]
    ctx = Context(actor, state, 0, 1, None)
    update = {
        "update_id": update_id,
        "message": {
            "message_id": update_id,
            "date": 0,
            "chat": {"id": STRANGER, "type": "private"},
            "from": {"id": STRANGER, "is_bot": False, "first_name": "s"},
            "text": text,
        },
    }
    await Inbound(ctx, bot, actor_id).handle(update, polling=False)
    return ctx


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


async def test_odd_and_hostile_updates_are_passed_and_the_bot_goes_on(
    client: Client, bots: tuple[TelegramServer, Any]
) -> None:
    server, model = bots
    await paired(client, server, 100)
    server.push_message(100, "first", user_id=ALICE)
    await received(server, 100, lambda t: t == "echo: first")
    [first] = [m for m in server.sent(100) if m.text == "echo: first"]
    odd = [
        server.push_edited_message(100, first.message_id, "edited"),  # not a new message
        server.push_raw({"message": {"chat": {"id": "100"}, "text": 5, "from": []}}),
        server.push_raw({"callback_query": {"id": 5, "data": {"a": 1}, "message": "x"}}),
        server.push_raw({"poll": {"id": "1"}, "message": None}),
    ]
    second = server.push_message(100, "second", user_id=ALICE)
    await received(server, 100, lambda t: t == "echo: second")
    rows = await client.pool.fetch(
        "SELECT (data->>'update_id')::bigint AS id, data->>'outcome' AS outcome "
        "FROM toren.journal "
        "WHERE actor_id = 'channel/telegram/teller' AND type = 'update.handled' ORDER BY seq"
    )
    # From no chat, they did nothing: no row (anyone can send them), and the offset passed them.
    assert [(r["id"], r["outcome"]) for r in rows][-1] == (second, "forwarded")
    assert not [r for r in rows if r["id"] in odd]
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

    from toren._core.logs import configure

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


async def test_an_answer_reaches_the_chat_when_the_user_writes_again_while_the_model_answers(
    client: Client, bots: tuple[TelegramServer, Any]
) -> None:
    server, model = bots
    await paired(client, server, 600)
    first_call = model.hold(1)
    server.push_message(600, "first question", user_id=ALICE)
    with anyio.fail_after(20):
        await first_call.arrived.wait()
    server.push_message(600, "second question", user_id=ALICE)

    async def forwarded() -> bool:
        n = await client.pool.fetchval(
            "SELECT count(*) FROM toren.journal WHERE actor_id = 'channel/telegram/teller' "
            "AND type = 'update.handled' AND data->>'outcome' = 'forwarded'"
        )
        return bool(n)

    # The second message waits in the run's mailbox while the first is being answered.
    await wait_for(forwarded, what="the second message sent to the run")
    first_call.release()
    await received(server, 600, lambda t: t == "echo: second question")
    await received(server, 600, lambda t: t == "echo: first question")
    answers = [t for t in await texts(server, 600) if t.startswith("echo:")]
    assert answers == ["echo: first question", "echo: second question"]
