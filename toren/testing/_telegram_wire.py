"""The Bot API's wire format for :mod:`toren.testing.telegram_server`: parameters, checks, records.

Request parameters arrive as Telegram accepts them: a JSON object, a query string, form fields or
multipart parts (python-telegram-bot sends form fields, each non-string value JSON-encoded, so a
``reply_markup`` is a JSON string and a ``chat_id`` the string ``"42"``). The ``arg_*`` helpers
read one parameter whatever way it came and refuse what Telegram refuses.

The checks follow Telegram's Bot API server (tdlib/telegram-bot-api, ``Client.cpp``): an error is
an :class:`ApiError` carrying the status, the description as Telegram words it ("Bad Request:
..."), and the ``parameters`` object (``retry_after``, ``migrate_to_chat_id``) when there is one.
Lengths are counted as Telegram counts them, in UTF-16 code units.
"""

from __future__ import annotations

import contextlib
import html
import json
import re
import threading
from asyncio import AbstractEventLoop, Future, get_running_loop
from collections.abc import Generator
from typing import Any, Literal
from urllib.parse import parse_qsl

import attrs
from aiohttp import BodyPartReader, web

__all__ = [
    "ApiError",
    "Call",
    "CallbackAnswer",
    "SentMessage",
    "Signal",
    "Throttle",
    "Upload",
]

MAX_TEXT = 4096
MAX_CAPTION = 1024
MAX_CALLBACK_DATA = 64
DEFAULT_UPDATES = frozenset(
    {"message", "edited_message", "channel_post", "edited_channel_post", "business_connection"}
    | {"business_message", "edited_business_message", "deleted_business_messages"}
    | {"inline_query", "chosen_inline_result", "callback_query", "shipping_query"}
    | {"pre_checkout_query", "purchased_paid_media", "poll", "poll_answer", "my_chat_member"}
    | {"chat_join_request", "chat_boost", "removed_chat_boost"}
)
"""What a bot receives unless it asks otherwise: every type but chat_member and reactions."""


class ApiError(Exception):
    """A Bot API error answer: HTTP ``status``, Telegram's ``description``, its ``parameters``."""

    def __init__(
        self, status: int, description: str, parameters: dict[str, Any] | None = None
    ) -> None:
        super().__init__(f"{status} {description}")
        self.status = status
        self.description = description
        self.parameters = parameters or {}

    def body(self) -> dict[str, Any]:
        """The JSON body Telegram answers with."""
        body: dict[str, Any] = {
            "ok": False,
            "error_code": self.status,
            "description": self.description,
        }
        if self.parameters:
            body["parameters"] = self.parameters
        return body


def bad_request(detail: str) -> ApiError:
    """A 400 ``Bad Request: <detail>``."""
    return ApiError(400, f"Bad Request: {detail}")


NOT_UTF8 = "text must be encoded in UTF-8"


# -- records -------------------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class Upload:
    """A file part of a multipart request: its filename, bytes and declared content type."""

    filename: str
    data: bytes = attrs.field(repr=lambda d: f"<{len(d)} bytes>")
    content_type: str


@attrs.define(kw_only=True)
class Call:
    """One request to the Bot API, in arrival order (``n`` counts from 1 over all bots).

    ``params`` are the decoded parameters (files as :class:`Upload`); ``chat_id`` is the target
    chat when the request names one; ``status`` the HTTP status answered, ``None`` while the
    request waits (held, long polling) or when it never was answered (the client left, the server
    stopped); ``description`` the error's description.
    """

    n: int
    method: str
    params: dict[str, Any]
    bot_id: int | None
    chat_id: int | str | None
    at: float
    status: int | None = None
    description: str | None = None
    gone: bool = False  # a held call whose client left before its release: it never took effect


@attrs.frozen(kw_only=True)
class SentMessage:
    """A message the bot sent, as it stands now (``edits`` counts the edits since).

    ``text`` is the text or the caption, as sent (Telegram would strip the markup of a
    ``parse_mode``; the raw text is kept so tests can assert what the client sent).
    """

    bot_id: int
    chat_id: int
    message_id: int
    kind: Literal["text", "document", "photo"]
    text: str | None
    parse_mode: str | None = None
    reply_markup: dict[str, Any] | None = None
    reply_to: int | None = None
    thread_id: int | None = None
    filename: str | None = None
    data: bytes | None = attrs.field(default=None, repr=lambda d: f"<{len(d or b'')} bytes>")
    at: float
    edits: int = 0


@attrs.frozen(kw_only=True)
class CallbackAnswer:
    """An ``answerCallbackQuery`` the bot made."""

    callback_query_id: str
    text: str | None
    show_alert: bool
    at: float


@attrs.frozen(kw_only=True)
class Throttle:
    """A 429 the server gave (by :meth:`~TelegramServer.limit_rate`): the client must not send
    to ``chat_id`` (to any chat when ``scope`` is ``"global"``) before ``at + retry_after``."""

    call: int
    chat_id: int | str | None
    scope: Literal["chat", "global"]
    retry_after: int
    at: float


class Signal:
    """A flag set once, from any thread; wait for it with ``await signal`` (in any event loop)
    or ``signal.wait(timeout)`` (blocking)."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self._lock = threading.Lock()
        self._waiters: list[tuple[AbstractEventLoop, Future[None]]] = []

    def set(self) -> None:
        """Set the flag and wake every waiter."""
        with self._lock:
            self._event.set()
            waiters, self._waiters = self._waiters, []
        for loop, future in waiters:
            # A closed loop raises RuntimeError: its waiter is gone, nobody is left to wake.
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(_resolve, future)

    def is_set(self) -> bool:
        """Whether the flag is set."""
        return self._event.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until set or ``timeout``; whether it was set."""
        return self._event.wait(timeout)

    def __await__(self) -> Generator[Any, None, None]:
        return self._wait().__await__()

    async def _wait(self) -> None:
        loop = get_running_loop()
        future: Future[None] = loop.create_future()
        with self._lock:
            if self._event.is_set():
                return
            entry = (loop, future)
            self._waiters.append(entry)
        try:
            await future
        finally:
            with self._lock:
                if entry in self._waiters:
                    self._waiters.remove(entry)


def _resolve(future: Future[None]) -> None:
    if not future.done():
        future.set_result(None)


# -- parameters ----------------------------------------------------------------------------------


def check_encoding(value: Any) -> None:
    """Refuse a string (also nested in JSON) with a NUL or a lone surrogate, which UTF-8 cannot
    carry: 400 ``text must be encoded in UTF-8``."""
    if isinstance(value, str):
        if "\x00" in value or any("\ud800" <= c <= "\udfff" for c in value):
            raise bad_request(NOT_UTF8)
    elif isinstance(value, dict):
        for item in value.values():
            check_encoding(item)
    elif isinstance(value, list):
        for item in value:
            check_encoding(item)


def decode_utf8(raw: bytes) -> str:
    """``raw`` decoded as strict UTF-8, or a 400."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        raise bad_request(NOT_UTF8) from None


def parse_json_body(raw: bytes) -> dict[str, Any]:
    """A JSON request body as parameters."""
    if not raw.strip():
        return {}
    try:
        body = json.loads(decode_utf8(raw))
    except ValueError:
        raise bad_request("can't parse JSON object") from None
    if not isinstance(body, dict):
        raise bad_request("JSON object expected")
    return body


def parse_form(text: str) -> dict[str, Any]:
    """``application/x-www-form-urlencoded`` fields (percent-escapes decoded as strict UTF-8)."""
    try:
        return dict(parse_qsl(text, keep_blank_values=True, errors="strict"))
    except UnicodeDecodeError:
        raise bad_request(NOT_UTF8) from None


async def read_params(request: web.Request) -> dict[str, Any]:
    """The parameters of a Bot API request, from its query string and its body (JSON, form or
    multipart, decoded as strict UTF-8); files as :class:`Upload`."""
    params: dict[str, Any] = {}
    if request.query_string:
        params.update(parse_form(request.query_string))
    if request.content_type == "multipart/form-data":
        reader = await request.multipart()
        while (part := await reader.next()) is not None:
            if not isinstance(part, BodyPartReader) or part.name is None:
                continue
            data = await part.read(decode=True)
            if part.filename is not None:
                kind = part.headers.get("Content-Type", "application/octet-stream")
                params[part.name] = Upload(filename=part.filename, data=data, content_type=kind)
            else:
                params[part.name] = decode_utf8(data)
        return params
    raw = await request.read()
    if request.content_type == "application/json":
        params.update(parse_json_body(raw))
    elif raw:
        params.update(parse_form(decode_utf8(raw)))
    return params


def loose_chat_id(params: dict[str, Any]) -> int | str | None:
    """``chat_id`` as well as it reads, for records: an integer, else the string, else None."""
    value = params.get("chat_id")
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str):
        with contextlib.suppress(ValueError):
            return int(value)
        return value
    return None


def arg_str(params: dict[str, Any], name: str) -> str | None:
    """A string parameter (a JSON number is taken as its text); ``None`` when absent or empty."""
    value = params.get(name)
    if value is None or value == "":
        return None
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return str(value)
    if not isinstance(value, str):
        raise bad_request(f'field "{name}" must be of type String')
    check_encoding(value)
    return value


def arg_int(params: dict[str, Any], name: str) -> int | None:
    """An integer parameter, or ``None`` when absent."""
    value = params.get(name)
    if value is None or value == "":
        return None
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int):
        return value
    with contextlib.suppress(TypeError, ValueError):
        return int(value)
    try:
        return int(float(value))
    except (TypeError, ValueError):
        raise bad_request(f"invalid {name} specified") from None


def arg_float(params: dict[str, Any], name: str) -> float | None:
    """A number parameter (Telegram takes integers; fractions are kept for quick tests)."""
    value = params.get(name)
    if value is None or value == "":
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        raise bad_request(f"invalid {name} specified") from None


def arg_bool(params: dict[str, Any], name: str) -> bool:
    """A boolean parameter as Telegram reads it (``true``/``1``), ``False`` when absent."""
    value = params.get(name)
    if isinstance(value, str):
        return value.strip().lower() in {"true", "1"}
    return bool(value)


def arg_json(params: dict[str, Any], name: str, what: str = "JSON object") -> Any:
    """A JSON-serialised parameter (a string to parse, or already a JSON value)."""
    value = params.get(name)
    if isinstance(value, str):
        if not value:
            return None
        try:
            value = json.loads(value)
        except ValueError:
            raise bad_request(f"can't parse {what}") from None
    check_encoding(value)
    return value


def arg_chat_id(params: dict[str, Any]) -> int | str | None:
    """``chat_id``: an integer, or a channel's ``@username``."""
    value = params.get("chat_id")
    if isinstance(value, str) and value.startswith("@"):
        return value
    return arg_int(params, "chat_id")


# -- text ----------------------------------------------------------------------------------------


def utf16_len(text: str) -> int:
    """The length of ``text`` in UTF-16 code units, as Telegram counts it."""
    return len(text.encode("utf-16-le", "surrogatepass")) // 2


def _offset(text: str, index: int) -> int:
    return len(text[:index].encode("utf-8", "surrogatepass"))


def _entities_error(detail: str) -> ApiError:
    return bad_request(f"can't parse entities: {detail}")


_MD_RESERVED = set("_*[]()~`>#+-=|{}.!")


def _markdown_v2(text: str) -> str:
    """The plain text of MarkdownV2, or a 400 for an unescaped reserved character or an
    entity left open (a simple parser: nesting rules and URLs are not checked)."""
    out: list[str] = []
    open_at: dict[str, int] = {}
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c == "\\" and i + 1 < n:
            out.append(text[i + 1])
            i += 2
            continue
        if c == "`":
            fence = "```" if text.startswith("```", i) else "`"
            end = text.find(fence, i + len(fence))
            if end < 0:
                raise _entities_error(
                    f"Can't find end of the entity starting at byte offset {_offset(text, i)}"
                )
            out.append(text[i + len(fence) : end])
            i = end + len(fence)
            continue
        marker = text[i : i + 2] if text.startswith(("__", "||"), i) else c
        if marker in {"*", "_", "__", "~", "||", "["}:
            if marker in open_at and marker != "[":
                del open_at[marker]
            else:
                open_at[marker] = i
            i += len(marker)
            continue
        if c == "]" and "[" in open_at:
            del open_at["["]
            if text.startswith("(", i + 1):
                close = text.find(")", i + 2)
                if close < 0:
                    raise _entities_error(
                        f"Can't find end of a URL at byte offset {_offset(text, i + 1)}"
                    )
                i = close + 1
            else:
                i += 1
            continue
        if c == ">" and (i == 0 or text[i - 1] == "\n"):
            i += 1
            continue
        if c in _MD_RESERVED or c == "\\":
            raise _entities_error(
                f"Character '{c}' is reserved and must be escaped with the preceding '\\'"
            )
        out.append(c)
        i += 1
    if open_at:
        start = min(open_at.values())
        raise _entities_error(
            f"Can't find end of the entity starting at byte offset {_offset(text, start)}"
        )
    return "".join(out)


def _markdown_legacy(text: str) -> str:
    out: list[str] = []
    open_at: dict[str, int] = {}
    for i, c in enumerate(text):
        if c in "*_`":
            if c in open_at:
                del open_at[c]
            else:
                open_at[c] = i
        else:
            out.append(c)
    if open_at:
        start = min(open_at.values())
        raise _entities_error(
            f"Can't find end of the entity starting at byte offset {_offset(text, start)}"
        )
    return "".join(out)


_HTML_TAGS = frozenset(
    {"b", "strong", "i", "em", "u", "ins", "s", "strike", "del", "span", "tg-spoiler", "a"}
    | {"tg-emoji", "code", "pre", "blockquote"}
)
_HTML_TAG = re.compile(r"<(/?)([A-Za-z][A-Za-z0-9-]*)?([^<>]*)>")


def _html(text: str) -> str:
    """The plain text of Telegram's HTML, or a 400 for an unknown, unclosed or stray tag."""
    out: list[str] = []
    stack: list[tuple[str, int]] = []
    pos = 0
    while (start := text.find("<", pos)) >= 0:
        out.append(text[pos:start])
        match = _HTML_TAG.match(text, start)
        if match is None:
            raise _entities_error(f"Unclosed start tag at byte offset {_offset(text, start)}")
        closing, name = match.group(1) == "/", (match.group(2) or "").lower()
        if closing:
            if not stack:
                raise _entities_error(f"Unexpected end tag at byte offset {_offset(text, start)}")
            expected, _ = stack.pop()
            if name and name != expected:
                raise _entities_error(
                    f"Unmatched end tag at byte offset {_offset(text, start)}, expected "
                    f'"</{expected}>", found "</{name}>"'
                )
        elif name not in _HTML_TAGS:
            raise _entities_error(
                f'Unsupported start tag "{name}" at byte offset {_offset(text, start)}'
            )
        else:
            stack.append((name, start))
        pos = match.end()
    out.append(text[pos:])
    if stack:
        name, _ = stack[-1]
        raise _entities_error(f'Can\'t find end tag corresponding to start tag "{name}"')
    return html.unescape("".join(out))


def plain_text(text: str, parse_mode: str | None) -> str:
    """The text a user would see once ``parse_mode``'s markup is parsed (400 on bad markup)."""
    mode = (parse_mode or "").lower()
    if mode in {"", "none"}:
        return text
    if mode == "markdownv2":
        return _markdown_v2(text)
    if mode == "markdown":
        return _markdown_legacy(text)
    if mode == "html":
        return _html(text)
    raise bad_request("unsupported parse_mode")


def check_text(text: str | None, parse_mode: str | None) -> None:
    """A message text: 1-4096 UTF-16 units once parsed and stripped."""
    shown = plain_text(text or "", parse_mode).strip()
    if not shown:
        raise bad_request("message text is empty")
    if utf16_len(shown) > MAX_TEXT:
        raise bad_request("message is too long")


def check_caption(caption: str | None, parse_mode: str | None) -> None:
    """A caption: at most 1024 UTF-16 units once parsed."""
    if caption and utf16_len(plain_text(caption, parse_mode).strip()) > MAX_CAPTION:
        raise bad_request("message caption is too long")


def check_reply_markup(markup: Any) -> dict[str, Any] | None:
    """A reply markup as Telegram validates it; inline buttons need text and an action, and
    ``callback_data`` of 1-64 bytes."""
    if markup is None:
        return None
    if not isinstance(markup, dict):
        raise bad_request("object expected as reply markup")
    rows = markup.get("inline_keyboard")
    if rows is None:
        return markup
    if not isinstance(rows, list) or not all(isinstance(row, list) for row in rows):
        raise bad_request(
            'field "inline_keyboard" of the InlineKeyboardMarkup must be an Array of Arrays'
        )
    prefix = "can't parse inline keyboard button: "
    for button in (b for row in rows for b in row):
        if not isinstance(button, dict):
            raise bad_request(prefix + "InlineKeyboardButton must be an Object")
        if not isinstance(button.get("text"), str):
            raise bad_request(prefix + 'Field "text" must be of type String')
        data = button.get("callback_data")
        if isinstance(data, str) and len(data.encode("utf-8", "surrogatepass")) > MAX_CALLBACK_DATA:
            raise bad_request("BUTTON_DATA_INVALID")
        actions = set(button) - {"text", "callback_data", "icon_custom_emoji_id", "style"}
        if not data and not actions:
            raise bad_request(prefix + "Text buttons are unallowed in the inline keyboard")
    return markup


# -- what users send -----------------------------------------------------------------------------

_ENTITY = re.compile(
    r"(?<![\w/@])(?:(?P<command>/[A-Za-z0-9_]{1,64}(?:@[A-Za-z0-9_]{3,32})?)"
    r"|(?P<mention>@[A-Za-z0-9_]{4,32}))(?![\w@])"
)


def detect_entities(text: str) -> list[dict[str, Any]]:
    """The ``bot_command`` and ``mention`` entities Telegram marks in a user's text (offsets and
    lengths in UTF-16 units); ``/cmd@bot`` is one bot_command, as Telegram marks it."""
    entities = []
    for match in _ENTITY.finditer(text):
        kind = "bot_command" if match.group("command") else "mention"
        entities.append(
            {
                "type": kind,
                "offset": utf16_len(text[: match.start()]),
                "length": utf16_len(match.group()),
            }
        )
    return entities


def user_dict(user_id: int, username: str | None, *, is_bot: bool = False) -> dict[str, Any]:
    """A ``User`` object."""
    user: dict[str, Any] = {"id": user_id, "is_bot": is_bot, "first_name": username or "User"}
    if username:
        user["username"] = username
    if not is_bot:
        user["language_code"] = "en"
    return user


def chat_dict(
    chat_id: int, chat_type: str, title: str | None, username: str | None
) -> dict[str, Any]:
    """A ``Chat`` object: a private chat has the user's name, a group its title."""
    chat: dict[str, Any] = {"id": chat_id, "type": chat_type}
    if chat_type == "private":
        chat["first_name"] = username or "User"
    else:
        chat["title"] = title or f"Chat {chat_id}"
    if username:
        chat["username"] = username
    return chat


def update_kind(update: dict[str, Any]) -> str:
    """The kind of an update: its one field besides ``update_id``."""
    return next((key for key in update if key != "update_id"), "unknown")
