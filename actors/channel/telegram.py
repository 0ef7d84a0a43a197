"""The Bot API through python-telegram-bot, shaped for the channel actor.

Updates are read raw (``getUpdates`` through :meth:`telegram.Bot.do_api_request`, not parsed into
PTB's objects): an update PTB cannot parse must still advance the offset and be recorded, never
stall the channel. Sends use PTB's typed methods. Failures come back as :class:`SendError` with
what the actor must do (wait, mark the chat blocked, follow a migration, give up), and no text
that could hold the token.
"""

from __future__ import annotations

import datetime as dtm
import logging
import os
from pathlib import PurePosixPath
from typing import Any

import anyio
import attrs

# RetryAfter.retry_after as a timedelta, the behaviour PTB moves to (without it, every RetryAfter
# warns that it is deprecated). Toren reads either form.
os.environ.setdefault("PTB_TIMEDELTA", "true")

import telegram
from telegram import InlineKeyboardButton, InlineKeyboardMarkup, ReplyParameters
from telegram.error import (
    BadRequest,
    ChatMigrated,
    Forbidden,
    InvalidToken,
    NetworkError,
    RetryAfter,
    TelegramError,
    TimedOut,
)
from telegram.request import HTTPXRequest

from toren.channels import redact

# httpx logs every request's URL at INFO, and the URL holds the token.
logging.getLogger("httpx").setLevel(logging.WARNING)

ALLOWED_UPDATES = ("message", "edited_message", "callback_query", "my_chat_member")


@attrs.frozen
class SendError(Exception):
    """A send that did not deliver.

    ``action``: ``retry`` (after ``retry_after`` seconds: flood control or a network fault),
    ``blocked`` (403: the user blocked the bot or left), ``migrated`` (the group became
    supergroup ``new_chat_id``), ``refused`` (400 and the like: sending again cannot help).
    """

    action: str
    detail: str
    retry_after: float = 0.0
    new_chat_id: int = 0

    def __str__(self) -> str:
        return f"{self.action}: {self.detail}"


def _seconds(value: int | dtm.timedelta) -> float:
    return value.total_seconds() if isinstance(value, dtm.timedelta) else float(value)


def classify(exc: Exception) -> SendError:
    """What a PTB error means for a send."""
    detail = redact(str(exc))[:500]
    if isinstance(exc, RetryAfter):
        return SendError("retry", detail, retry_after=max(_seconds(exc.retry_after), 0.5))
    if isinstance(exc, ChatMigrated):
        return SendError("migrated", detail, new_chat_id=int(exc.new_chat_id))
    if isinstance(exc, Forbidden):
        return SendError("blocked", detail)
    if isinstance(exc, InvalidToken):
        return SendError("retry", "the bot token was refused", retry_after=30.0)
    if isinstance(exc, BadRequest):
        return SendError("refused", detail)
    if isinstance(exc, TimedOut | NetworkError):
        return SendError("retry", detail, retry_after=2.0)
    return SendError("retry", detail, retry_after=5.0)


class BotApi:
    """One bot's connection to the Bot API (``api_url`` is Telegram's, or a local server's)."""

    def __init__(self, token: str, api_url: str) -> None:
        base = api_url.rstrip("/")
        # Our own request objects, so that closing them is ours to do (the bot is never
        # initialize()d: that would call getMe at boot, and an outage would stop the worker).
        self._requests = (HTTPXRequest(connection_pool_size=4), HTTPXRequest())
        self.bot = telegram.Bot(
            token,
            base_url=f"{base}/bot",
            base_file_url=f"{base}/file/bot",
            request=self._requests[0],
            get_updates_request=self._requests[1],
        )

    async def close(self) -> None:
        for request in self._requests:
            await request.shutdown()

    async def get_me(self) -> tuple[int, str]:
        """The bot's id and username."""
        me = await self.bot.get_me()
        return me.id, me.username or ""

    async def delete_webhook(self) -> None:
        await self.bot.delete_webhook(drop_pending_updates=False)

    async def set_webhook(self, url: str, secret: str) -> None:
        await self.bot.set_webhook(url, secret_token=secret, allowed_updates=list(ALLOWED_UPDATES))

    async def get_updates(self, offset: int, wait: float) -> list[dict[str, Any]]:
        """Raw updates from ``offset`` on, waiting up to ``wait`` seconds for one."""
        kwargs: dict[str, Any] = {
            "timeout": int(wait),
            "limit": 100,
            "allowed_updates": list(ALLOWED_UPDATES),
        }
        if offset:
            kwargs["offset"] = offset
        # Raw, through do_api_request: PTB would parse them (and fail on one it cannot read).
        # Bot API method names are case-insensitive; "getupdates" is not the name of a typed
        # PTB method, so PTB does not warn that one exists.
        result = await self.bot.do_api_request(
            "getupdates", api_kwargs=kwargs, read_timeout=wait + 10
        )
        return [u for u in result if isinstance(u, dict)] if isinstance(result, list) else []

    async def send_text(
        self,
        chat_id: int,
        text: str,
        *,
        thread: int | None = None,
        reply_to: int | None = None,
        buttons: list[tuple[str, str]] | None = None,
    ) -> int:
        """Send plain text (no parse mode: nothing to escape); returns its message id.

        Raises:
            SendError: it was not delivered.
        """
        markup = None
        if buttons:
            markup = InlineKeyboardMarkup(
                [[InlineKeyboardButton(label, callback_data=data) for label, data in buttons]]
            )
        reply = ReplyParameters(reply_to, allow_sending_without_reply=True) if reply_to else None
        try:
            message = await self.bot.send_message(
                chat_id,
                text,
                message_thread_id=thread,
                reply_parameters=reply,
                reply_markup=markup,
                disable_notification=False,
            )
        except TelegramError as exc:
            raise classify(exc) from None
        return message.message_id

    async def send_document(
        self, chat_id: int, data: bytes, filename: str, *, caption: str, thread: int | None
    ) -> int:
        """Send a file; returns its message id.

        Raises:
            SendError: it was not delivered.
        """
        try:
            message = await self.bot.send_document(
                chat_id,
                data,
                filename=filename,
                caption=caption or None,
                message_thread_id=thread,
                read_timeout=120,
                write_timeout=120,
            )
        except TelegramError as exc:
            raise classify(exc) from None
        return message.message_id

    async def answer_callback(self, callback_id: str, text: str) -> None:
        """Answer a button press (shown to the user who pressed). A failure is only logged:
        the press was handled either way."""
        try:
            await self.bot.answer_callback_query(callback_id, text=text[:200])
        except TelegramError as exc:
            logging.getLogger("toren.channel").warning(
                "answering a button press failed: %s", redact(str(exc))
            )

    async def download(self, file_id: str, cap: int) -> bytes:
        """A file a user sent, at most ``cap`` bytes.

        Raises:
            SendError: it could not be fetched (``refused``: too large or gone).
        """
        try:
            file = await self.bot.get_file(file_id)
            # PTB reads a file_path naming a file on this machine from disk instead of
            # downloading it: a Bot API server (or whoever poses as one) could have a local
            # file put into the workspace. Only a relative path without .. is downloaded.
            path = PurePosixPath(file.file_path or "")
            local = await anyio.Path(str(path)).exists()
            if not file.file_path or path.is_absolute() or ".." in path.parts or local:
                shown = str(path)[:80]
                raise SendError("refused", f"the server gave an unsafe file path {shown!r}")
            if file.file_size is not None and file.file_size > cap:
                raise SendError("refused", f"the file is {file.file_size} bytes, over {cap}")
            data = bytes(await file.download_as_bytearray())
        except TelegramError as exc:
            raise classify(exc) from None
        if len(data) > cap:
            raise SendError("refused", f"the file is {len(data)} bytes, over {cap}")
        return data
