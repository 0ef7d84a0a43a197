"""What a test does with :class:`~toren.testing.telegram_server.TelegramServer`: play the users,
and read what the bot did.

Each push builds the update Telegram would send (a ``Message`` with its ``from`` and ``chat``,
entities marked as Telegram marks them, a ``CallbackQuery`` carrying the message its button is
under) and queues it for getUpdates, or for :meth:`~TelegramServer.deliver` while a webhook is
set; it returns the update's id. The records (``sent``, ``calls``, ``callback_answers``,
``throttled``) are copies taken under the lock, safe to read from any thread.
"""

from __future__ import annotations

import mimetypes
import random
import time
from collections.abc import Callable
from typing import Any

from toren.testing._telegram_state import (
    DEFAULT_USER_ID,
    BotState,
    TelegramState,
    document_dict,
    photo_sizes,
    quoted,
)
from toren.testing._telegram_wire import (
    Call,
    CallbackAnswer,
    SentMessage,
    Throttle,
    detect_entities,
    user_dict,
)

__all__ = ["TelegramScript"]

_CHAT_METHODS = frozenset(
    {"sendmessage", "senddocument", "sendphoto", "editmessagetext", "editmessagereplymarkup"}
)


class TelegramScript(TelegramState):
    """The users' side and the records of a Telegram test server."""

    def add_chat(
        self,
        chat_id: int,
        type: str | None = None,
        title: str | None = None,
        *,
        username: str | None = None,
        token: str | None = None,
    ) -> None:
        """Make a chat known to the bot (else sends to it are refused: ``chat not found``).
        ``type`` defaults to private for a positive id, a (super)group for a negative one."""
        with self._lock:
            self._chat(self._bot(token), chat_id, type, title, username)

    # -- users --------------------------------------------------------------------------------

    def _enqueue(self, bot: BotState, kind: str, payload: dict[str, Any]) -> int:
        update_id = bot.next_update_id
        bot.next_update_id += 1
        if kind in bot.allowed:
            bot.queue.append({"update_id": update_id, kind: payload})
            if bot.poll is not None:
                bot.poll.signal.set()
        self._changed()
        return update_id

    def _user_message(
        self,
        bot: BotState,
        chat_id: int,
        user_id: int | None,
        username: str | None,
        chat_type: str | None = None,
        title: str | None = None,
        reply_to: int | None = None,
        thread_id: int | None = None,
        **content: Any,
    ) -> dict[str, Any]:
        known = bot.chats.get(chat_id)
        kind = chat_type or (known.type if known else ("private" if chat_id > 0 else None))
        uid = (
            user_id if user_id is not None else (chat_id if kind == "private" else DEFAULT_USER_ID)
        )
        name = username or f"user{uid}"
        chat = self._chat(bot, chat_id, kind, title, name if kind == "private" else None)
        if reply_to is not None and reply_to not in chat.messages:
            raise ValueError(f"chat {chat_id} has no message {reply_to} to reply to")
        message: dict[str, Any] = {
            "message_id": self._next_message_id(chat),
            "from": user_dict(uid, name),
            "chat": chat.wire(),
            "date": int(time.time()),
            **content,
        }
        if thread_id is not None:
            message["message_thread_id"] = thread_id
        if reply_to is not None:
            message["reply_to_message"] = quoted(chat.messages[reply_to])
        chat.messages[message["message_id"]] = message
        return message

    def push_message(
        self,
        chat_id: int,
        text: str,
        *,
        user_id: int | None = None,
        username: str | None = None,
        chat_type: str | None = None,
        title: str | None = None,
        reply_to: int | None = None,
        thread_id: int | None = None,
        entities: list[dict[str, Any]] | None = None,
        token: str | None = None,
    ) -> int:
        """A user writes ``text``; returns the update's id. Commands and ``@mentions`` get their
        entities as Telegram marks them (in a group, address the bot as ``@username ...`` or
        ``/cmd@username``) unless ``entities`` are given. ``reply_to`` is the id of a message
        of the chat the user answers; ``user_id`` defaults to the chat's id in a private chat.
        """
        with self._lock:
            bot = self._bot(token)
            found = detect_entities(text) if entities is None else entities
            extra = {"entities": found} if found else {}
            message = self._user_message(
                bot,
                chat_id,
                user_id,
                username,
                chat_type,
                title,
                reply_to,
                thread_id,
                text=text,
                **extra,
            )
            return self._enqueue(bot, "message", message)

    def push_edited_message(
        self, chat_id: int, message_id: int, text: str, *, token: str | None = None
    ) -> int:
        """The user edits their message ``message_id`` to ``text``; returns the update's id."""
        with self._lock:
            bot = self._bot(token)
            chat = bot.chats.get(chat_id)
            if chat is None or message_id not in chat.messages:
                raise ValueError(f"chat {chat_id} has no message {message_id} to edit")
            message = dict(chat.messages[message_id], text=text, edit_date=int(time.time()))
            message.pop("entities", None)
            if found := detect_entities(text):
                message["entities"] = found
            chat.messages[message_id] = message
            return self._enqueue(bot, "edited_message", message)

    def push_callback(
        self,
        chat_id: int,
        message_id: int,
        data: str,
        *,
        user_id: int,
        username: str | None = None,
        token: str | None = None,
    ) -> int:
        """The user presses an inline button with ``data`` under the bot's message
        ``message_id``; the update carries the message as it stands. Returns the update's id."""
        with self._lock:
            bot = self._bot(token)
            chat = bot.chats.get(chat_id)
            if chat is None or message_id not in chat.messages:
                raise ValueError(f"chat {chat_id} has no message {message_id} to press a button of")
            query_id = str(random.getrandbits(62))
            self._queries[query_id] = (bot.id, False)
            query = {
                "id": query_id,
                "from": user_dict(user_id, username or f"user{user_id}"),
                "message": chat.messages[message_id],
                "chat_instance": str(abs(hash((bot.id, chat_id)))),
                "data": data,
            }
            return self._enqueue(bot, "callback_query", query)

    def push_document(
        self,
        chat_id: int,
        filename: str,
        data: bytes,
        *,
        caption: str | None = None,
        mime_type: str | None = None,
        user_id: int | None = None,
        username: str | None = None,
        token: str | None = None,
    ) -> int:
        """The user sends a file; the bot can fetch it with getFile. Returns the update's id."""
        mime = mime_type or mimetypes.guess_type(filename)[0] or "application/octet-stream"
        with self._lock:
            bot = self._bot(token)
            file = self._store_file(data, filename, mime, "documents")
            extra: dict[str, Any] = {"caption": caption} if caption else {}
            message = self._user_message(
                bot, chat_id, user_id, username, document=document_dict(file), **extra
            )
            return self._enqueue(bot, "message", message)

    def push_photo(
        self,
        chat_id: int,
        data: bytes,
        *,
        caption: str | None = None,
        width: int = 1280,
        height: int = 960,
        user_id: int | None = None,
        username: str | None = None,
        token: str | None = None,
    ) -> int:
        """The user sends a photo (a ``PhotoSize`` list); returns the update's id."""
        with self._lock:
            bot = self._bot(token)
            file = self._store_file(data, "photo.jpg", "image/jpeg", "photos")
            extra: dict[str, Any] = {"caption": caption} if caption else {}
            message = self._user_message(
                bot, chat_id, user_id, username, photo=photo_sizes(file, width, height), **extra
            )
            return self._enqueue(bot, "message", message)

    def push_raw(self, update: dict[str, Any], *, token: str | None = None) -> int:
        """Queue ``update`` as given (an ``update_id`` is added if missing), unchecked and
        unfiltered: for hostile or odd updates. A chat it names becomes known to the bot."""
        with self._lock:
            bot = self._bot(token)
            update = dict(update)
            if not isinstance(update.get("update_id"), int):
                update["update_id"] = bot.next_update_id
            bot.next_update_id = max(bot.next_update_id, update["update_id"] + 1)
            for value in update.values():
                chat = value.get("chat") if isinstance(value, dict) else None
                if isinstance(chat, dict) and isinstance(chat.get("id"), int):
                    self._chat(bot, chat["id"], chat.get("type"), chat.get("title"), None)
            bot.queue.append(update)
            if bot.poll is not None:
                bot.poll.signal.set()
            self._changed()
            return int(update["update_id"])

    # -- inspection ---------------------------------------------------------------------------

    def sent(self, chat_id: int | None = None, *, token: str | None = None) -> list[SentMessage]:
        """The messages the bot of ``token`` (the first bot by default) sent, to ``chat_id`` or
        to any chat, in order; edited ones as they stand now."""
        with self._lock:
            bot_id = self._bot(token).id
            return [
                m
                for m in self._sent.values()
                if m.bot_id == bot_id and chat_id in (None, m.chat_id)
            ]

    def message(self, chat_id: int, message_id: int, *, token: str | None = None) -> SentMessage:
        """The bot's message ``message_id`` in ``chat_id``.

        Raises:
            KeyError: the bot sent no such message.
        """
        with self._lock:
            key = (self._bot(token).id, chat_id, message_id)
            if key not in self._sent:
                raise KeyError(f"the bot sent no message {message_id} to chat {chat_id}")
            return self._sent[key]

    def calls(self, method: str | None = None) -> list[Call]:
        """Every request received (of ``method`` only, if given), in arrival order."""
        with self._lock:
            return [c for c in self._calls if method is None or c.method.lower() == method.lower()]

    @property
    def callback_answers(self) -> list[CallbackAnswer]:
        """The ``answerCallbackQuery`` calls answered, in order."""
        with self._lock:
            return list(self._answers)

    @property
    def throttled(self) -> list[Throttle]:
        """Every 429 given by :meth:`limit_rate`."""
        with self._lock:
            return list(self._throttled)

    def violations(self) -> list[Call]:
        """The sends and edits that came inside a ``retry_after`` window a 429 gave for their chat
        (any chat, for the global limit): a client that respects 429s makes none."""
        with self._lock:
            return [
                c
                for c in self._calls
                if c.method.lower() in _CHAT_METHODS
                and any(
                    c.n > t.call
                    and t.at <= c.at < t.at + t.retry_after
                    and (t.scope == "global" or c.chat_id == t.chat_id)
                    for t in self._throttled
                )
            ]

    @property
    def updates_confirmed(self) -> int | None:
        """The highest offset the (first) bot gave getUpdates: updates below it are confirmed."""
        return self.confirmed_offset()

    def confirmed_offset(self, token: str | None = None) -> int | None:
        """The highest offset the bot of ``token`` gave getUpdates."""
        with self._lock:
            return self._bot(token).confirmed

    def polling(self, token: str | None = None) -> bool:
        """Whether a long poll of the bot waits for updates now."""
        with self._lock:
            return self._bot(token).poll is not None

    def pending_updates(self, token: str | None = None) -> list[dict[str, Any]]:
        """The updates not confirmed yet (getUpdates) or not delivered yet (webhook)."""
        with self._lock:
            return list(self._bot(token).queue)

    async def until(self, predicate: Callable[[], bool]) -> None:
        """Wait until ``predicate()`` holds, re-checked on every request, answer and push. Bound
        it with a cancel scope (``anyio.fail_after``)."""
        while True:
            with self._lock:
                signal = self._changed_signal
            if predicate():
                return
            await signal

    def until_sync(self, predicate: Callable[[], bool], timeout: float) -> None:
        """Block until ``predicate()`` holds.

        Raises:
            TimeoutError: it did not within ``timeout`` seconds.
        """
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                signal = self._changed_signal
            if predicate():
                return
            if not signal.wait(max(0.0, deadline - time.monotonic())):
                raise TimeoutError(f"the condition did not hold within {timeout} s")
