"""The events a Telegram channel actor records: its journal is the channel's whole story.

- ``update.handled``: an update from Telegram and what it did (paired a chat, reached the
  agent, decided a call, was refused...), committed with the messages it caused, so that the
  offset it advances and its effects are one transaction;
- ``code.issued`` / ``chat.paired`` / ``chat.unpaired``: pairing (codes kept as hashes only);
- ``conversation.started``: a chat's durable conversation run;
- ``outbox.queued`` / ``outbox.sending`` / ``outbox.sent`` / ``outbox.failed``: every outbound
  message, in order per chat, with its delivery state;
- ``run.read``: how far the channel has read a run's journal (its replies, its approvals), in
  the commit that queued what it read;
- ``prompt.opened`` / ``decision.sent``: approval prompts and the decisions taken from them;
- ``channel.failing`` / ``channel.recovered``: Telegram stopped answering the bot (since when,
  why) and answers again (:mod:`toren.channels._health`).

Their wire names are the journal's format: recorded journals fold with them as they are.
"""

from __future__ import annotations

from typing import Any

import attrs

from toren._agent.principal import Principal
from toren._core.codec import message


@message("channel.started")
@attrs.frozen(kw_only=True)
class ChannelStarted:
    agent: str
    bot_id: int
    username: str
    mode: str
    delivery: str
    at: float = 0.0


@message("update.handled")
@attrs.frozen(kw_only=True)
class UpdateHandled:
    update_id: int
    chat_id: int | None
    user_id: int | None
    kind: str  # message, callback, document, photo, other
    outcome: str  # forwarded, started, paired, pair_failed, hinted, ignored, decided, refused...
    detail: str = ""
    run: str = ""  # the run it was sent to, if any
    at: float = 0.0


@message("code.issued")
@attrs.frozen(kw_only=True)
class CodeIssued:
    code_hash: str
    expires_at: float
    by: Principal
    at: float = 0.0
    # A keyed hash (HMAC, toren.channels.pairing). False: recorded before keyed hashes, as plain
    # SHA-256; such a code counts as expired (it never pairs, and is not pending).
    keyed: bool = False


@message("chat.paired")
@attrs.frozen(kw_only=True)
class ChatPaired:
    chat_id: int
    title: str
    chat_type: str
    code_hash: str
    by: Principal
    at: float = 0.0


@message("pair.failed")
@attrs.frozen(kw_only=True)
class PairFailed:
    """A wrong, expired or used pairing code from ``chat_id`` (counted for its rate limit)."""

    chat_id: int
    at: float = 0.0


@message("chat.unpaired")
@attrs.frozen(kw_only=True)
class ChatUnpaired:
    chat_id: int
    by: Principal
    at: float = 0.0


@message("chat.blocked")
@attrs.frozen(kw_only=True)
class ChatBlocked:
    chat_id: int
    detail: str
    at: float = 0.0


@message("chat.unblocked")
@attrs.frozen(kw_only=True)
class ChatUnblocked:
    """A blocked chat wrote again: messages to it are sent again."""

    chat_id: int
    at: float = 0.0


@message("chat.migrated")
@attrs.frozen(kw_only=True)
class ChatMigrated:
    chat_id: int
    to: int
    at: float = 0.0


@message("conversation.started")
@attrs.frozen(kw_only=True)
class ConversationStarted:
    key: str
    chat_id: int
    thread: int | None
    run: str
    at: float = 0.0


@message("conversation.ended")
@attrs.frozen(kw_only=True)
class ConversationEnded:
    """The run failed: the chat's next message starts a new conversation."""

    key: str
    run: str
    at: float = 0.0


@message("observer.changed")
@attrs.frozen(kw_only=True)
class ObserverChanged:
    chat_id: int
    run: str = ""
    agent: str = ""
    stop: bool = False
    by: Principal
    after: int = 0  # a run not read yet is read from its next event on
    at: float = 0.0


@message("observer.run")
@attrs.frozen(kw_only=True)
class ObservedRun:
    """A run of an observed agent began: the chats observing the agent read it from now on."""

    agent: str
    run: str
    created: float  # the run's creation time: later ones are looked for next


@message("run.read")
@attrs.frozen(kw_only=True)
class RunRead:
    """The channel read ``run``'s journal up to ``seq`` (what it says is queued in this step)."""

    run: str
    seq: int
    done: bool = False  # the last of it that mattered ended the run's turn: read it less often
    # the channel's messages the run took in what was read (its start, and what Telegram users
    # said: message.received from Telegram); None in a record of an earlier version
    heard: int | None = None


@message("outbox.queued")
@attrs.frozen(kw_only=True)
class Queued:
    n: int
    chat_id: int
    kind: str  # text, prompt, notice, file
    text: str
    thread: int | None = None
    reply_to: int | None = None
    decision: str | None = None  # a prompt's decision id (its buttons carry it)
    file: dict[str, Any] | None = None  # {run, path, checkpoint, size}
    source: str = ""  # the run (and seq) it came from, for the surfaces
    at: float = 0.0


@message("outbox.sending")
@attrs.frozen(kw_only=True)
class Sending:
    """At-most-once: message ``n`` is about to be sent; after a crash it is not sent again."""

    n: int
    at: float = 0.0


@message("outbox.sent")
@attrs.frozen(kw_only=True)
class Sent:
    n: int
    message_ids: tuple[int, ...]
    at: float = 0.0


@message("outbox.failed")
@attrs.frozen(kw_only=True)
class Failed:
    """Message ``n`` was not delivered: ``lost`` (at-most-once, a crash during its send),
    ``blocked`` (the user blocked the bot), ``refused`` (Telegram refused it for good)."""

    n: int
    reason: str
    detail: str = ""
    at: float = 0.0


@message("prompt.opened")
@attrs.frozen(kw_only=True)
class PromptOpened:
    """A prompt for a decision on call ``call_id`` of ``run`` was queued for ``chat_id``."""

    decision: str
    run: str
    call_id: str
    name: str  # the call as the prompt names it, escaped (printable)
    chat_id: int
    at: float = 0.0
    # the agent whose call it is (a child run's for a call made below the conversation's run);
    # "" in a record of an earlier version: the bot's own agent
    agent: str = ""
    # False: the call was too long to show whole in one message, so the prompt was sent
    # without buttons and a reply to it decides nothing (it says where to decide instead).
    decidable: bool = True


@message("prompt.closed")
@attrs.frozen(kw_only=True)
class PromptClosed:
    """The call was decided (here or elsewhere): its buttons answer that it no longer waits."""

    decision: str
    approved: bool
    by: str
    at: float = 0.0


@message("decision.sent")
@attrs.frozen(kw_only=True)
class DecisionSent:
    decision: str
    approved: bool
    by: Principal
    reason: str = ""
    at: float = 0.0
