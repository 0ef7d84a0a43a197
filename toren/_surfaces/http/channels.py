"""The channel endpoints: the Telegram bots with their paired chats, each outbound message's
delivery state, and the webhook Telegram posts a bot's updates to.

``POST /telegram/{bot}`` takes no bearer token (Telegram calls it): it is checked with the
header ``X-Telegram-Bot-Api-Secret-Token``, compared in constant time with the secret this
server process reads from the environment variable the channel names (``webhook_secret_env`` in
the channel actor's arguments, else ``TELEGRAM_WEBHOOK_SECRET``). A bot without a channel actor,
an unset or malformed variable, a missing or wrong header: all ``401 unauthorized``, saying no
more, and nothing is enqueued; failures are limited per client address as failed sign-ins are.
An accepted update goes to the channel's mailbox with the dedupe key ``update:<update_id>``, and
the ``200`` is sent only once that committed: Telegram sends again whatever it got no ``200``
for, and the second copy is a no-op.
"""

from __future__ import annotations

import hmac
import json as stdjson
import logging
import secrets
import time
from datetime import UTC, datetime
from typing import Any

import attrs
import orjson
from aiohttp import web

from toren._core.errors import ActorNotLive, ConfigError, UnknownActor
from toren._core.killpoints import kill_point
from toren._core.rows import actor_row
from toren._surfaces.http.common import (
    CLIENT,
    OPTIONS,
    ROUTE_ACCESS,
    ProblemError,
    client_address,
    json,
)
from toren._surfaces.http.guard import FailedAuth
from toren._surfaces.http.models import (
    Channel,
    ChannelChat,
    ChannelFailing,
    ChannelList,
    ChannelMessages,
    FieldError,
    OutboundMessage,
    WebhookAck,
)
from toren._surfaces.http.openapi import API_PARTS, channel_part
from toren.channels import CHANNEL_KIND, ChannelState, Inbound, Telegram, channel_address
from toren.channels._settings import BOT_NAME
from toren.channels.client import channels, read_channel

log = logging.getLogger("toren.http")

SECRET_HEADER = "X-Telegram-Bot-Api-Secret-Token"  # noqa: S105  (a header's name)
DEFAULT_SECRET_ENV = Telegram(bot="x").webhook_secret_env
WEBHOOK_MAX_BYTES = 1024 * 1024
"""The largest update body (Telegram's are a few KiB); larger: ``413``."""
MAX_DEPTH = 64
"""How deeply an update's JSON may nest (Telegram's nest a few levels); deeper: ``400``."""
RECENT_PASS = 600.0
"""Seconds after a bot's secret passed during which it is still checked from an address that
is blocked for failures (Telegram keeps getting through while someone else guesses)."""
INT64 = 2**63


@attrs.define
class Webhooks:
    """What the webhook route keeps in a server process: failed secrets per client address,
    when each bot's secret last passed, the bots whose missing secret was logged."""

    failed: FailedAuth
    passed: dict[str, float] = attrs.field(factory=dict)
    warned: set[str] = attrs.field(factory=set)


WEBHOOKS: web.AppKey[Webhooks] = web.AppKey("webhooks", Webhooks)


def install(app: web.Application) -> None:
    """The channel kind's routes; its webhook is checked by its bot's secret, not a token."""
    app[ROUTE_ACCESS].own_check.append(is_webhook)
    app[API_PARTS].append(channel_part())
    app[WEBHOOKS] = Webhooks(
        FailedAuth(app[CLIENT].pool, "webhook", app[OPTIONS].failed_auth_per_minute)
    )
    app.router.add_get("/channels", listing)
    app.router.add_get("/channels/{bot}/messages", outbox)
    app.router.add_post("/telegram/{bot}", webhook)


def is_webhook(request: web.Request) -> bool:
    """Whether the request is for the webhook route (authenticated by its secret, not by a
    bearer token)."""
    parts = request.path.split("/")
    return request.method == "POST" and len(parts) == 3 and parts[1] == "telegram"


def _iso(epoch: float) -> str:
    return datetime.fromtimestamp(epoch, UTC).isoformat()


# --- reads ----------------------------------------------------------------------------------


async def listing(request: web.Request) -> web.Response:
    """Every channel with its paired chats and delivery counts, read from the rows."""
    rows = await channels(request.app[CLIENT])
    return json(ChannelList(channels=[_channel(row) for row in rows]))


def _channel(row: dict[str, Any]) -> Channel:
    return Channel(
        bot=str(row["bot"]),
        channel=str(row["channel"]),
        agent=str(row.get("agent") or ""),
        username=str(row.get("username") or ""),
        status=str(row["status"]),
        chats=[_chat(c) for c in row.get("chats") or [] if isinstance(c, dict)],
        pending=int(row.get("pending") or 0),
        sent=int(row.get("sent") or 0),
        failed=int(row.get("failed") or 0),
        updates=int(row.get("updates") or 0),
        observing=[str(o) for o in row.get("observing") or []],
        failing=_failing(row.get("failing")),
    )


def _failing(failing: Any) -> ChannelFailing | None:
    if not isinstance(failing, dict):
        return None
    since = _iso(float(failing.get("since") or 0.0))
    return ChannelFailing(since=since, error=str(failing.get("error") or ""))


def _chat(chat: dict[str, Any]) -> ChannelChat:
    return ChannelChat(
        chat_id=int(chat["chat_id"]),
        title=str(chat.get("title") or ""),
        type=str(chat.get("type") or ""),
        paired_by=str(chat.get("paired_by") or ""),
        paired_by_id=str(chat.get("paired_by_id") or ""),
        paired_at=_iso(float(chat.get("paired_at") or 0.0)),
        blocked=bool(chat.get("blocked")),
        run=chat.get("run") or None,
    )


async def outbox(request: web.Request) -> web.Response:
    """The bot's outbound messages still pending and the last ones delivered or failed, with
    their delivery state (folded from the channel's journal); ``chat`` keeps one chat's."""
    bot = request.match_info["bot"]
    raw_chat = request.query.get("chat")
    chat: int | None = None
    if raw_chat is not None:
        try:
            chat = int(raw_chat)
        except ValueError:
            chat = None
        if chat is None or not -INT64 <= chat < INT64:
            raise ProblemError(
                422,
                "Invalid request",
                f"chat must be a Telegram chat id (an integer), not {raw_chat[:100]!r}",
                [FieldError(field="chat", message="an integer")],
            )
    client = request.app[CLIENT]
    address = channel_address(bot)
    if not BOT_NAME.fullmatch(bot) or not await _channel_args(client.pool, address):
        raise ProblemError(404, "Not found", f"no channel for bot {bot[:100]!r}")
    state = await read_channel(client, address)
    return json(ChannelMessages(bot=bot, messages=delivery(state, chat)))


def delivery(state: ChannelState, chat: int | None = None) -> list[OutboundMessage]:
    """A channel's outbound messages (pending, then the recent delivered or failed ones, in
    outbox order) with their delivery state; only those to ``chat`` if given."""
    now = time.time()
    shown = []
    for n, outgoing in state.in_order():
        queued = outgoing.queued
        if chat is not None and chat not in (outgoing.chat_id, queued.chat_id):
            continue
        shown.append(
            OutboundMessage(
                n=n,
                chat_id=outgoing.chat_id,
                kind=queued.kind,
                state=outgoing.state,
                text=queued.text[:300],
                queued_at=_iso(queued.at),
                at=_iso(outgoing.at or queued.at),
                age_seconds=round(max(0.0, now - queued.at), 1),
                message_ids=list(outgoing.message_ids),
                source=queued.source,
            )
        )
    return shown


async def _channel_args(pool: Any, address: str) -> dict[str, Any] | None:
    """The arguments of the channel actor at ``address`` (None: there is none)."""
    row = await actor_row(pool, address, kind=CHANNEL_KIND, fields=("args",))
    return None if row is None else dict(row.args_dict)


# --- the webhook ----------------------------------------------------------------------------


def _unauthorized() -> ProblemError:
    return ProblemError(401, "Unauthorized", "unauthorized")


async def webhook(request: web.Request) -> web.Response:
    """An update Telegram posts: checked by its secret, then enqueued for the channel (once per
    ``update_id``) before it is answered ``200``."""
    hooks = request.app[WEBHOOKS]
    address = client_address(request)
    bot = request.match_info["bot"]
    passed = hooks.passed.get(bot)
    recent = passed is not None and time.monotonic() - passed < RECENT_PASS
    # The counts are shared by every server process (a statement): an update of a bot whose
    # secret passed here lately is checked without one, and counted only if it fails; any other
    # is an attempt, counted as a failure before its secret is checked and uncounted if it passes.
    attempt = None if recent else await hooks.failed.attempt(address)
    if attempt is not None and attempt.retry_after is not None:
        raise _too_many(address, attempt.retry_after)
    if not await _secret_matches(request, bot, hooks):
        retry_after = await hooks.failed.failed(address) if attempt is None else None
        if retry_after is not None:
            raise _too_many(address, retry_after)
        raise _unauthorized()
    if attempt is not None:
        await hooks.failed.passed(attempt)
    hooks.passed[bot] = time.monotonic()
    update = await _update(request)
    update_id = update["update_id"]
    try:
        await request.app[CLIENT].send(
            channel_address(bot),
            Inbound(update=update),
            dedupe_key=f"update:{update_id}",
            system=True,
        )
    except (UnknownActor, ActorNotLive) as exc:
        log.warning("telegram bot %r: update %d not taken: %s", bot, update_id, exc)
        raise ProblemError(
            503,
            "Unavailable",
            "the channel takes no updates now",
            headers={"Retry-After": "60"},
        ) from exc
    kill_point("telegram.enqueued")
    return json(WebhookAck())


def _too_many(address: str, retry_after: int) -> ProblemError:
    return ProblemError(
        429,
        "Too many failed requests",
        f"too many failed webhook requests from {address}; try again in {retry_after}s",
        headers={"Retry-After": str(retry_after)},
    )


async def _secret_matches(request: web.Request, bot: str, hooks: Webhooks) -> bool:
    """Whether the request carries the secret of bot ``bot``'s channel. Compared in constant
    time, against a random value when there is no secret to compare with."""
    sent = request.headers.get(SECRET_HEADER)
    expected = None
    if BOT_NAME.fullmatch(bot):
        args = await _channel_args(request.app[CLIENT].pool, channel_address(bot))
        if args is not None:
            expected = _secret(bot, args, hooks)
    against = expected if expected is not None else secrets.token_urlsafe(32)
    given = (sent or "").encode("utf-8", "surrogatepass")
    same = hmac.compare_digest(given, against.encode())
    return same and sent is not None and expected is not None


def _secret(bot: str, args: dict[str, Any], hooks: Webhooks) -> str | None:
    """The bot's webhook secret from this process's environment (None, logged once, when the
    variable its channel names is unset or malformed: its value is never logged)."""
    name = args.get("webhook_secret_env")
    name = name if isinstance(name, str) and name.strip() else DEFAULT_SECRET_ENV
    try:
        return Telegram(bot=bot, webhook_secret_env=name).webhook_secret()
    except ConfigError as exc:
        if bot not in hooks.warned:
            hooks.warned.add(bot)
            log.warning(
                "telegram bot %r: webhook requests are refused (401): %s; set it in the "
                "environment of `toren serve`",
                bot,
                exc.what,
            )
        return None


async def _update(request: web.Request) -> dict[str, Any]:
    """The body as an update: a JSON object (at most 1 MiB, nested at most 64 deep) with an
    integer ``update_id``.

    Raises:
        ProblemError: 413 past the size; 400 otherwise.
    """
    too_large = ProblemError(413, "Too large", f"an update is at most {WEBHOOK_MAX_BYTES} bytes")
    length = request.content_length
    if length is not None and length > WEBHOOK_MAX_BYTES:
        raise too_large
    chunks, size = [], 0
    async for chunk in request.content.iter_chunked(64 * 1024):
        size += len(chunk)
        if size > WEBHOOK_MAX_BYTES:
            raise too_large
        chunks.append(chunk)
    update = _parse(b"".join(chunks))
    update_id = update.get("update_id") if isinstance(update, dict) else None
    if (
        not isinstance(update, dict)
        or not isinstance(update_id, int)
        or isinstance(update_id, bool)
        or not 0 <= update_id < INT64
    ):
        raise ProblemError(
            400,
            "Malformed update",
            "an update is a JSON object with an integer update_id",
            [FieldError(field="update_id", message="a non-negative integer")],
        )
    if not _shallow(update):
        raise ProblemError(400, "Malformed update", f"the update nests deeper than {MAX_DEPTH}")
    return update


def _parse(raw: bytes) -> Any:
    """JSON ``raw``; lone surrogate escapes are kept (Telegram relays what users type, and the
    journal holds them losslessly) rather than refused, so one odd update cannot stall a bot
    whose every refused update Telegram sends again."""
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        pass
    try:
        return stdjson.loads(raw.decode("utf-8"), parse_constant=_no_constant)
    except (ValueError, RecursionError):
        return None


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _shallow(value: Any) -> bool:
    """Whether ``value`` nests at most :data:`MAX_DEPTH` deep (checked without recursion)."""
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if depth > MAX_DEPTH:
            return False
        if isinstance(item, dict):
            stack.extend((v, depth + 1) for v in item.values())
        elif isinstance(item, list):
            stack.extend((v, depth + 1) for v in item)
    return True
