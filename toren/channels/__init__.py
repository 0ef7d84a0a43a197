"""Channels: people reach an agent through a Telegram bot, and approve its calls from there.

Give an agent ``telegram=Telegram(bot="NAME")`` (or an ``[agents.NAME.telegram]`` table) and a
worker that runs it and holds the bot's token runs the bot's channel actor
(``channel/telegram/NAME``): it polls Telegram (or takes its webhook's updates), pairs chats by
single-use codes, gives each paired chat a durable conversation run, and delivers the run's
replies, approval prompts and files through an outbox. This package is the vocabulary: the
settings, the actor's messages, events and state, and the client API the CLI and the HTTP API
use; the actor is in :mod:`toren.actors.channels`. See ``docs/channels.md``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from toren._core.exports import lazy_exports

if TYPE_CHECKING:  # what the names below are, for type checkers (imported lazily at run time)
    from toren.channels._events import (
        ChannelStarted,
        ChatBlocked,
        ChatMigrated,
        ChatPaired,
        ChatUnblocked,
        ChatUnpaired,
        CodeIssued,
        ConversationEnded,
        ConversationStarted,
        DecisionSent,
        Failed,
        ObservedRun,
        ObserverChanged,
        PairFailed,
        PromptClosed,
        PromptOpened,
        Queued,
        RunRead,
        Sending,
        Sent,
        UpdateHandled,
    )
    from toren.channels._health import ChannelFailing, ChannelRecovered
    from toren.channels._messages import (
        CHANNEL_KIND,
        Answer,
        Flush,
        Inbound,
        IssueCode,
        Observe,
        Send,
        Tick,
        Unpair,
        approvers_of,
        channel_address,
        channel_route,
        chat_key,
        telegram_principal,
        telegram_user,
    )
    from toren.channels._settings import (
        DEFAULT_API_URL,
        SETTABLE,
        TEXT_LIMIT,
        Telegram,
        configured,
        redact,
    )
    from toren.channels._state import (
        SNAPSHOT_VERSION,
        ChannelState,
        Chat,
        Outgoing,
        Prompt,
        Watch,
        fold,
        pending_codes,
        summary,
    )
    from toren.channels.pairing import PairingKey, issued_code, pairing_key

__all__ = [
    "CHANNEL_KIND",
    "DEFAULT_API_URL",
    "SETTABLE",
    "SNAPSHOT_VERSION",
    "TEXT_LIMIT",
    "Answer",
    "ChannelFailing",
    "ChannelRecovered",
    "ChannelStarted",
    "ChannelState",
    "Chat",
    "ChatBlocked",
    "ChatMigrated",
    "ChatPaired",
    "ChatUnblocked",
    "ChatUnpaired",
    "CodeIssued",
    "ConversationEnded",
    "ConversationStarted",
    "DecisionSent",
    "Failed",
    "Flush",
    "Inbound",
    "IssueCode",
    "Observe",
    "ObservedRun",
    "ObserverChanged",
    "Outgoing",
    "PairFailed",
    "PairingKey",
    "Prompt",
    "PromptClosed",
    "PromptOpened",
    "Queued",
    "RunRead",
    "Send",
    "Sending",
    "Sent",
    "Telegram",
    "Tick",
    "Unpair",
    "UpdateHandled",
    "Watch",
    "approvers_of",
    "channel_address",
    "channel_route",
    "chat_key",
    "configured",
    "fold",
    "issued_code",
    "pairing_key",
    "pending_codes",
    "redact",
    "summary",
    "telegram_principal",
    "telegram_user",
]

# Each public name's module, imported on first use by ``__getattr__``: a worker's settings
# (read by every CLI command) need none of the vocabulary.
_HOMES: dict[str, tuple[str, ...]] = {
    "toren.channels._events": (
        "ChannelStarted",
        "ChatBlocked",
        "ChatMigrated",
        "ChatPaired",
        "ChatUnblocked",
        "ChatUnpaired",
        "CodeIssued",
        "ConversationEnded",
        "ConversationStarted",
        "DecisionSent",
        "Failed",
        "ObservedRun",
        "ObserverChanged",
        "PairFailed",
        "PromptClosed",
        "PromptOpened",
        "Queued",
        "RunRead",
        "Sending",
        "Sent",
        "UpdateHandled",
    ),
    "toren.channels._health": (
        "ChannelFailing",
        "ChannelRecovered",
    ),
    "toren.channels._messages": (
        "CHANNEL_KIND",
        "Answer",
        "Flush",
        "Inbound",
        "IssueCode",
        "Observe",
        "Send",
        "Tick",
        "Unpair",
        "approvers_of",
        "channel_address",
        "channel_route",
        "chat_key",
        "telegram_principal",
        "telegram_user",
    ),
    "toren.channels._settings": (
        "DEFAULT_API_URL",
        "SETTABLE",
        "TEXT_LIMIT",
        "Telegram",
        "configured",
        "redact",
    ),
    "toren.channels._state": (
        "SNAPSHOT_VERSION",
        "ChannelState",
        "Chat",
        "Outgoing",
        "Prompt",
        "Watch",
        "fold",
        "pending_codes",
        "summary",
    ),
    "toren.channels.pairing": (
        "PairingKey",
        "issued_code",
        "pairing_key",
    ),
}


__getattr__, __dir__ = lazy_exports(__name__, _HOMES)
