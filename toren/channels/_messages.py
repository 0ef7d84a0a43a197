"""What a Telegram channel actor is sent, and how it is addressed.

One actor per bot (kind ``toren.channel``, address ``channel/telegram/<bot>``), claimed only by
workers that run the bot's agent and hold its token (route ``telegram/<bot>``); its lease makes
it the bot's only poller in the cluster. Its journal's events are in
:mod:`toren.channels._events`, their fold in :mod:`toren.channels._state`. Who acts from
Telegram is a :class:`~toren._agent.principal.Principal` made here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import attrs

from toren._agent.principal import Principal
from toren._core.codec import message

if TYPE_CHECKING:
    from toren._agent.agents import Agent

CHANNEL_KIND = "toren.channel"


def channel_address(bot: str) -> str:
    """The channel actor of bot ``bot``."""
    return f"channel/telegram/{bot}"


def channel_route(bot: str) -> str:
    """The route the bot's channel actor is claimed on (workers that have its token)."""
    return f"telegram/{bot}"


def chat_key(chat_id: int, thread: int | None = None) -> str:
    """A conversation's key: the chat, and the thread when conversations are per thread."""
    return str(chat_id) if thread is None else f"{chat_id}/{thread}"


def telegram_principal(user_id: int, name: str) -> Principal:
    """Who did something from Telegram: its user id is the identity, its name for people."""
    shown = (name or str(user_id))[:200]
    return Principal(kind="channel", id=f"telegram:{user_id}", name=shown, via="telegram")


def telegram_user(principal: Principal | None) -> int | None:
    """The Telegram user id of a principal made by :func:`telegram_principal`, else None."""
    if principal is None or principal.kind != "channel":
        return None
    prefix, _, user = principal.id.partition(":")
    if prefix != "telegram":
        return None
    try:
        return int(user)
    except ValueError:
        return None


def approvers_of(agent: Agent | None) -> tuple[int, ...]:
    """The Telegram users who may decide ``agent``'s calls: the approvers of its own bot
    (none without a bot, or for an agent this process does not know), whichever chat shows
    the call."""
    settings = agent.telegram if agent is not None else None
    return tuple(settings.approvers) if settings is not None else ()


# --- messages -------------------------------------------------------------------------------


@message("channel.tick")
@attrs.frozen
class Tick:
    """Poll Telegram (or, in webhook mode, only read the runs), then arm the next tick."""


@message("channel.flush")
@attrs.frozen
class Flush:
    """Send the next outbound message due (one per step)."""


@message("channel.send")
@attrs.frozen(kw_only=True)
class Send:
    """At-most-once delivery, second step: send message ``n`` (marked sending before)."""

    n: int


@message("channel.update")
@attrs.frozen(kw_only=True)
class Inbound:
    """An update Telegram posted to the webhook (enqueued with dedupe key its ``update_id``)."""

    update: dict[str, Any]


@message("channel.issue_code")
@attrs.frozen(kw_only=True)
class IssueCode:
    """Record a pairing code (its keyed hash, :mod:`toren.channels.pairing`) for the agent:
    answered with :class:`Answer`. Refused when ``key_id`` is not the id of the worker's key
    (empty: a sender older than keyed hashes)."""

    code_hash: str
    by: Principal
    until: float = 0.0  # the asker gives up then: a code recorded later would be one nobody saw
    key_id: str = ""


@message("channel.unpair")
@attrs.frozen(kw_only=True)
class Unpair:
    chat_id: int
    by: Principal


@message("channel.observe")
@attrs.frozen(kw_only=True)
class Observe:
    """Make a paired chat receive a run's (or every run of an agent's) events, read-only;
    ``stop`` ends it."""

    chat_id: int
    run: str = ""
    agent: str = ""
    stop: bool = False
    by: Principal


@message("channel.answer")
@attrs.frozen(kw_only=True)
class Answer:
    ok: bool
    detail: str
