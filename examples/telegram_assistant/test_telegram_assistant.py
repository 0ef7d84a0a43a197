"""The Telegram assistant, run offline on a real worker and Postgres, its bot talking to a local
Telegram Bot API server through python-telegram-bot: a chat pairs, asks, and reads the reply."""

from __future__ import annotations

import anyio
import pytest

from examples.telegram_assistant.app import TOKEN_ENV
from examples.telegram_assistant.model import script
from toren import Principal
from toren.channels.client import pair
from toren.testing import harness
from toren.testing.telegram_server import TelegramServer

pytestmark = pytest.mark.anyio

TOKEN = "4242:assistant-token-for-tests"  # noqa: S105  (a local test bot)
CHAT = 100
USER = 501


async def test_a_paired_chat_asks_and_sees_the_reply() -> None:
    operator = Principal(kind="os_user", id="example-operator", name="operator", via="test")
    async with (
        TelegramServer(token=TOKEN, username="assistant_test_bot") as bot,
        harness(
            "examples.telegram_assistant.app",
            script,
            env={TOKEN_ENV: TOKEN},
            telegram_api_url=bot.url,
        ) as h,
    ):

        def texts() -> list[str]:
            return [m.text or "" for m in bot.sent(CHAT)]

        code, _expires = await pair(h.client, "telegram_assistant", by=operator)
        bot.push_message(CHAT, f"/pair {code}", user_id=USER)
        with anyio.fail_after(30):
            await bot.until(lambda: any(t.startswith("Paired with") for t in texts()))

        bot.push_message(CHAT, "What is the time in Oslo?", user_id=USER)
        with anyio.fail_after(30):
            await bot.until(lambda: "Europe/Oslo (UTC+1)" in texts())
        bot.push_message(CHAT, "thanks", user_id=USER)
        with anyio.fail_after(30):
            await bot.until(lambda: "You said: thanks" in texts())
        assert len(h.model.requests) == 3  # the question, the tool's result, the thanks
