"""The channel's outbox: what it queues, in what order it sends, how fast, and how.

Every outbound message (a reply, an approval prompt, a notice, a file) is ``outbox.queued``
first, in the step that decided to send it, as pieces that each fit one Telegram message; a
later step sends one piece and records it (``outbox.sent``). Per chat, pieces go in order; a
chat gets at most one message per ``chat_interval``, the bot at most ``global_per_second``,
and a 429's ``retry_after`` holds every send back for that long.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable
from typing import Any

from toren import Context, TorenError
from toren.actors.channels import runtime
from toren.actors.channels.telegram import SendError
from toren.channels import TEXT_LIMIT, ChannelState, Outgoing, Queued, Telegram
from toren.sandboxes import SEND_MAX
from toren.sandboxes.checkpoints import read_file
from toren.sandboxes.store import StoreError, WorkspaceStore

APPROVE = "Approve"
DENY = "Deny"


def units(text: str) -> int:
    """Characters as Telegram counts them (UTF-16 code units)."""
    return len(text.encode("utf-16-le", "surrogatepass")) // 2


def clean(text: str) -> str:
    """Text Telegram takes: no NUL (shown as U+2400), no lone surrogate (U+FFFD), not empty."""
    text = text.replace("\x00", "\u2400")
    text = text.encode("utf-8", "replace").decode("utf-8")
    return text if text.strip() else "(empty)"


def split(text: str, limit: int = TEXT_LIMIT) -> list[str]:
    """``text`` in pieces of at most ``limit`` UTF-16 units, cut at a line break (or a space)
    in the last quarter of a piece when there is one."""
    pieces = []
    while units(text) > limit:
        cut = _fit(text, limit)
        window = text[:cut]
        for sep in ("\n", " "):
            at = window.rfind(sep)
            if at >= cut * 3 // 4:
                cut = at + 1
                break
        pieces.append(text[:cut])
        text = text[cut:]
    if text or not pieces:
        pieces.append(text)
    return pieces


def _fit(text: str, limit: int) -> int:
    """How many characters of ``text`` fit in ``limit`` UTF-16 units."""
    units = 0
    for i, ch in enumerate(text):
        units += 2 if ord(ch) > 0xFFFF else 1
        if units > limit:
            return max(i, 1)
    return len(text)


def cut(text: str, limit: int) -> str:
    """``text`` within ``limit`` UTF-16 units, marked when cut."""
    if units(text) <= limit:
        return text
    return text[: _fit(text, limit - 40)] + f"\n[cut: {len(text)} characters in all]"


def queue(
    ctx: Context[ChannelState],
    chat_id: int,
    text: str,
    *,
    kind: str = "text",
    thread: int | None = None,
    reply_to: int | None = None,
    decision: str | None = None,
    file: dict[str, Any] | None = None,
    source: str = "",
) -> None:
    """Queue ``text`` for ``chat_id`` (split into pieces that fit; a prompt's buttons go with
    its last piece)."""
    chat_id = ctx.state.migrated.get(str(chat_id), chat_id)
    pieces = split(clean(text)) if file is None else [cut(clean(text), 1024)]
    for i, piece in enumerate(pieces):
        last = i == len(pieces) - 1
        ctx.emit(
            Queued(
                n=ctx.state.next_n,
                chat_id=chat_id,
                kind=kind,
                text=piece,
                thread=thread,
                reply_to=reply_to if i == 0 else None,
                decision=decision if last else None,
                file=file,
                source=source,
                at=time.time(),
            )
        )


class Limits:
    """What holds sends back, in this activation: a 429's ``retry_after`` (for the whole bot)
    and the global rate. The per-chat interval is in the state (``last_sent``)."""

    def __init__(self) -> None:
        self.until = 0.0
        self.recent: collections.deque[float] = collections.deque()

    def hold(self, seconds: float) -> None:
        self.until = max(self.until, time.time() + seconds)

    def sent(self, at: float) -> None:
        self.recent.append(at)

    def wait(self, now: float, per_second: float) -> float:
        while self.recent and self.recent[0] <= now - 1.0:
            self.recent.popleft()
        wait = self.until - now
        if len(self.recent) >= per_second:
            wait = max(wait, self.recent[0] + 1.0 - now)
        return max(wait, 0.0)


def sending(state: ChannelState) -> bool:
    """Whether a message recorded ``sending`` waits for its send step (at-most-once)."""
    return any(state.outbox[str(n)].state == "sending" for n in state.pending)


def next_due(
    state: ChannelState, now: float, settings: Telegram, limits: Limits
) -> tuple[int | None, float | None]:
    """The next message to send now, or how long until one is due (``None``: nothing is
    pending). Only each chat's oldest pending message may go; one being sent at most once
    (``sending``) holds its chat until its step ends."""
    if not state.pending:
        return None, None
    held = limits.wait(now, settings.global_per_second)
    soonest: float | None = None
    seen: set[int] = set()
    for n in state.pending:
        outgoing = state.outbox[str(n)]
        chat = outgoing.chat_id
        if chat in seen:
            continue
        seen.add(chat)
        if outgoing.state == "sending":
            continue
        last = state.last_sent.get(str(chat), 0.0)
        wait = max(held, last + settings.chat_interval - now, 0.0)
        if wait <= 0:
            return n, 0.0
        soonest = wait if soonest is None else min(soonest, wait)
    return None, soonest


async def deliver(
    bot: runtime.Bot,
    outgoing: Outgoing,
    *,
    buttons: bool,
    store: Callable[[], WorkspaceStore],
) -> tuple[int, ...]:
    """Send one queued piece; its Telegram message ids. A prompt's piece that carries its
    decision id gets Approve / Deny buttons if ``buttons`` (the prompt decides from the chat);
    a file is read from ``store()``.

    Raises:
        SendError: not delivered (what to do is in its ``action``).
    """
    queued: Queued = outgoing.queued
    if queued.kind == "file" and queued.file is not None:
        data, name = await _file(queued.file, store())
        mid = await bot.api.send_document(
            outgoing.chat_id, data, name, caption=queued.text, thread=queued.thread
        )
        return (mid,)
    keyboard = None
    if queued.decision is not None and buttons:
        keyboard = [(APPROVE, f"a:{queued.decision}"), (DENY, f"d:{queued.decision}")]
    mid = await bot.api.send_text(
        outgoing.chat_id,
        queued.text,
        thread=queued.thread,
        reply_to=queued.reply_to,
        buttons=keyboard,
    )
    return (mid,)


async def _file(file: dict[str, Any], store: WorkspaceStore) -> tuple[bytes, str]:
    path = str(file.get("path", ""))
    checkpoint = str(file.get("checkpoint", ""))
    name = path.rstrip("/").rsplit("/", 1)[-1] or "file"
    try:
        data, size = await read_file(store, checkpoint, path, SEND_MAX)
    except (TorenError, StoreError, OSError) as exc:
        raise SendError("refused", f"{path} could not be read from its checkpoint: {exc}") from None
    if size > len(data):
        raise SendError("refused", f"{path} is {size} bytes, over {SEND_MAX}")
    return data, name
