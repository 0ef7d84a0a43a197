"""What the Telegram channel tests share: a model that answers chats, the local Bot API server
with the test bots' tokens, and waits on what a chat received."""

from __future__ import annotations

import contextlib
import itertools
import re
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from tests import telegram_app
from tests.conftest import person, running_worker, wait_for
from toren import Client
from toren._agent.app import load_app
from toren._agent.model import ToolCall
from toren.channels.client import pair
from toren.testing import AnthropicServer, Reply
from toren.testing.telegram_server import TelegramServer

TOKENS = {
    telegram_app.TOKEN_ENV: "1001:teller-token-for-tests",
    telegram_app.BRIEF_TOKEN_ENV: "1002:brief-token-for-tests",
    telegram_app.ONCE_TOKEN_ENV: "1003:once-token-for-tests",
    telegram_app.FILER_TOKEN_ENV: "1004:filer-token-for-tests",
    telegram_app.TOPICS_TOKEN_ENV: "1007:topics-token-for-tests",
    telegram_app.FRONT_TOKEN_ENV: "1008:front-token-for-tests",
    telegram_app.PAY_TOKEN_ENV: "1009:pay-token-for-tests",
}
TELLER = TOKENS[telegram_app.TOKEN_ENV]
BRIEF = TOKENS[telegram_app.BRIEF_TOKEN_ENV]
ONCE = TOKENS[telegram_app.ONCE_TOKEN_ENV]
FILER = TOKENS[telegram_app.FILER_TOKEN_ENV]
TOPICS = TOKENS[telegram_app.TOPICS_TOKEN_ENV]
FRONT = TOKENS[telegram_app.FRONT_TOKEN_ENV]
PAY = TOKENS[telegram_app.PAY_TOKEN_ENV]
_ids = itertools.count(1)
ALICE = 501  # a user who pairs and talks
APPROVER = telegram_app.APPROVER


def _last_user(body: dict[str, Any]) -> tuple[str, list[str]]:
    """The last user turn's text and tool results."""
    message = body["messages"][-1]
    content = message["content"]
    if isinstance(content, str):
        return content, []
    texts, results = [], []
    for block in content:
        if block.get("type") == "text":
            texts.append(block.get("text", ""))
        elif block.get("type") == "tool_result":
            c = block.get("content")
            if isinstance(c, list):
                c = "".join(x.get("text", "") for x in c)
            results.append(str(c))
    return "\n".join(texts), results


def answer(body: dict[str, Any], n: int) -> Reply:
    """``refund N`` asks for a refund (a tool call needing approval), ``refund N noting TEXT``
    with a note, ``refund N with a K-character note`` with a note of K characters; ``ask the
    clerk to ...`` calls the clerk agent with the rest; ``long N`` answers N characters;
    ``send PATH`` sends a workspace file; ``pay N`` asks the pay agent, which takes ``transfer N``
    as a transfer (needing approval); anything else is echoed."""
    text, results = _last_user(body)
    if results:
        return Reply(f"done: {' | '.join(results)}")
    if m := re.search(r"pay (\d+)", text):
        ask = ToolCall(
            id=f"c{next(_ids)}", name="call_pay", arguments={"input": f"transfer {m[1]}"}
        )
        return Reply([ask])
    if m := re.search(r"transfer (\d+)", text):
        return Reply(
            [ToolCall(id=f"c{next(_ids)}", name="transfer", arguments={"amount": int(m[1])})]
        )
    if m := re.search(r"ask the clerk to (.+)", text, re.S):
        return Reply([ToolCall(id=f"c{next(_ids)}", name="call_clerk", arguments={"input": m[1]})])
    if m := re.search(r"refund (\d+)(?: noting (.+)| with a (\d+)-character note)?", text, re.S):
        arguments: dict[str, Any] = {"amount": int(m[1])}
        if m[2] or m[3]:
            arguments["note"] = m[2] or "".join(f"{i:09d}\n" for i in range(int(m[3]) // 10))
        return Reply([ToolCall(id=f"c{next(_ids)}", name="refund", arguments=arguments)])
    if m := re.search(r"long (\d+)", text):
        size = int(m[1])
        lines = "".join(f"line {i:06d} of a long answer\n" for i in range(size // 28 + 1))
        return Reply(lines[:size])
    if m := re.search(r"send (\S+)", text):
        call = ToolCall(id=f"c{next(_ids)}", name="send_file", arguments={"path": m[1]})
        return Reply([call])
    return Reply(f"echo: {text}")


@contextlib.asynccontextmanager
async def chat_model(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[AnthropicServer]:
    async with AnthropicServer(answer) as server:
        for name, value in server.env().items():
            monkeypatch.setenv(name, value)
        yield server


@contextlib.asynccontextmanager
async def telegram(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[TelegramServer]:
    """The local Bot API server with the test bots; their tokens in the environment."""
    async with TelegramServer(token=TELLER) as server:
        server.add_bot(BRIEF, username="brief_test_bot")
        server.add_bot(ONCE, username="once_test_bot")
        server.add_bot(FILER, username="filer_test_bot")
        server.add_bot(TOPICS, username="topics_test_bot")
        server.add_bot(FRONT, username="front_test_bot")
        server.add_bot(PAY, username="pay_test_bot")
        for name, value in TOKENS.items():
            monkeypatch.setenv(name, value)
        yield server


async def texts(server: TelegramServer, chat_id: int, token: str = TELLER) -> list[str]:
    return [m.text for m in server.sent(chat_id, token=token)]


async def received(
    server: TelegramServer,
    chat_id: int,
    check: Callable[[str], bool],
    *,
    token: str = TELLER,
    timeout: float = 30.0,
) -> Any:
    """Wait for a message to ``chat_id`` whose text passes ``check``; returns it."""

    async def found() -> Any:
        for m in server.sent(chat_id, token=token):
            if check(m.text or ""):
                return m
        return None

    return await wait_for(found, timeout=timeout, what=f"a message to chat {chat_id}")


async def polled_past(server: TelegramServer, update_id: int, *, token: str = TELLER) -> None:
    """Wait until the bot asked for the updates after ``update_id``: the step that handled it
    has committed (a channel polls again only in its next step), whether or not it recorded
    it (an unpaired chat's update that did nothing leaves no row)."""

    async def past() -> bool:
        return (server.confirmed_offset(token) or 0) > update_id

    await wait_for(past, what=f"getUpdates asked past update {update_id}")


async def channel_row(client: Client, bot: str) -> dict[str, Any] | None:
    row = await client.pool.fetchrow(
        "SELECT summary FROM toren.actors WHERE actor_id = $1", f"channel/telegram/{bot}"
    )
    return row["summary"] if row and isinstance(row["summary"], dict) else None


@pytest.fixture
async def channel_worker(
    db_url: str, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[tuple[TelegramServer, Any, Any]]:
    """The Bot API server, the model server and the worker running the test bots."""
    load_app("tests.telegram_app")
    async with (
        telegram(monkeypatch) as server,
        chat_model(monkeypatch) as model,
        running_worker(db_url, telegram_api_url=server.url) as worker,
    ):
        yield server, model, worker


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


async def paired(client: Client, server: TelegramServer, chat_id: int, user: int = ALICE) -> None:
    """Pair ``chat_id`` with the teller agent (a code issued, ``/pair CODE`` sent by ``user``)."""
    code, _ = await pair(client, "teller", by=person("op"))
    server.push_message(chat_id, f"/pair {code}", user_id=user)
    await received(server, chat_id, lambda t: t.startswith("Paired with teller"))


@pytest.fixture
async def filer(
    db_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[TelegramServer]:
    """The filer bot (an agent with a workspace) on a worker with real Docker (skipped with
    the reason without it, failed under CI=true)."""
    from tests.sandbox_support import unavailable
    from toren.actors.sandboxes.docker import Docker, Unavailable
    from toren.sandboxes import DEFAULT_IMAGE

    try:
        docker = await Docker.connect()
        await docker.check_image(DEFAULT_IMAGE)
        await docker.close()
    except Unavailable as exc:
        unavailable(str(exc))
    load_app("tests.telegram_app")
    async with (
        telegram(monkeypatch) as server,
        chat_model(monkeypatch),
        running_worker(
            db_url,
            telegram_api_url=server.url,
            sandboxes=True,
            workspace_store=str(tmp_path / "workspaces"),
        ),
    ):
        yield server
