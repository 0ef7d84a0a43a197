"""Files over Telegram, on real Docker: a document or photo a chat sends lands in the run's
workspace (within its size limit, under a safe name); the agent sends a workspace file back with
``send_file``; an agent without a workspace refuses files."""

from __future__ import annotations

from typing import Any

import pytest

import toren.providers.anthropic  # noqa: F401  (the SDK import is paid here, not in a step)
from tests.conftest import person, wait_for
from tests.telegram_support import ALICE, FILER, filer, paired, received
from toren import Client
from toren.channels.client import pair
from toren.testing.telegram_server import TelegramServer

pytestmark = pytest.mark.anyio
__all__ = ["filer"]  # the fixture


async def test_a_file_goes_into_the_workspace_and_comes_back_with_send_file(
    client: Client, filer: TelegramServer
) -> None:
    server = filer
    code, _ = await pair(client, "filer", by=person("op"))
    server.push_message(100, f"/pair {code}", user_id=ALICE, token=FILER)
    await received(server, 100, lambda t: t.startswith("Paired with filer"), token=FILER)

    content = b"hello from a chat\x00\xff binary too\n"
    server.push_document(
        100,
        "../../etc/notes.txt",
        content,
        caption="send uploads/notes.txt",
        user_id=ALICE,
        token=FILER,
    )
    await received(server, 100, lambda t: t.startswith("done:"), token=FILER, timeout=90)

    async def document() -> Any:
        files = [m for m in server.sent(100, token=FILER) if m.kind == "document"]
        return files[0] if files else None

    sent = await wait_for(document, timeout=30, what="the file sent back")
    assert sent.filename == "notes.txt"  # the name made safe: no directories
    assert sent.data == content

    server.push_document(100, "big.bin", b"x" * (64 * 1024 + 1), user_id=ALICE, token=FILER)
    await received(server, 100, lambda t: "at most 65536" in t, token=FILER)


async def test_an_agent_without_a_workspace_refuses_files(
    client: Client, filer: TelegramServer
) -> None:
    server = filer
    await paired(client, server, 100)
    server.push_document(100, "a.txt", b"hi", user_id=ALICE)
    await received(server, 100, lambda t: "has no workspace" in t)
