"""Telegram updates as the channel reads them: the few fields it uses, checked and capped
(:func:`parse`), and what a text is addressed to (:func:`addressed`, :func:`command_of`)."""

from __future__ import annotations

import re
from typing import Any

import attrs

from toren import InternalError

YES = {"approve", "approved", "yes", "y", "ok", "allow", "\u2705", "\U0001f44d"}
NO = {"deny", "denied", "no", "n", "reject", "refuse", "\u274c", "\U0001f44e"}
CALLBACK = re.compile(r"([ad]):([A-Za-z0-9_-]{1,40})")
CALLBACK_TEXT = 200  # characters a button's answer shows (answerCallbackQuery's text)


@attrs.frozen(kw_only=True)
class Update:
    """What the channel reads of an update (every field checked: updates are untrusted)."""

    update_id: int
    kind: str = "other"  # message, callback, document, photo, migrated, other
    chat_id: int | None = None
    chat_type: str = ""
    chat_title: str = ""
    user_id: int | None = None
    user_name: str = ""
    text: str = ""
    message_id: int | None = None
    reply_to: int | None = None
    reply_to_bot: bool = False
    thread: int | None = None
    callback_id: str = ""
    callback_data: str = ""
    file_id: str = ""
    file_name: str = ""
    file_size: int | None = None
    migrate_to: int | None = None

    @property
    def chat(self) -> int:
        """The chat it came from (the caller checked that it has one)."""
        if self.chat_id is None:
            raise InternalError(f"update {self.update_id} has no chat")
        return self.chat_id


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _str(value: Any, cap: int = 1 << 20) -> str:
    return value[:cap] if isinstance(value, str) else ""


def _dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def parse(raw: dict[str, Any], bot_id: int) -> Update | None:
    """The update's fields the channel uses; ``None`` without an integer ``update_id``."""
    update_id = _int(raw.get("update_id"))
    if update_id is None:
        return None
    callback = _dict(raw.get("callback_query"))
    # An edited message is not a new one: it is recorded and ignored (kind "other").
    message = _dict(raw.get("message") or callback.get("message"))
    chat = _dict(message.get("chat"))
    user = _dict(callback.get("from") or message.get("from"))
    reply = _dict(message.get("reply_to_message"))
    fields: dict[str, Any] = {
        "update_id": update_id,
        "chat_id": _int(chat.get("id")),
        "chat_type": _str(chat.get("type"), 40),
        "chat_title": _str(
            chat.get("title") or chat.get("username") or chat.get("first_name"), 200
        ),
        "user_id": _int(user.get("id")),
        "user_name": _str(user.get("username") or user.get("first_name"), 200),
        "message_id": _int(message.get("message_id")),
        "reply_to": _int(reply.get("message_id")),
        "reply_to_bot": _int(_dict(reply.get("from")).get("id")) == bot_id,
        "thread": _int(message.get("message_thread_id"))
        if message.get("is_topic_message")
        else None,
    }
    if callback:
        return Update(
            kind="callback",
            callback_id=_str(callback.get("id"), 200),
            callback_data=_str(callback.get("data"), 200),
            **fields,
        )
    if _int(message.get("migrate_to_chat_id")) is not None:
        return Update(kind="migrated", migrate_to=_int(message.get("migrate_to_chat_id")), **fields)
    text = _str(message.get("text") or message.get("caption"))
    document = _dict(message.get("document"))
    photos = message.get("photo")
    if document:
        return Update(
            kind="document",
            text=text,
            file_id=_str(document.get("file_id"), 300),
            file_name=_str(document.get("file_name"), 255),
            file_size=_int(document.get("file_size")),
            **fields,
        )
    if isinstance(photos, list) and photos and isinstance(photos[-1], dict):
        photo = photos[-1]  # the largest size comes last
        return Update(
            kind="photo",
            text=text,
            file_id=_str(photo.get("file_id"), 300),
            file_name=f"photo-{update_id}.jpg",
            file_size=_int(photo.get("file_size")),
            **fields,
        )
    if message:
        return Update(kind="message", text=text, **fields)
    return Update(**fields)


def addressed(update: Update, username: str) -> tuple[bool, str]:
    """Whether a group message is for the bot, and its text without the bot's name."""
    text = update.text
    if not username:
        return update.reply_to_bot, text
    mention = re.compile(rf"@{re.escape(username)}\b", re.IGNORECASE)
    if mention.search(text):
        return True, mention.sub("", text, count=1).strip()
    return update.reply_to_bot, text


def command_of(text: str, username: str) -> tuple[str, str]:
    """``/cmd ARG`` (or ``/cmd@thisbot ARG``) as (``/cmd``, ``ARG``); ("", "") for text that is
    not a command, or is one for another bot (``/cmd@otherbot``)."""
    match = re.fullmatch(r"\s*(/[A-Za-z_]{1,32})(?:@(\w+))?(?:\s+(.*))?", text, re.DOTALL)
    if match is None:
        return "", ""
    if match.group(2) and match.group(2).lower() != username.lower():
        return "", ""
    return match.group(1).lower(), (match.group(3) or "").strip()
