"""Agents for the compaction tests: a reader of long pages on a small context window, and the
script a local model server answers them with."""

from __future__ import annotations

import hashlib
from typing import Any

from toren import Agent, Retention, ToolContext, tool
from toren._agent.model import Text, ToolCall
from toren.actors.runs.summarising import SUMMARISER
from toren.testing import Reply

WINDOW = 8192


def page_text(n: int, size: int) -> str:
    """Page ``n``: ``size`` bytes of text that differ from page to page (and compress badly)."""
    words = []
    seed = f"page {n}".encode()
    while sum(len(w) + 1 for w in words) < size:
        seed = hashlib.sha256(seed).digest()
        words.append(seed.hex()[: 4 + seed[0] % 8])
    return f"page {n}: " + " ".join(words)[: size - len(f"page {n}: ")]


@tool(effects="read")
async def fetch(ctx: ToolContext, n: int, size: int = 3000) -> str:
    """Fetch page ``n`` of the archive."""
    return page_text(n, size)


reader = Agent(
    name="reader",
    model="anthropic/claude-sonnet-4-6",
    system="You read the archive page by page.",
    tools=[fetch],
    context_window=WINDOW,
)
# The reader of a conversation that never ends: its old turns let go of after each hard
# compaction (history.released; its journal is kept whole where no archive store is set).
keeper = Agent(
    name="keeper",
    model="anthropic/claude-sonnet-4-6",
    system="You read the archive page by page.",
    tools=[fetch],
    context_window=WINDOW,
    retention=Retention(archive=True, conversation_keep_for=3600.0),
)
# The window comes from the price library (far larger than the server's): only the server's
# refusal makes it compact.
unaware = Agent(
    name="unaware",
    model="anthropic/claude-sonnet-4-6",
    system="You read the archive page by page.",
    tools=[fetch],
)


def _last_page(body: dict[str, Any]) -> int:
    """The page the last tool call in the request asked for (0: none yet)."""
    for message in reversed(body.get("messages", [])):
        if message["role"] != "assistant" or isinstance(message["content"], str):
            continue
        for block in reversed(message["content"]):
            if block.get("type") == "tool_use":
                return int(block["input"]["n"])
    return 0


def pages(count: int, size: Any = 3000, done: str = "All pages read.") -> Any:
    """A script: fetch pages 1 to ``count`` (``size`` bytes each, or ``size(n)``), then answer
    ``done``; answer a summary request with a short summary. It answers by the request's
    content, not by arrival order, so a request made again gets the same answer."""

    def respond(body: dict[str, Any], n: int) -> Reply:
        system = body.get("system")
        if system == SUMMARISER or (isinstance(system, list) and system[0]["text"] == SUMMARISER):
            return Reply(f"The agent has been reading the archive ({_summarised(body)}).")
        page = _last_page(body) + 1
        if page > count:
            return Reply(done)
        bytes_ = size(page) if callable(size) else size
        call = ToolCall(id=f"p{page}", name="fetch", arguments={"n": page, "size": bytes_})
        return Reply([Text(text=f"Reading page {page}."), call])

    return respond


def _summarised(body: dict[str, Any]) -> str:
    content = body["messages"][0]["content"]
    text = content if isinstance(content, str) else content[0]["text"]
    return f"{text.count('Result of fetch')} page results summarised"
