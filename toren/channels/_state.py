"""A Telegram channel actor's state: the fold of its journal, and its summary for the surfaces."""

from __future__ import annotations

from typing import Any

import attrs
from pyrsistent import PMap, PVector, pmap, pvector

import toren.runs.state  # noqa: F401  (teaches the converter persistent maps: for snapshots)
from toren._agent.principal import Principal
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
from toren.channels._health import ChannelFailing, ChannelRecovered, failing_summary

RECENT = 200
"""Delivered or failed outbound messages a channel's state keeps (for the surfaces)."""
FORGET_AFTER = 86400.0
"""Seconds after which an unpaired chat's hint, failed codes and last message sent to it are
forgotten (their windows: a hint at most once a day, at most twenty failed codes a day)."""
_PRUNE = 64  # every this many unpaired chats remembered, the expired ones are dropped
SNAPSHOT_VERSION = 3
"""The shape of :class:`ChannelState` as snapshots store it (2: a watch counts the messages the
channel told its run and those the run heard; 3: ``last_sent`` forgets strangers after a day);
older snapshots are folded from the journal."""
TOLD = frozenset(("started", "forwarded", "file"))
"""Outcomes of an update that sent its chat's conversation run a message (or its start)."""


@attrs.frozen(kw_only=True)
class Chat:
    chat_id: int
    title: str
    chat_type: str
    paired_by: Principal
    paired_at: float
    blocked: bool = False


@attrs.frozen(kw_only=True)
class Outgoing:
    queued: Queued
    state: str = "queued"  # queued, sending, sent, lost, blocked, refused
    message_ids: tuple[int, ...] = ()
    chat_id: int = 0  # where it goes now (a migrated chat's new id)
    at: float = 0.0


@attrs.frozen(kw_only=True)
class Prompt:
    opened: PromptOpened
    state: str = "open"  # open, sent (a decision went to the run), closed
    message_ids: tuple[int, ...] = ()


@attrs.frozen(kw_only=True)
class Watch:
    """A run the channel reads: its conversation chat (if any) and observer chats."""

    seq: int = 0
    conversation: str | None = None  # the chat key whose conversation it is
    observers: tuple[int, ...] = ()
    # Read at every tick while active; once the run has ended its turn (completed or failed)
    # after taking every message the channel sent it, only when the channel sends it something,
    # and at the sweep every few ticks.
    active: bool = True
    told: int = 0  # messages the channel sent the run (its start included)
    heard: int = 0  # of those, how many its journal showed it taking, as read so far


@attrs.frozen(kw_only=True)
class ChannelState:
    """The fold of a channel's journal."""

    agent: str = ""
    bot_id: int = 0
    username: str = ""
    offset: int = 0  # the next update id to ask for
    updates: int = 0
    codes: PMap[str, CodeIssued] = attrs.field(factory=pmap)  # unused codes, by hash
    failures: PMap[str, PVector[float]] = attrs.field(factory=pmap)  # chat -> failed /pair times
    chats: PMap[str, Chat] = attrs.field(factory=pmap)  # paired chats
    migrated: PMap[str, int] = attrs.field(factory=pmap)  # old chat id -> new
    conversations: PMap[str, str] = attrs.field(factory=pmap)  # chat key -> run
    started: PMap[str, int] = attrs.field(factory=pmap)  # chat key -> conversations started
    watches: PMap[str, Watch] = attrs.field(factory=pmap)  # run -> watch
    agent_observers: PMap[str, tuple[int, ...]] = attrs.field(factory=pmap)  # agent -> chats
    agent_seen: PMap[str, float] = attrs.field(factory=pmap)  # agent -> last run's creation
    hinted: PMap[str, float] = attrs.field(factory=pmap)  # unpaired chat -> last pairing hint
    outbox: PMap[str, Outgoing] = attrs.field(factory=pmap)  # pending and recent, by str(n)
    pending: PVector[int] = attrs.field(factory=pvector)  # queued or sending, in order
    recent: PVector[int] = attrs.field(factory=pvector)  # done, oldest first (at most RECENT)
    next_n: int = 1
    sent: int = 0
    failed: int = 0
    prompts: PMap[str, Prompt] = attrs.field(factory=pmap)  # by decision id
    prompt_of: PMap[str, str] = attrs.field(factory=pmap)  # "chat/message_id" -> decision
    last_sent: PMap[str, float] = attrs.field(factory=pmap)  # chat -> when it was last sent to
    failing: ChannelFailing | None = None  # Telegram does not answer the bot (its last record)

    def outgoing(self, n: int) -> Outgoing | None:
        """Outbound message ``n`` (pending, or among the recent ones)."""
        return self.outbox.get(str(n))

    def in_order(self) -> list[tuple[int, Outgoing]]:
        """The outbound messages kept (pending and recent), in the order they were queued."""
        return sorted((int(n), outgoing) for n, outgoing in self.outbox.items())


def _done(state: ChannelState, n: int, outgoing: Outgoing) -> ChannelState:
    recent = state.recent.append(n)
    outbox = state.outbox.set(str(n), outgoing)
    while len(recent) > RECENT:
        outbox = outbox.discard(str(recent[0]))
        recent = recent.delete(0)
    return attrs.evolve(state, outbox=outbox, recent=recent, pending=state.pending.remove(n))


def fold(state: ChannelState, event: Any) -> ChannelState:
    """The state after ``event`` (pure: replay calls it for every journaled event)."""
    if isinstance(event, UpdateHandled):
        offset = max(state.offset, event.update_id + 1)
        state = attrs.evolve(state, offset=offset, updates=state.updates + 1)
        if event.outcome == "hinted" and event.chat_id is not None:
            hinted = state.hinted.set(str(event.chat_id), event.at)
            if len(hinted) % _PRUNE == 0:  # what strangers leave: dropped once past its window
                hinted = pmap({c: t for c, t in hinted.items() if t > event.at - FORGET_AFTER})
            state = attrs.evolve(state, hinted=hinted)
        if event.run:  # the run was sent something: read it at every tick again
            state = _woken(state, event.run, told=event.outcome in TOLD)
        return state
    if isinstance(event, ObservedRun):
        chats = state.agent_observers.get(event.agent, ())
        watch = state.watches.get(event.run, Watch())
        observers = watch.observers + tuple(c for c in chats if c not in watch.observers)
        return attrs.evolve(
            state,
            watches=state.watches.set(event.run, attrs.evolve(watch, observers=observers)),
            agent_seen=state.agent_seen.set(event.agent, event.created),
        )
    if isinstance(event, Queued):
        outgoing = Outgoing(queued=event, chat_id=event.chat_id, at=event.at)
        return attrs.evolve(
            state,
            outbox=state.outbox.set(str(event.n), outgoing),
            pending=state.pending.append(event.n),
            next_n=max(state.next_n, event.n + 1),
        )
    if isinstance(event, Sending):
        known = state.outbox.get(str(event.n))
        if known is None:
            return state
        return attrs.evolve(
            state, outbox=state.outbox.set(str(event.n), attrs.evolve(known, state="sending"))
        )
    if isinstance(event, Sent):
        known = state.outbox.get(str(event.n))
        if known is None or event.n not in state.pending:
            return state
        done = attrs.evolve(known, state="sent", message_ids=event.message_ids, at=event.at)
        state = _done(state, event.n, done)
        prompts, prompt_of = state.prompts, state.prompt_of
        decision = known.queued.decision
        if decision is not None and decision in prompts:
            prompts = prompts.set(
                decision, attrs.evolve(prompts[decision], message_ids=event.message_ids)
            )
            for mid in event.message_ids:
                prompt_of = prompt_of.set(f"{known.chat_id}/{mid}", decision)
        return attrs.evolve(
            state,
            sent=state.sent + 1,
            prompts=prompts,
            prompt_of=prompt_of,
            last_sent=_last_sent(state, known.chat_id, event.at),
        )
    if isinstance(event, Failed):
        known = state.outbox.get(str(event.n))
        if known is None or event.n not in state.pending:
            return state
        state = _done(state, event.n, attrs.evolve(known, state=event.reason, at=event.at))
        return attrs.evolve(state, failed=state.failed + 1)
    if isinstance(event, RunRead):
        watch = state.watches.get(event.run, Watch())
        heard = watch.told if event.heard is None else watch.heard + event.heard
        # A turn that ended before the run took the channel's last message is not the last
        # one: its answer is still to come (a chat that wrote while the model answered).
        active = not event.done or heard < watch.told
        watch = attrs.evolve(watch, seq=event.seq, active=active, heard=heard)
        return attrs.evolve(state, watches=state.watches.set(event.run, watch))
    if isinstance(event, ConversationStarted):
        watch = state.watches.get(event.run, Watch())
        return attrs.evolve(
            state,
            conversations=state.conversations.set(event.key, event.run),
            started=state.started.set(event.key, state.started.get(event.key, 0) + 1),
            watches=state.watches.set(event.run, attrs.evolve(watch, conversation=event.key)),
        )
    if isinstance(event, ConversationEnded):
        conversations = state.conversations
        if conversations.get(event.key) == event.run:
            conversations = conversations.discard(event.key)
        return attrs.evolve(
            state,
            conversations=conversations,
            watches=_unwatch(state, event.run, conversation=True),
        )
    if isinstance(event, PromptOpened):
        return attrs.evolve(state, prompts=state.prompts.set(event.decision, Prompt(opened=event)))
    if isinstance(event, DecisionSent):
        prompt = state.prompts.get(event.decision)
        if prompt is None or prompt.state != "open":
            return state
        prompts = state.prompts.set(event.decision, attrs.evolve(prompt, state="sent"))
        return _woken(attrs.evolve(state, prompts=prompts), prompt.opened.run)
    if isinstance(event, PromptClosed):
        prompt = state.prompts.get(event.decision)
        if prompt is None:
            return state
        return attrs.evolve(
            state, prompts=state.prompts.set(event.decision, attrs.evolve(prompt, state="closed"))
        )
    if isinstance(event, CodeIssued):
        return attrs.evolve(state, codes=state.codes.set(event.code_hash, event))
    if isinstance(event, ChatPaired):
        chat = Chat(
            chat_id=event.chat_id,
            title=event.title,
            chat_type=event.chat_type,
            paired_by=event.by,
            paired_at=event.at,
        )
        key = str(event.chat_id)
        return attrs.evolve(
            state,
            codes=state.codes.discard(event.code_hash),
            chats=state.chats.set(key, chat),
            failures=state.failures.discard(key),
            hinted=state.hinted.discard(key),
        )
    if isinstance(event, PairFailed):
        key = str(event.chat_id)
        times = state.failures.get(key, pvector())
        times = times.append(event.at)
        if len(times) > 20:
            times = times.delete(0)
        failures = state.failures.set(key, times)
        if len(failures) % _PRUNE == 0:
            failures = pmap(
                {c: t for c, t in failures.items() if t and t[-1] > event.at - FORGET_AFTER}
            )
        return attrs.evolve(state, failures=failures)
    if isinstance(event, ChatUnpaired):
        return _forget_chat(state, event.chat_id)
    if isinstance(event, ChatBlocked | ChatUnblocked):
        return _blocked(state, event.chat_id, isinstance(event, ChatBlocked))
    if isinstance(event, ChatMigrated):
        return _migrated(state, event)
    if isinstance(event, ObserverChanged):
        return _observer(state, event)
    if isinstance(event, ChannelStarted):
        return attrs.evolve(state, agent=event.agent, bot_id=event.bot_id, username=event.username)
    if isinstance(event, ChannelFailing):
        return attrs.evolve(state, failing=event)
    if isinstance(event, ChannelRecovered):
        return attrs.evolve(state, failing=None)
    return state


def _last_sent(state: ChannelState, chat_id: int, at: float) -> PMap[str, float]:
    """``last_sent`` with ``chat_id`` sent to at ``at``. The chats a bot sends to include
    strangers (told their /pair code was wrong): what they leave, a day old, is dropped, as
    their hints and failures are (a chat's interval is seconds: a day-old send holds nothing
    back). A paired chat's is kept: there are only as many as chats."""
    last_sent = state.last_sent.set(str(chat_id), at)
    if len(last_sent) % _PRUNE == 0:
        last_sent = pmap(
            {c: t for c, t in last_sent.items() if c in state.chats or t > at - FORGET_AFTER}
        )
    return last_sent


def _woken(state: ChannelState, run: str, *, told: bool = False) -> ChannelState:
    watch = state.watches.get(run)
    if watch is None or (watch.active and not told):
        return state
    watch = attrs.evolve(watch, active=True, told=watch.told + told)
    return attrs.evolve(state, watches=state.watches.set(run, watch))


def _blocked(state: ChannelState, chat_id: int, blocked: bool) -> ChannelState:
    found = state.chats.get(str(chat_id))
    if found is None:
        return state
    return attrs.evolve(
        state, chats=state.chats.set(str(chat_id), attrs.evolve(found, blocked=blocked))
    )


def _unwatch(
    state: ChannelState, run: str, *, conversation: bool = False, chat: int | None = None
) -> PMap[str, Watch]:
    watch = state.watches.get(run)
    if watch is None:
        return state.watches
    if conversation:
        watch = attrs.evolve(watch, conversation=None)
    if chat is not None:
        watch = attrs.evolve(watch, observers=tuple(c for c in watch.observers if c != chat))
    if watch.conversation is None and not watch.observers:
        return state.watches.discard(run)
    return state.watches.set(run, watch)


def _forget_chat(state: ChannelState, chat_id: int) -> ChannelState:
    key = str(chat_id)
    watches = state.watches
    conversations = state.conversations
    for conv_key, run in state.conversations.items():
        if conv_key == key or conv_key.startswith(key + "/"):
            conversations = conversations.discard(conv_key)
            state = attrs.evolve(state, watches=_unwatch(state, run, conversation=True))
    for run, watch in state.watches.items():
        if chat_id in watch.observers:
            state = attrs.evolve(state, watches=_unwatch(state, run, chat=chat_id))
    watches = state.watches
    agent_observers = pmap(
        {a: tuple(c for c in chats if c != chat_id) for a, chats in state.agent_observers.items()}
    )
    return attrs.evolve(
        state,
        chats=state.chats.discard(key),
        conversations=conversations,
        watches=watches,
        agent_observers=pmap({a: c for a, c in agent_observers.items() if c}),
    )


def _migrated(state: ChannelState, event: ChatMigrated) -> ChannelState:
    old, new = str(event.chat_id), str(event.to)
    chats, conversations = state.chats, state.conversations
    chat = chats.get(old)
    if chat is not None:
        chats = chats.discard(old).set(new, attrs.evolve(chat, chat_id=event.to))
    watches = state.watches
    for key, run in state.conversations.items():
        if key == old or key.startswith(old + "/"):
            moved = new + key[len(old) :]
            conversations = conversations.discard(key).set(moved, run)
            if run in watches:
                watches = watches.set(run, attrs.evolve(watches[run], conversation=moved))
    outbox = state.outbox
    for n in state.pending:
        outgoing = outbox[str(n)]
        if outgoing.chat_id == event.chat_id:
            outbox = outbox.set(str(n), attrs.evolve(outgoing, chat_id=event.to))
    return attrs.evolve(
        state,
        chats=chats,
        conversations=conversations,
        watches=watches,
        outbox=outbox,
        migrated=state.migrated.set(old, event.to),
    )


def _observer(state: ChannelState, event: ObserverChanged) -> ChannelState:
    if event.agent:
        chats = tuple(c for c in state.agent_observers.get(event.agent, ()) if c != event.chat_id)
        if not event.stop:
            chats = (*chats, event.chat_id)
        observers = (
            state.agent_observers.set(event.agent, chats)
            if chats
            else state.agent_observers.discard(event.agent)
        )
        seen = state.agent_seen
        if event.agent not in seen:
            seen = seen.set(event.agent, event.at)  # runs from now on
        return attrs.evolve(state, agent_observers=observers, agent_seen=seen)
    if event.stop:
        return attrs.evolve(state, watches=_unwatch(state, event.run, chat=event.chat_id))
    watch = state.watches.get(event.run, Watch(seq=event.after))
    if event.chat_id not in watch.observers:
        watch = attrs.evolve(watch, observers=(*watch.observers, event.chat_id))
    return attrs.evolve(state, watches=state.watches.set(event.run, watch))


def pending_codes(state: ChannelState, now: float) -> int:
    """Codes issued, unused and unexpired."""
    return sum(1 for code in state.codes.values() if code.keyed and code.expires_at > now)


def summary(state: ChannelState) -> dict[str, Any]:
    """The channel's row summary (``toren channels list``, the API, the console)."""
    return {
        "agent": state.agent,
        "username": state.username,
        "offset": state.offset,
        "updates": state.updates,
        "chats": [
            {
                "chat_id": chat.chat_id,
                "title": chat.title,
                "type": chat.chat_type,
                "paired_by": chat.paired_by.name,
                "paired_by_id": chat.paired_by.id,
                "paired_at": chat.paired_at,
                "blocked": chat.blocked,
                "run": state.conversations.get(key),
            }
            for key, chat in sorted(state.chats.items())[:500]
        ],
        "pending": len(state.pending),
        "sent": state.sent,
        "failed": state.failed,
        "observing": sorted(
            [f"run {run}" for run, w in state.watches.items() if w.observers][:100]
            + [f"agent {agent}" for agent in state.agent_observers][:100]
        ),
        "failing": failing_summary(state.failing),
    }
