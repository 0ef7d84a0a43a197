"""Whether a channel's bot reaches Telegram, recorded so that every surface says it the same way.

A tick that cannot reach the Bot API, or that Telegram refuses (a revoked token, a conflict),
records ``channel.failing``: since when, and why, redacted of anything shaped like a bot token.
It is recorded again only when the reason changes, so an outage of hours is a row or two, not
one a poll. The first tick Telegram answers after it records ``channel.recovered``. The state's
``failing`` is in the actor's summary, which ``toren channels list``, ``GET /channels`` and the
console read.
"""

from __future__ import annotations

from typing import Any

import attrs

from toren._core.codec import message


@message("channel.failing")
@attrs.frozen(kw_only=True)
class ChannelFailing:
    """Telegram did not answer the bot, or refused it, since ``since``; ``error`` says why
    (no secret: redacted before it is recorded)."""

    error: str
    since: float
    at: float = 0.0


@message("channel.recovered")
@attrs.frozen(kw_only=True)
class ChannelRecovered:
    """Telegram answers the bot again."""

    at: float = 0.0


def failing_summary(failing: ChannelFailing | None) -> dict[str, Any] | None:
    """The summary's ``failing``: ``None`` while Telegram answers."""
    if failing is None:
        return None
    return {"since": failing.since, "error": failing.error, "at": failing.at}
