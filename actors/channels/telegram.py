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
import math
import os
import re
from typing import Any

import attrs
import httpx

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
    # Telegram may have delivered it (no answer came: a read timeout, a dropped connection, a
    # 5xx): sending again may send twice.
    ambiguous: bool = False

    def __str__(self) -> str:
        return f"{self.action}: {self.detail}"


def _seconds(value: int | dtm.timedelta) -> float:
    return value.total_seconds() if isinstance(value, dtm.timedelta) else float(value)


def _unsent(exc: Exception) -> bool:
    """Whether the request cannot have reached Telegram (no connection was made)."""
    cause = exc.__cause__
    return isinstance(cause, httpx.ConnectError | httpx.ConnectTimeout | httpx.PoolTimeout)


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
        return SendError("retry", "Telegram refused the bot token", retry_after=30.0)
    if isinstance(exc, BadRequest):
        return SendError("refused", detail)
    if isinstance(exc, TimedOut | NetworkError):
        return SendError("retry", detail, retry_after=2.0, ambiguous=not _unsent(exc))
    return SendError("retry", detail, retry_after=5.0, ambiguous=True)


_FILE_PATH = re.compile(r"[A-Za-z0-9_.-][A-Za-z0-9_./-]{0,511}")


class BotApi:
    """One bot's connection to the Bot API (``api_url`` is Telegram's, or a local server's)."""

    def __init__(self, token: str, api_url: str) -> None:
        base = api_url.rstrip("/")
        self._files = f"{base}/file/bot{token}"  # never logged: holds the token
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
            "timeout": math.ceil(wait),
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
        """A file a user sent, at most ``cap`` bytes (counted as they arrive, whatever size
        the Bot API announced).

        The file's path from ``getFile`` is checked (relative, no ``..``, a plain alphabet)
        and fetched here: python-telegram-bot would read a path naming a file on this machine
        from disk, and its errors quote the URL, which holds the token.

        Raises:
            SendError: it could not be fetched (``refused``: too large, gone, an unusable path).
        """
        try:
            info = await self.bot.do_api_request("getfile", api_kwargs={"file_id": file_id})
        except TelegramError as exc:
            raise classify(exc) from None
        info = info if isinstance(info, dict) else {}
        path, size = info.get("file_path"), info.get("file_size")
        if not isinstance(path, str) or not _FILE_PATH.fullmatch(path) or ".." in path.split("/"):
            raise SendError("refused", "the Bot API gave no usable path for the file")
        if isinstance(size, int) and size > cap:
            raise SendError("refused", f"the file is {size} bytes, over {cap}")
        data = bytearray()
        try:
            async with (
                httpx.AsyncClient(timeout=120) as http,
                http.stream("GET", f"{self._files}/{path}") as response,
            ):
                if response.status_code != 200:
                    raise SendError(
                        "refused", f"the file could not be fetched ({response.status_code})"
                    )
                async for chunk in response.aiter_bytes():
                    data += chunk
                    if len(data) > cap:
                        raise SendError("refused", f"the file is over {cap} bytes")
        except httpx.HTTPError as exc:
            raise SendError(
                "refused", f"the file could not be fetched ({type(exc).__name__})"
            ) from None
        return bytes(data)
