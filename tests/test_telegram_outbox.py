"""The Telegram outbox against a local Bot API server: long replies split in order, hostile
text, 429 retry_after respected, 403 marks the chat blocked, a migrated group followed, group
chats answered only when addressed, at-most-once delivery."""

from __future__ import annotations

from typing import Any

import pytest

import toren.providers.anthropic  # noqa: F401  (the SDK import is paid here, not in a step)
from tests.conftest import wait_for
from tests.telegram_support import (
    ALICE,
    ONCE,
    bots,
    channel_row,
    paired,
    received,
)
from toren import Client
from toren.channels.client import messages
from toren.runs import read_run
from toren.testing.telegram_server import TelegramServer

pytestmark = pytest.mark.anyio
__all__ = ["bots"]  # the fixture


async def states(client: Client, agent: str = "teller") -> list[tuple[str, str]]:
    return [(m["state"], m["text"]) for m in await messages(client, agent)]


async def test_a_long_reply_is_split_at_telegrams_limit_and_sent_in_order(
    client: Client, bots: tuple[TelegramServer, Any]
) -> None:
    server, _ = bots
    await paired(client, server, 100)
    server.push_message(100, "long 10000", user_id=ALICE)
    await wait_for(
        lambda: _sent_count(server, 100, lambda t: t.startswith("line "), 3), what="3 parts"
    )
    parts = [m for m in server.sent(100) if m.text and m.text.startswith("line ")]
    assert len(parts) == 3
    assert all(len(p.text or "") <= 4096 for p in parts)
    assert all(p.text and p.text.endswith("\n") for p in parts[:-1])  # cut at line breaks
    assert (
        "".join(p.text or "" for p in parts)
        == "".join(f"line {i:06d} of a long answer\n" for i in range(10000 // 28 + 1))[:10000]
    )
    assert [p.message_id for p in parts] == sorted(p.message_id for p in parts)


async def test_hostile_text_reaches_the_run_verbatim_and_goes_back_as_telegram_takes_it(
    client: Client, bots: tuple[TelegramServer, Any]
) -> None:
    server, model = bots
    await paired(client, server, 100)
    hostile = "a\x00b <b>bold</b> *x* _y_ [z](http://e.x) \u202e \U0001f600"
    server.push_message(100, hostile, user_id=ALICE)
    echoed = await received(server, 100, lambda t: t.startswith("echo: a"))
    assert echoed.text == "echo: " + hostile.replace("\x00", "\u2400")  # no NUL over the wire
    assert echoed.parse_mode is None  # plain text: nothing to escape, nothing interpreted
    summary = await channel_row(client, "teller")
    assert summary is not None
    state = await read_run(client, summary["chats"][0]["run"])
    assert state.input == hostile  # the journal keeps what was sent, NUL included

    requests = len(model.requests)
    server.push_message(100, "x" * 100_000, user_id=ALICE)  # over Toren's 64 KiB cap: refused
    await received(server, 100, lambda t: "over 65536 bytes: send it in parts" in t)
    server.push_message(100, "y" * 60_000, user_id=ALICE)  # under it: 15 Telegram messages back
    await wait_for(
        lambda: _sent_count(server, 100, lambda t: set(t) <= set("echo: y"), 15),
        what="the long echo in 15 parts",
    )
    assert len(model.requests) == requests + 1  # the refused one reached nothing


async def test_429_retry_after_is_respected_and_403_marks_the_chat_blocked(
    client: Client, bots: tuple[TelegramServer, Any]
) -> None:
    server, _ = bots
    await paired(client, server, 100)
    server.limit_rate(per_chat_interval=3, retry_after=1)  # Telegram's flood control, strict
    server.push_message(100, "first", user_id=ALICE)
    await received(server, 100, lambda t: t == "echo: first")
    server.push_message(100, "second", user_id=ALICE)  # its echo comes too soon: 429s
    await received(server, 100, lambda t: t == "echo: second")
    assert server.throttled
    assert server.violations() == []  # nothing sent inside a retry_after window
    server.limit_rate()

    server.block(100)
    server.push_message(100, "blocked one", user_id=ALICE)

    async def blocked() -> bool:
        summary = await channel_row(client, "teller")
        return bool(summary and summary["chats"][0]["blocked"])

    await wait_for(blocked, what="the chat marked blocked")
    assert ("blocked", "echo: blocked one") in await states(client)
    tries = len([c for c in server.calls("sendMessage") if c.chat_id == 100])
    server.push_message(101, "hello from elsewhere", user_id=ALICE)  # the bot goes on
    await received(server, 101, lambda t: "not paired" in t)
    assert len([c for c in server.calls("sendMessage") if c.chat_id == 100]) == tries  # no retry

    server.unblock(100)
    server.push_message(100, "third", user_id=ALICE)  # writing again unblocks the chat
    await received(server, 100, lambda t: t == "echo: third")


async def test_a_group_answers_only_when_addressed_and_follows_its_migration(
    client: Client, bots: tuple[TelegramServer, Any]
) -> None:
    server, model = bots
    group = -5001
    server.add_chat(group, "group", "team")
    await paired(client, server, group)
    server.push_message(group, "just chatting", user_id=ALICE)
    server.push_message(group, "@toren_test_bot hello bot", user_id=ALICE)
    await received(server, group, lambda t: t == "echo: hello bot")
    assert len(model.requests) == 1  # the unaddressed message reached nothing

    server.migrate(group, -100777)
    server.push_message(group, "@toren_test_bot after the upgrade", user_id=ALICE)
    await received(server, -100777, lambda t: t == "echo: after the upgrade")

    async def recorded() -> bool:  # received by Telegram first, then recorded sent
        return ("sent", "echo: after the upgrade") in await states(client)

    await wait_for(recorded, what="the reply recorded sent")


async def test_at_most_once_delivery_sends_each_message_once(
    client: Client, bots: tuple[TelegramServer, Any]
) -> None:
    server, _ = bots
    from toren._agent.principal import Principal
    from toren.channels.client import pair

    code, _ = await pair(client, "once", by=Principal.os_user("test"))
    server.push_message(100, f"/pair {code}", user_id=ALICE, token=ONCE)
    await received(server, 100, lambda t: t.startswith("Paired with once"), token=ONCE)
    server.push_message(100, "hi once", user_id=ALICE, token=ONCE)
    await received(server, 100, lambda t: t == "echo: hi once", token=ONCE)
    sent = [m.text for m in server.sent(100, token=ONCE)]
    assert sent == ["Paired with once. Write to talk to it.", "echo: hi once"]

    async def recorded() -> bool:  # received by Telegram first, then recorded sent
        return [s for s, _ in await states(client, "once")] == ["sent", "sent"]

    await wait_for(recorded, what="both recorded sent")


async def _sent_count(server: TelegramServer, chat: int, check: Any, n: int) -> bool:
    return sum(bool(m.text and check(m.text)) for m in server.sent(chat)) >= n
