"""The Telegram world of :mod:`toren.testing.telegram_server`: bots, chats, users and the effects
of the Bot API's methods, without the HTTP.

:class:`TelegramState` holds every bot's chats, messages, files and pending updates, and carries
out each method as Telegram does, raising :class:`~toren.testing._telegram_wire.ApiError` with
Telegram's own error where Telegram refuses: a chat the bot never saw, a blocked user, a migrated
group, a flood limit, a text or a keyboard Telegram would not take. All of it is guarded by one
re-entrant lock, so that a test's thread may script users while the server's loop answers.
"""

from __future__ import annotations

import random
import re
import secrets
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import PurePosixPath
from typing import Any, Literal

import attrs

from toren.testing._telegram_wire import (
    DEFAULT_UPDATES,
    ApiError,
    Call,
    CallbackAnswer,
    SentMessage,
    Signal,
    Throttle,
    Upload,
    arg_bool,
    arg_chat_id,
    arg_int,
    arg_json,
    arg_str,
    bad_request,
    chat_dict,
    check_caption,
    check_reply_markup,
    check_text,
    user_dict,
    utf16_len,
)

__all__ = [
    "DEFAULT_USER_ID",
    "BotState",
    "ChatState",
    "LongPoll",
    "StoredFile",
    "TelegramState",
    "document_dict",
    "photo_sizes",
    "quoted",
]

DEFAULT_USER_ID = 10_001
"""The user who writes in a group when a push names nobody."""
MAX_DOWNLOAD = 20 * 1024 * 1024
"""The largest file getFile serves, as on Telegram's cloud Bot API."""
_QUERY_INVALID = "query is too old and response timeout expired or query ID is invalid"
_NOT_MODIFIED = (
    "message is not modified: specified new message content and reply markup are exactly the "
    "same as a current content and reply markup of the message"
)


@attrs.define
class ChatState:
    id: int
    type: str
    title: str | None
    username: str | None
    next_message_id: int = 1
    messages: dict[int, dict[str, Any]] = attrs.Factory(dict)

    def wire(self) -> dict[str, Any]:
        return chat_dict(self.id, self.type, self.title, self.username)


@attrs.define
class LongPoll:
    signal: Signal = attrs.Factory(Signal)
    conflict: str | None = None


@attrs.define
class BotState:
    id: int
    token: str
    username: str
    next_update_id: int
    queue: deque[dict[str, Any]] = attrs.Factory(deque)
    confirmed: int | None = None
    allowed: frozenset[str] = DEFAULT_UPDATES
    webhook_url: str = ""
    webhook_secret: str = ""
    webhook_error: tuple[int, str] | None = None
    chats: dict[int, ChatState] = attrs.Factory(dict)
    poll: LongPoll | None = None

    def user(self) -> dict[str, Any]:
        return user_dict(self.id, self.username, is_bot=True)


@attrs.frozen(kw_only=True)
class StoredFile:
    file_id: str
    unique_id: str
    path: str
    data: bytes
    filename: str
    mime_type: str


class TelegramState:
    """The bots, chats and records of a Telegram test server; see :class:`TelegramServer`."""

    def __init__(self, *, clock: Callable[[], float] = time.monotonic) -> None:
        self._lock = threading.RLock()
        self._clock = clock
        self._bots: dict[str, BotState] = {}
        self._default = ""
        self._calls: list[Call] = []
        self._sent: dict[tuple[int, int, int], SentMessage] = {}
        self._answers: list[CallbackAnswer] = []
        self._queries: dict[str, tuple[int, bool]] = {}
        self._files: dict[str, StoredFile] = {}
        self._blocked: set[int] = set()
        self._migrated: dict[int, int] = {}
        self._rate: tuple[float | None, int | None, int] | None = None
        self._last_send: dict[int, float] = {}
        self._recent: deque[float] = deque()
        self._throttled: list[Throttle] = []
        self._changed_signal = Signal()
        self._methods: dict[str, Callable[[BotState, Call], Any]] = {
            "getme": self._get_me,
            "setwebhook": self._set_webhook,
            "deletewebhook": self._set_webhook,
            "getwebhookinfo": self._webhook_info,
            "sendmessage": self._send_message,
            "senddocument": self._send_file,
            "sendphoto": self._send_file,
            "answercallbackquery": self._answer_callback,
            "editmessagetext": self._edit,
            "editmessagereplymarkup": self._edit,
            "getfile": self._get_file,
        }

    def _changed(self) -> None:
        old, self._changed_signal = self._changed_signal, Signal()
        old.set()

    # -- bots and chats -----------------------------------------------------------------------

    def add_bot(self, token: str, username: str = "toren_test_bot") -> None:
        """Serve another bot; its id is the number before the ``:`` of its token.

        Raises:
            ValueError: the token is not shaped like Telegram's (``<digits>:<secret>``).
        """
        if not re.fullmatch(r"\d+:[A-Za-z0-9_-]+", token):
            raise ValueError(f"{token!r} is not a bot token: use <digits>:<letters>, e.g. 123:ABC")
        with self._lock:
            first = random.randint(100_000_000, 900_000_000)
            self._bots[token] = BotState(int(token.split(":")[0]), token, username, first)
            self._default = self._default or token

    def _bot(self, token: str | None) -> BotState:
        try:
            return self._bots[token or self._default]
        except KeyError:
            raise ValueError(f"no bot has the token {token!r}; add it with add_bot") from None

    def _chat(
        self, bot: BotState, chat_id: int, kind: str | None, title: str | None, name: str | None
    ) -> ChatState:
        chat = bot.chats.get(chat_id)
        if chat is None:
            guess = "private" if chat_id > 0 else "group"
            if chat_id <= -1_000_000_000_000:  # -100 and ten digits: a supergroup's id
                guess = "supergroup"
            chat = bot.chats[chat_id] = ChatState(chat_id, kind or guess, title, name)
        chat.type, chat.title = kind or chat.type, title or chat.title
        chat.username = name or chat.username
        return chat

    def block(self, chat_id: int) -> None:
        """The user blocks the bot: sends to the chat answer 403 until :meth:`unblock`."""
        with self._lock:
            self._blocked.add(chat_id)

    def unblock(self, chat_id: int) -> None:
        """The user unblocks the bot."""
        with self._lock:
            self._blocked.discard(chat_id)

    def migrate(self, chat_id: int, new_chat_id: int) -> None:
        """The group becomes a supergroup: sends to ``chat_id`` answer 400 with
        ``migrate_to_chat_id``; ``new_chat_id`` is known to every bot that knew the group."""
        with self._lock:
            self._migrated[chat_id] = new_chat_id
            for bot in self._bots.values():
                old = bot.chats.get(chat_id)
                if old is not None or bot.token == self._default:
                    self._chat(bot, new_chat_id, "supergroup", old.title if old else None, None)

    def limit_rate(
        self,
        per_chat_interval: float | None = None,
        global_per_second: int | None = None,
        retry_after: int = 1,
    ) -> None:
        """Enforce Telegram-like flood limits on sends and edits (none when both are ``None``):
        one to a chat sooner than ``per_chat_interval`` s after the last, or more than
        ``global_per_second`` in any second, answers 429 with ``retry_after``."""
        with self._lock:
            none = per_chat_interval is None and global_per_second is None
            self._rate = None if none else (per_chat_interval, global_per_second, retry_after)

    # -- the methods (called under the lock) --------------------------------------------------

    def _next_message_id(self, chat: ChatState) -> int:
        message_id = chat.next_message_id
        chat.next_message_id += 1
        return message_id

    def _store_file(self, data: bytes, filename: str, mime: str, folder: str) -> StoredFile:
        n = len(self._files) + 1
        prefix = "BQACAgIAAxkBAAI" if folder == "documents" else "AgACAgIAAxkBAAI"
        suffix = PurePosixPath(filename).suffix
        file = StoredFile(
            file_id=f"{prefix}{n:05d}{secrets.token_urlsafe(12)}",
            unique_id=f"AgAD{n:05d}",
            path=f"{folder}/file_{n}{suffix}",
            data=data,
            filename=filename,
            mime_type=mime,
        )
        self._files[file.file_id] = file
        return file

    def file_at(self, path: str) -> bytes | None:
        """The bytes of the file at ``file_path`` (as getFile gave it), if there is one."""
        with self._lock:
            return next((f.data for f in self._files.values() if f.path == path), None)

    def _get_me(self, bot: BotState, call: Call) -> Any:
        return {
            **bot.user(),
            "can_join_groups": True,
            "can_read_all_group_messages": False,
            "supports_inline_queries": False,
        }

    def _target(self, bot: BotState, call: Call) -> ChatState:
        chat_id = arg_chat_id(call.params)
        if chat_id is None:
            raise bad_request("chat_id is empty")
        if isinstance(chat_id, str):
            found = [c for c in bot.chats.values() if f"@{c.username}" == chat_id]
            chat = found[0] if found else None
        else:
            chat = bot.chats.get(chat_id)
        if chat is not None and chat.id in self._migrated:
            raise ApiError(
                400,
                "Bad Request: group chat was upgraded to a supergroup chat",
                {"migrate_to_chat_id": self._migrated[chat.id]},
            )
        if chat is None:
            raise bad_request("chat not found")
        if chat.id in self._blocked:
            where = (
                "blocked by the user" if chat.type == "private" else "kicked from the group chat"
            )
            raise ApiError(403, f"Forbidden: bot was {where}")
        self._check_rate(call, chat.id)
        return chat

    def _check_rate(self, call: Call, chat_id: int) -> None:
        if self._rate is None:
            return
        per_chat, per_second, retry_after = self._rate
        now = self._clock()
        while self._recent and now - self._recent[0] >= 1.0:
            self._recent.popleft()
        last = self._last_send.get(chat_id)
        scope: Literal["chat", "global"] | None = None
        if per_chat is not None and last is not None and now - last < per_chat:
            scope = "chat"
        elif per_second is not None and len(self._recent) >= per_second:
            scope = "global"
        if scope is not None:
            throttle = Throttle(
                call=call.n, chat_id=chat_id, scope=scope, retry_after=retry_after, at=now
            )
            self._throttled.append(throttle)
            raise ApiError(
                429, f"Too Many Requests: retry after {retry_after}", {"retry_after": retry_after}
            )

    def _reply_to(self, chat: ChatState, params: dict[str, Any]) -> int | None:
        message_id = arg_int(params, "reply_to_message_id")
        allow = arg_bool(params, "allow_sending_without_reply")
        reply = arg_json(params, "reply_parameters")
        if isinstance(reply, dict):
            message_id, allow = (
                reply.get("message_id"),
                bool(reply.get("allow_sending_without_reply")),
            )
        if message_id is None or (message_id not in chat.messages and allow):
            return None
        if not isinstance(message_id, int) or message_id not in chat.messages:
            raise bad_request("message to be replied not found")
        return message_id

    def _post(
        self,
        bot: BotState,
        chat: ChatState,
        call: Call,
        kind: Literal["text", "document", "photo"],
        text: str | None,
        content: dict[str, Any],
        file: StoredFile | None = None,
    ) -> dict[str, Any]:
        params = call.params
        markup = check_reply_markup(arg_json(params, "reply_markup", _MARKUP))
        reply_to = self._reply_to(chat, params)
        thread_id = arg_int(params, "message_thread_id")
        arg_json(params, "link_preview_options")
        message: dict[str, Any] = {
            "message_id": self._next_message_id(chat),
            "from": bot.user(),
            "chat": chat.wire(),
            "date": int(time.time()),
            **content,
        }
        if thread_id is not None:
            message["message_thread_id"] = thread_id
        if reply_to is not None:
            message["reply_to_message"] = quoted(chat.messages[reply_to])
        if markup is not None and "inline_keyboard" in markup:
            message["reply_markup"] = {"inline_keyboard": markup["inline_keyboard"]}
        chat.messages[message["message_id"]] = message
        now = self._clock()
        self._sent[(bot.id, chat.id, message["message_id"])] = SentMessage(
            bot_id=bot.id,
            chat_id=chat.id,
            message_id=message["message_id"],
            kind=kind,
            text=text,
            parse_mode=arg_str(params, "parse_mode"),
            reply_markup=markup,
            reply_to=reply_to,
            thread_id=thread_id,
            filename=file.filename if file else None,
            data=file.data if file else None,
            at=now,
        )
        self._last_send[chat.id] = now
        self._recent.append(now)
        return message

    def _send_message(self, bot: BotState, call: Call) -> Any:
        chat = self._target(bot, call)
        text = arg_str(call.params, "text")
        check_text(text, arg_str(call.params, "parse_mode"))
        return self._post(bot, chat, call, "text", text, {"text": text})

    def _send_file(self, bot: BotState, call: Call) -> Any:
        field: Literal["document", "photo"] = (
            "photo" if "photo" in call.method.lower() else "document"
        )
        chat = self._target(bot, call)
        caption = arg_str(call.params, "caption")
        check_caption(caption, arg_str(call.params, "parse_mode"))
        given = call.params.get(field)
        if isinstance(given, Upload):
            if not given.data:
                raise bad_request("file must be non-empty")
            folder = "documents" if field == "document" else "photos"
            file = self._store_file(given.data, given.filename, given.content_type, folder)
        elif isinstance(given, str) and given in self._files:
            file = self._files[given]
        elif given:
            raise bad_request("wrong file identifier/HTTP URL specified")
        else:
            raise bad_request(f"there is no {field} in the request")
        content: dict[str, Any] = {
            field: document_dict(file) if field == "document" else photo_sizes(file)
        }
        if caption:
            content["caption"] = caption
        return self._post(bot, chat, call, field, caption, content, file)

    def _edit(self, bot: BotState, call: Call) -> Any:
        params = call.params
        if arg_str(params, "inline_message_id"):
            raise bad_request("inline messages are not served by this test server")
        chat = self._target(bot, call)
        message_id = arg_int(params, "message_id")
        if message_id is None:
            raise bad_request("message identifier is not specified")
        old, sent = chat.messages.get(message_id), self._sent.get((bot.id, chat.id, message_id))
        if old is None:
            raise bad_request("message to edit not found")
        if sent is None:
            raise bad_request("message can't be edited")
        markup = check_reply_markup(arg_json(params, "reply_markup", _MARKUP))
        new = dict(old)
        text, mode = sent.text, sent.parse_mode
        if call.method.lower() == "editmessagetext":
            if sent.kind != "text":
                raise bad_request("there is no text in the message to edit")
            text, mode = arg_str(params, "text"), arg_str(params, "parse_mode")
            check_text(text, mode)
            new["text"] = text
        new.pop("reply_markup", None)
        if markup is not None and "inline_keyboard" in markup:
            new["reply_markup"] = {"inline_keyboard": markup["inline_keyboard"]}
        if {k: v for k, v in new.items() if k != "edit_date"} == {
            k: v for k, v in old.items() if k != "edit_date"
        }:
            raise bad_request(_NOT_MODIFIED)
        new["edit_date"] = int(time.time())
        chat.messages[message_id] = new
        self._sent[(bot.id, chat.id, message_id)] = attrs.evolve(
            sent, text=text, parse_mode=mode, reply_markup=markup, edits=sent.edits + 1
        )
        self._last_send[chat.id] = self._clock()
        self._recent.append(self._last_send[chat.id])
        return new

    def _answer_callback(self, bot: BotState, call: Call) -> Any:
        query_id = arg_str(call.params, "callback_query_id") or ""
        if self._queries.get(query_id) != (bot.id, False):
            raise bad_request(_QUERY_INVALID)
        text = arg_str(call.params, "text")
        if text is not None and utf16_len(text) > 200:
            raise bad_request("MESSAGE_TOO_LONG")
        self._queries[query_id] = (bot.id, True)
        show_alert = arg_bool(call.params, "show_alert")
        self._answers.append(
            CallbackAnswer(
                callback_query_id=query_id, text=text, show_alert=show_alert, at=self._clock()
            )
        )
        return True

    def _get_file(self, bot: BotState, call: Call) -> Any:
        file_id = arg_str(call.params, "file_id")
        if file_id is None:
            raise bad_request("file_id not specified")
        file = self._files.get(file_id)
        if file is None:
            raise bad_request("wrong file_id or the file is temporarily unavailable")
        if len(file.data) > MAX_DOWNLOAD:
            raise bad_request("file is too big")
        return {
            "file_id": file.file_id,
            "file_unique_id": file.unique_id,
            "file_size": len(file.data),
            "file_path": file.path,
        }

    def _set_webhook(self, bot: BotState, call: Call) -> Any:
        params = call.params
        url = (arg_str(params, "url") or "") if call.method.lower() == "setwebhook" else ""
        secret = arg_str(params, "secret_token") or ""
        if url:
            if not re.fullmatch(r"https?://[^\s/]+\S*", url):
                raise bad_request("invalid webhook URL specified")
            if len(secret) > 256:
                raise bad_request("secret token is too long")
            if not re.fullmatch(r"[A-Za-z0-9_-]*", secret):
                raise bad_request("secret token contains unallowed characters")
            if bot.poll is not None:
                bot.poll.conflict = "Conflict: terminated by setWebhook request"
                bot.poll.signal.set()
        if arg_bool(params, "drop_pending_updates"):
            bot.queue.clear()
        self._allow(bot, params)
        bot.webhook_url, bot.webhook_secret = url, secret if url else ""
        bot.webhook_error = None
        return True

    def _allow(self, bot: BotState, params: dict[str, Any]) -> None:
        allowed = arg_json(params, "allowed_updates", "allowed_updates JSON array")
        if isinstance(allowed, list):
            bot.allowed = frozenset(str(a) for a in allowed) or DEFAULT_UPDATES

    def _webhook_info(self, bot: BotState, call: Call) -> Any:
        info: dict[str, Any] = {
            "url": bot.webhook_url,
            "has_custom_certificate": False,
            "pending_update_count": len(bot.queue),
        }
        if bot.webhook_url:
            info["max_connections"] = 40
        if bot.allowed != DEFAULT_UPDATES:
            info["allowed_updates"] = sorted(bot.allowed)
        if bot.webhook_error is not None:
            info["last_error_date"], info["last_error_message"] = bot.webhook_error
        return info

    def _take_updates(self, bot: BotState, offset: int, limit: int) -> list[dict[str, Any]]:
        """Confirm the updates below ``offset`` (keep the last ``-offset`` when negative), then
        the first ``limit`` pending ones."""
        if offset < 0:
            while len(bot.queue) > -offset:
                bot.queue.popleft()
        elif offset > 0:
            bot.queue = deque(u for u in bot.queue if u["update_id"] >= offset)
            bot.confirmed = max(bot.confirmed or offset, offset)
        return list(bot.queue)[:limit]


_MARKUP = "reply keyboard markup JSON object"


def quoted(message: dict[str, Any]) -> dict[str, Any]:
    """A message as quoted in ``reply_to_message``: without the message it answered."""
    return {k: v for k, v in message.items() if k != "reply_to_message"}


def document_dict(file: StoredFile) -> dict[str, Any]:
    return {
        "file_name": file.filename,
        "mime_type": file.mime_type,
        "file_id": file.file_id,
        "file_unique_id": file.unique_id,
        "file_size": len(file.data),
    }


def photo_sizes(file: StoredFile, width: int = 1280, height: int = 960) -> list[dict[str, Any]]:
    """A ``PhotoSize`` list (one size: the file as sent)."""
    size = {"file_id": file.file_id, "file_unique_id": file.unique_id, "file_size": len(file.data)}
    return [{**size, "width": width, "height": height}]
