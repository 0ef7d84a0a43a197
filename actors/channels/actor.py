"""The Telegram channel actor (kind ``toren.channel``): one bot, its chats, its outbox.

It stays active on its own: every ``channel.tick`` (a durable timer it sets itself) polls
Telegram, handles the updates, reads the runs it watches, and sets the next tick; the lease on
the actor makes it the bot's only poller across the cluster. A tick's updates, the offset they
advance and everything they cause (runs started, messages to runs, outbound messages queued)
commit in one step, so a crash anywhere neither loses nor doubles an update. Updates from
strangers that did nothing are not recorded (see ``Inbound.handle``): the offset past them is
kept in memory and asked for at the next poll.

Outbound messages go one per step (``channel.flush``): sent, then recorded ``outbox.sent``.
Telegram has no idempotency key, so a crash between a send and its record is the channel's
``delivery`` choice: ``at_least_once`` sends it again after the crash; ``at_most_once`` records
``outbox.sending`` in a step of its own before sending (``channel.send``), and a send step that
is handled a second time (its first never committed) records the message ``lost`` instead.
"""

from __future__ import annotations

import logging
import time
from typing import Any
from urllib.parse import urlsplit

from telegram.error import BadRequest, InvalidToken, NetworkError, RetryAfter, TelegramError

from toren import Actor, ChildFailed, ConfigError, Context, PoisonMessage
from toren.actors.channels import outbound, runtime
from toren.actors.channels.inbound import Inbound as InboundHandler
from toren.actors.channels.reading import Reader
from toren.actors.channels.telegram import SendError
from toren.channels import (
    CHANNEL_KIND,
    SNAPSHOT_VERSION,
    Answer,
    ChannelFailing,
    ChannelRecovered,
    ChannelStarted,
    ChannelState,
    ChatBlocked,
    ChatMigrated,
    ChatUnpaired,
    CodeIssued,
    Failed,
    Flush,
    Inbound,
    IssueCode,
    Observe,
    ObserverChanged,
    Send,
    Sending,
    Sent,
    Tick,
    Unpair,
    fold,
    pending_codes,
    redact,
    summary,
)
from toren.kernel import kill_point, last_seq

log = logging.getLogger("toren.channel")

_BACKOFF_CAP = 60.0
SWEEP = 20  # ticks between two reads of every watched run (about a minute while idle)
_REASON_CHARS = 500  # of why Telegram does not answer, as recorded (channel.failing)


def _where(url: str) -> str:
    """The Bot API's address as a failure names it: scheme, host and port (a path or a user
    part may hold a secret)."""
    parts = urlsplit(url)
    port = f":{parts.port}" if parts.port else ""
    return f"{parts.scheme}://{parts.hostname}{port}"


def failure_reason(exc: TelegramError | SendError, api: str, token_source: str) -> str:
    """Why Telegram does not answer the bot (or refuses it), as ``channel.failing`` records it:
    redacted, at most ``_REASON_CHARS`` characters. ``api`` is the Bot API's address as
    :func:`_where` gives it; ``token_source`` where the bot's token is read from."""
    if isinstance(exc, InvalidToken):
        reason = (
            f"Telegram refuses the bot token read from {token_source}: check it with @BotFather"
        )
    elif isinstance(exc, RetryAfter):  # its text counts the seconds down: one reason an outage
        reason = f"the Bot API at {api} holds the bot back (flood control: too many requests)"
    elif isinstance(exc, NetworkError) and not isinstance(exc, BadRequest):
        reason = f"no answer from the Bot API at {api} ({exc})"  # PTB: BadRequest is one
    else:
        reason = f"the Bot API at {api} refused the bot's request ({type(exc).__name__}: {exc})"
    return redact(reason)[:_REASON_CHARS]


class ChannelActor(Actor[ChannelState]):
    """One Telegram bot's channel."""

    kind = CHANNEL_KIND
    idle_seconds = 60.0
    # A tick that keeps failing (the database, a bug) is tried again with backoff, never
    # dead-lettered: the channel would stop polling for good.
    max_attempts = 1_000_000
    max_deliveries = 1_000
    retry_base_seconds = 1.0
    snapshot_every = 500
    state_type = ChannelState
    snapshot_version = SNAPSHOT_VERSION

    def __init__(self, actor_id: str, args: Any) -> None:
        super().__init__(actor_id, args)
        self.bot_name = str(args.get("bot") or actor_id.rsplit("/", 1)[-1])
        self._started = False  # this activation set the bot up (webhook deleted or set)
        self._failures = 0  # polls failed in a row (backoff)
        self._ticks = 0  # every SWEEP-th reads every watched run, not only the active ones
        self._limits = outbound.Limits()
        # (recorded offset, offset past the updates the last tick did not record): see _offset.
        self._ahead = (0, 0)

    def initial_state(self) -> ChannelState:
        return ChannelState()

    def apply(self, state: ChannelState, event: Any) -> ChannelState:
        return fold(state, event)

    def summarize(self, state: ChannelState) -> dict[str, Any]:
        return summary(state) | {"bot": self.bot_name}

    async def handle(self, ctx: Context[ChannelState], msg: Any) -> None:
        if isinstance(msg, Tick):
            await self._tick(ctx)
        elif isinstance(msg, Flush):
            await self._flush(ctx)
        elif isinstance(msg, Send):
            await self._send(ctx, msg)
        elif isinstance(msg, Inbound):
            await self._inbound(ctx, msg)
        elif isinstance(msg, IssueCode):
            self._issue(ctx, msg)
        elif isinstance(msg, Unpair):
            self._unpair(ctx, msg)
        elif isinstance(msg, Observe):
            await self._observe(ctx, msg)
        elif isinstance(msg, ChildFailed | PoisonMessage):
            log.warning("%s: %s", ctx.actor_id, msg)  # a run it started: its journal says more

    # -- inbound ---------------------------------------------------------------------------

    async def _tick(self, ctx: Context[ChannelState]) -> None:
        bot = runtime.of(ctx).bot(self.bot_name)
        settings = bot.settings
        polling = settings.mode == "polling"
        try:
            if not self._started:
                await self._start(ctx, bot)
            # The runs first: what the updates below send a run makes it read again from the
            # next tick on, and its reply is read then (see Reader).
            self._ticks += 1
            await Reader(ctx, sweep=self._ticks % SWEEP == 1).read()
            if polling:
                due, wait = outbound.next_due(ctx.state, time.time(), settings, self._limits)
                timeout = settings.poll_timeout
                if due is not None or outbound.sending(ctx.state):
                    timeout = 0  # a send is due, or its second step (at most once) waits
                elif wait is not None:
                    timeout = min(timeout, max(1.0, wait))
                ctx.ensure_lease()
                offset = self._offset(ctx.state.offset)
                updates = await bot.api.get_updates(offset, timeout)
                kill_point("telegram.polled")
                handler = InboundHandler(ctx, bot, self.actor_id, self._limits)
                handled = [await handler.handle(raw, polling=True) for raw in updates]
                ids = [i for i in handled if i is not None]
                if ids:
                    self._ahead = (ctx.state.offset, max(offset, max(ids) + 1))
        except (TelegramError, SendError) as exc:
            self._failures += 1
            delay = min(2.0**self._failures, _BACKOFF_CAP)
            self._failing(ctx, exc)
            if isinstance(exc, InvalidToken):
                where = settings.token_file or settings.token_env
                log.error(  # noqa: TRY400  (what to fix, not where it failed)
                    "%s: Telegram refuses the bot token read from %s: check it with @BotFather "
                    "(a revoked or mistyped token); trying again in %.0f s",
                    ctx.actor_id,
                    where,
                    delay,
                )
                ctx.set_timer("tick", delay, Tick())
                self._arm_flush(ctx)
                return
            log.warning(
                "%s: Telegram did not answer (%s); trying again in %.0f s",
                ctx.actor_id,
                redact(str(exc))[:300],
                delay,
            )
            ctx.set_timer("tick", delay, Tick())
            self._arm_flush(ctx)
            return
        self._failures = 0
        if ctx.state.failing is not None:
            ctx.emit(ChannelRecovered(at=time.time()))
        self._arm_flush(ctx)
        ctx.set_timer("tick", 0.0 if polling else settings.poll_timeout, Tick())

    def _failing(self, ctx: Context[ChannelState], exc: TelegramError | SendError) -> None:
        """Record that Telegram does not answer (or refuses) the bot, and why: once per
        outage, again only when the reason changes (the surfaces show it)."""
        settings = runtime.of(ctx).bot(self.bot_name).settings
        api = _where(runtime.api_url(runtime.of(ctx).settings))
        reason = failure_reason(exc, api, settings.token_file or settings.token_env)
        failing = ctx.state.failing
        if failing is None or failing.error != reason:
            now = time.time()
            since = now if failing is None else failing.since
            ctx.emit(ChannelFailing(error=reason, since=since, at=now))

    def _offset(self, recorded: int) -> int:
        """The offset to poll from: past the updates the last tick handled without recording
        them, or the recorded one.

        Asking Telegram for a higher offset confirms the updates below it (Telegram forgets
        them), so the offset held in memory is used only while the state is the one that tick
        left: a tick that recorded updates moved the recorded offset, and a retry of it after
        a failed commit sees the older one (then the recorded offset, and Telegram sends the
        same updates again). A tick that recorded none and did not commit is skipped anyway:
        its updates did nothing, and would do nothing again.
        """
        base, ahead = self._ahead
        return ahead if recorded == base and ahead > recorded else recorded

    async def _start(self, ctx: Context[ChannelState], bot: runtime.Bot) -> None:
        settings = bot.settings
        ctx.ensure_lease()
        bot_id, username = await bot.api.get_me()
        if settings.mode == "polling":
            await bot.api.delete_webhook()  # getUpdates answers 409 while a webhook is set
        elif settings.webhook_url is None:  # Telegram(...) refuses webhook mode without it
            raise ConfigError(f"telegram bot {self.bot_name!r}: webhook mode needs webhook_url")
        else:
            await bot.api.set_webhook(settings.webhook_url, settings.webhook_secret())
        state = ctx.state
        known = (state.agent, state.bot_id, state.username)
        if known != (bot.agent.name, bot_id, username):
            ctx.emit(
                ChannelStarted(
                    agent=bot.agent.name,
                    bot_id=bot_id,
                    username=username,
                    mode=settings.mode,
                    delivery=settings.delivery,
                    at=time.time(),
                )
            )
        self._started = True
        log.info(
            "%s: @%s serves agent %r (%s; delivery %s)",
            ctx.actor_id,
            username,
            bot.agent.name,
            settings.mode,
            settings.delivery.replace("_", "-"),
        )

    async def _inbound(self, ctx: Context[ChannelState], msg: Inbound) -> None:
        """An update the webhook enqueued (dedupe key: its update id)."""
        bot = runtime.of(ctx).bot(self.bot_name)
        if not ctx.state.username:
            ctx.ensure_lease()
            bot_id, username = await bot.api.get_me()
            ctx.emit(
                ChannelStarted(
                    agent=bot.agent.name,
                    bot_id=bot_id,
                    username=username,
                    mode=bot.settings.mode,
                    delivery=bot.settings.delivery,
                    at=time.time(),
                )
            )
        await Reader(ctx).read()
        await InboundHandler(ctx, bot, self.actor_id, self._limits).handle(
            msg.update, polling=False
        )
        self._arm_flush(ctx)

    # -- outbound --------------------------------------------------------------------------

    def _arm_flush(self, ctx: Context[ChannelState]) -> None:
        settings = runtime.of(ctx).bot(self.bot_name).settings
        due, wait = outbound.next_due(ctx.state, time.time(), settings, self._limits)
        if due is not None or wait is not None:
            ctx.set_timer("flush", wait or 0.0, Flush())

    async def _flush(self, ctx: Context[ChannelState]) -> None:
        bot = runtime.of(ctx).bot(self.bot_name)
        now = time.time()
        n, _ = outbound.next_due(ctx.state, now, bot.settings, self._limits)
        if n is None:
            self._arm_flush(ctx)
            return
        outgoing = ctx.state.outbox[str(n)]
        chat = ctx.state.chats.get(str(outgoing.chat_id))
        if chat is not None and chat.blocked:
            ctx.emit(Failed(n=n, reason="blocked", detail="the user blocked the bot", at=now))
        elif bot.settings.delivery == "at_most_once":
            ctx.emit(Sending(n=n, at=now))
            ctx.send(self.actor_id, Send(n=n), system=True)
            return  # sent in a step of its own, after this one commits
        else:
            await self._deliver(ctx, bot, n)
        self._arm_flush(ctx)

    async def _send(self, ctx: Context[ChannelState], msg: Send) -> None:
        """At-most-once, second step: send a message recorded ``sending``."""
        outgoing = ctx.state.outgoing(msg.n)
        if outgoing is None or outgoing.state != "sending" or msg.n not in ctx.state.pending:
            return
        envelope = ctx.envelope
        again = envelope is not None and (envelope.deliveries > 1 or envelope.attempts > 0)
        # A step of this activation that failed before its send (a lapsed lease, the database)
        # left the message here: nothing was sent, so it may be.
        if again and (ctx.actor_id, msg.n) not in runtime.of(ctx).unsent:
            log.warning(
                "%s: message %d to chat %d may have been sent before a crash; at-most-once "
                "delivery does not send it again",
                ctx.actor_id,
                msg.n,
                outgoing.chat_id,
            )
            detail = "the worker stopped during its send; at-most-once: not sent again"
            ctx.emit(Failed(n=msg.n, reason="lost", detail=detail, at=time.time()))
        else:
            await self._deliver(ctx, runtime.of(ctx).bot(self.bot_name), msg.n)
        self._arm_flush(ctx)

    async def _deliver(self, ctx: Context[ChannelState], bot: runtime.Bot, n: int) -> None:
        outgoing = ctx.state.outbox[str(n)]
        unsent = runtime.of(ctx).unsent
        unsent.add((ctx.actor_id, n))
        ctx.ensure_lease()
        kill_point("telegram.sending")
        unsent.discard((ctx.actor_id, n))  # from here on, Telegram may have it
        # A prompt that could not show its whole call goes without buttons (see reading).
        prompt = ctx.state.prompts.get(outgoing.queued.decision or "")
        try:
            ids = await outbound.deliver(
                bot,
                outgoing,
                buttons=prompt is not None and prompt.opened.decidable,
                store=runtime.of(ctx).store,
            )
        except SendError as exc:
            self._undelivered(ctx, bot, n, exc)
            return
        kill_point("telegram.sent")
        now = time.time()
        ctx.emit(Sent(n=n, message_ids=ids, at=now))
        self._limits.sent(now)

    def _undelivered(
        self, ctx: Context[ChannelState], bot: runtime.Bot, n: int, exc: SendError
    ) -> None:
        outgoing = ctx.state.outbox[str(n)]
        chat, now = outgoing.chat_id, time.time()
        at_most_once = bot.settings.delivery == "at_most_once"
        if exc.action == "retry" and at_most_once and exc.ambiguous:
            log.warning(
                "%s: message %d to chat %d got no answer from Telegram (%s); at-most-once "
                "delivery does not send it again: recorded lost",
                ctx.actor_id,
                n,
                chat,
                exc.detail,
            )
            detail = f"no answer from Telegram, it may have been delivered: {exc.detail[:200]}"
            ctx.emit(Failed(n=n, reason="lost", detail=detail, at=now))
        elif exc.action == "retry":
            log.warning(
                "%s: message %d to chat %d not sent (%s); again in %.1f s",
                ctx.actor_id,
                n,
                chat,
                exc.detail,
                exc.retry_after,
            )
            self._limits.hold(exc.retry_after)
            if at_most_once:  # it was not delivered: sending it later is not a second send
                ctx.set_timer(f"send-{n}", exc.retry_after, Send(n=n))
        elif exc.action == "migrated":
            ctx.emit(ChatMigrated(chat_id=chat, to=exc.new_chat_id, at=now))
            if at_most_once:
                ctx.send(self.actor_id, Send(n=n), system=True)
        elif exc.action == "blocked":
            log.warning("%s: chat %d blocked the bot: %s", ctx.actor_id, chat, exc.detail)
            ctx.emit(ChatBlocked(chat_id=chat, detail=exc.detail, at=now))
            ctx.emit(Failed(n=n, reason="blocked", detail=exc.detail, at=now))
        else:
            log.warning("%s: Telegram refused message %d: %s", ctx.actor_id, n, exc.detail)
            ctx.emit(Failed(n=n, reason="refused", detail=exc.detail, at=now))

    # -- requests from the CLI and the API -------------------------------------------------

    def _issue(self, ctx: Context[ChannelState], msg: IssueCode) -> None:
        bot = runtime.of(ctx).bot(self.bot_name)
        settings = bot.settings
        now = time.time()
        if msg.until and now > msg.until:  # the CLI gave up: nobody will ever see this code
            log.warning("%s: a pairing code asked for too late was not issued", ctx.actor_id)
            return
        if msg.key_id != bot.pairing.id:  # a code this worker could never match
            detail = (
                "the code was hashed with another pairing key than this worker's (a different "
                "TOREN_PAIRING_KEY, or a `toren` older than the worker): give every process "
                "the same TOREN_PAIRING_KEY, or none (they then share the database's key)"
            )
            ctx.reply(Answer(ok=False, detail=detail))
            return
        if pending_codes(ctx.state, now) >= settings.max_pending_codes:
            detail = (
                f"{settings.max_pending_codes} codes are pending (the cap): use one, or wait "
                "for one to expire"
            )
            ctx.reply(Answer(ok=False, detail=detail))
            return
        expires = now + settings.pair_code_ttl
        issued = CodeIssued(
            code_hash=msg.code_hash, expires_at=expires, by=msg.by, at=now, keyed=True
        )
        ctx.emit(issued)
        ctx.reply(Answer(ok=True, detail=repr(expires)))

    def _unpair(self, ctx: Context[ChannelState], msg: Unpair) -> None:
        if str(msg.chat_id) not in ctx.state.chats:
            ctx.reply(Answer(ok=False, detail=f"chat {msg.chat_id} is not paired"))
            return
        ctx.emit(ChatUnpaired(chat_id=msg.chat_id, by=msg.by, at=time.time()))
        text = f"This chat was unpaired by {msg.by.name}: it no longer reaches the agent."
        outbound.queue(ctx, msg.chat_id, text, kind="notice")
        self._arm_flush(ctx)
        ctx.reply(Answer(ok=True, detail=f"chat {msg.chat_id} unpaired"))

    async def _observe(self, ctx: Context[ChannelState], msg: Observe) -> None:
        if str(msg.chat_id) not in ctx.state.chats:
            ctx.reply(Answer(ok=False, detail=f"chat {msg.chat_id} is not paired"))
            return
        what = f"run {msg.run}" if msg.run else f"every new run of agent {msg.agent}"
        seq = 0
        if msg.run and not msg.stop:
            last = await last_seq(runtime.of(ctx).pool, msg.run)
            if last is None:
                ctx.reply(Answer(ok=False, detail=f"no run {msg.run} (or it has not started)"))
                return
            seq = last
        ctx.emit(
            ObserverChanged(
                chat_id=msg.chat_id,
                run=msg.run,
                agent=msg.agent,
                stop=msg.stop,
                by=msg.by,
                after=seq,
                at=time.time(),
            )
        )
        verb = "no longer observes" if msg.stop else "observes (read-only)"
        outbound.queue(ctx, msg.chat_id, f"This chat {verb} {what}.", kind="notice")
        self._arm_flush(ctx)
        ctx.reply(Answer(ok=True, detail=f"chat {msg.chat_id} {verb} {what}"))
