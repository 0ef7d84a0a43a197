"""What one update from Telegram does, recorded as ``update.handled`` with what it caused.

An unpaired chat gets a short pairing hint (at most one a day) and reaches nothing; ``/pair
CODE`` pairs it if the code is issued, unused and unexpired (failures are counted per chat: past
five in ten minutes, or twenty in a day, a chat is told to wait, and its codes are not even
checked). What a chat that is not paired sends is recorded only when it did something (a hint
sent, a code tried, a chat paired or migrated): anyone can write to a bot, and the journal must
not grow with every message of every stranger (see :meth:`Inbound.handle`). A paired chat's
text goes to its conversation run (started by its first message); a reply to an approval prompt
or a press of its buttons decides the call, if the user is one of the approvers of the agent
whose call it is (a child run's call, shown in its parent's chat, needs the child's agent's). In a
group, only what is addressed to the bot counts (``@bot`` or ``/command@bot``, or a reply to
the bot). Files go into the run's workspace.
"""

from __future__ import annotations

import base64
import logging
import re
import time
import uuid
from typing import Any

import attrs

from toren import Context
from toren.actors.channels import outbound, runtime
from toren.actors.channels.reading import ended, where_to_decide
from toren.actors.channels.telegram import SendError
from toren.actors.channels.updates import (
    CALLBACK,
    CALLBACK_TEXT,
    NO,
    YES,
    Update,
    addressed,
    command_of,
    parse,
)
from toren.channels import (
    ChannelState,
    ChatMigrated,
    ChatPaired,
    ChatUnblocked,
    ConversationEnded,
    ConversationStarted,
    DecisionSent,
    PairFailed,
    Prompt,
    UpdateHandled,
    approvers_of,
    chat_key,
    issued_code,
    redact,
    telegram_principal,
)
from toren.directory import directory_of
from toren.kernel import TRANSIENT_DB_ERRORS, actor_row, printable, utf8_size
from toren.runs import RUN_KIND, Decide, Say, StartRun, agent_route, agents_of
from toren.sandboxes import SANDBOX_KIND, SANDBOX_ROUTE, WORKSPACE, WriteFiles, sandbox_address

log = logging.getLogger("toren.channel")
_RETRIED: tuple[type[BaseException], ...] = (*TRANSIENT_DB_ERRORS, OSError)  # tried again

PAIR_TRIES = 5
PAIR_WINDOW = 600.0
PAIR_DAILY = 20  # failed codes from one chat in a day (the state keeps a chat's last 20)
DAY = 86400.0
HINT_EVERY = DAY
HINT = (
    "This chat is not paired with an agent. Ask its operator for a code "
    "(`toren channels pair AGENT`), then send /pair CODE."
)
# What a chat that is not paired did when these are its outcome: nothing (no row is recorded).
_QUIET = frozenset({"ignored", "stale", "pair_refused"})
_NAMESPACE = uuid.UUID("5d0f3c1e-8b7a-4e2f-9c61-2a4b8e7d9f30")


class Inbound:
    """Handles updates for one channel actor step."""

    def __init__(
        self,
        ctx: Context[ChannelState],
        bot: runtime.Bot,
        actor_id: str,
        limits: outbound.Limits | None = None,
    ) -> None:
        self.ctx = ctx
        self.bot = bot
        self.actor_id = actor_id
        self.limits = limits or outbound.Limits()  # the actor's: a hint is sent here
        self._sent_to = ""  # the run the update being handled was sent to

    async def handle(self, raw: dict[str, Any], *, polling: bool) -> int | None:
        """Handle one raw update and record it (``update.handled``), unless it came from a
        chat that is not paired (or from no chat) and did nothing; returns its id (None
        without one: then it is skipped).

        Such an update leaves no row: anyone on Telegram can send them, without end. When
        polling, the actor still asks for the updates after it (its offset, kept in memory past
        the recorded one). A crash before the next recorded update may bring it back, and it is
        ignored again: what it did (nothing; at most a button press answered again) is the same
        the second time, so handling it twice does not matter.
        """
        ctx = self.ctx
        update = parse(raw, ctx.state.bot_id)
        if update is None:
            log.warning("%s: an update without an update_id was skipped", self.actor_id)
            return None
        if polling and update.update_id < ctx.state.offset:
            return update.update_id  # handled before (Telegram sent it again: not confirmed)
        self._sent_to = ""
        seq = ctx.seq
        try:
            outcome, detail = await self._dispatch(update)
        except _RETRIED:
            raise  # tried again: the update is handled when the database answers
        except Exception as exc:  # a bug, or an update nothing foresaw
            # Recorded and passed: one update must not stop the bot for ever.
            log.exception("%s: update %d could not be handled", self.actor_id, update.update_id)
            outcome, detail = "error", f"{type(exc).__name__}: {exc}"
        stranger = update.chat_id is None or str(update.chat_id) not in ctx.state.chats
        if stranger and outcome in _QUIET and ctx.seq == seq:
            return update.update_id
        ctx.emit(
            UpdateHandled(
                update_id=update.update_id,
                chat_id=update.chat_id,
                user_id=update.user_id,
                kind=update.kind,
                outcome=outcome,
                detail=redact(detail)[:500],
                run=self._sent_to,
                at=time.time(),
            )
        )
        return update.update_id

    async def _dispatch(self, update: Update) -> tuple[str, str]:
        state = self.ctx.state
        if update.kind == "callback":
            return await self._callback(update)
        chat_id = update.chat_id
        if chat_id is None or update.kind == "other":
            return "ignored", "not a message"
        if update.kind == "migrated" and update.migrate_to is not None:
            self.ctx.emit(ChatMigrated(chat_id=chat_id, to=update.migrate_to, at=time.time()))
            return "migrated", f"to {update.migrate_to}"
        paired = state.chats.get(str(chat_id))
        text = update.text
        if update.chat_type in ("group", "supergroup"):
            to_bot, text = addressed(update, state.username)
            command, _ = command_of(text, state.username)
            if not to_bot and not command.startswith("/pair"):
                return "ignored", "not addressed to the bot"
        update = attrs.evolve(update, text=text)
        command, argument = command_of(text, state.username)
        if paired is None:
            if command in ("/pair", "/start") and argument:
                return self._pair(update, argument)
            return await self._hint(update)
        if paired.blocked:
            self.ctx.emit(ChatUnblocked(chat_id=chat_id, at=time.time()))
        if command in ("/pair", "/start"):  # never forwarded: its argument may be a code
            self._say(update, f"This chat is paired with {state.agent}: write to talk to it.")
            return "ignored", "already paired"
        if update.reply_to is not None:
            decision = state.prompt_of.get(f"{chat_id}/{update.reply_to}")
            if decision is not None:
                return await self._reply_decision(update, decision)
        if update.kind in ("document", "photo"):
            return await self._file(update)
        if not text.strip():
            return "ignored", "no text"
        return await self._forward(update, text)

    # -- pairing ---------------------------------------------------------------------------

    def _pair(self, update: Update, code: str) -> tuple[str, str]:
        ctx, now = self.ctx, time.time()
        chat_id = update.chat
        failures = ctx.state.failures.get(str(chat_id), ())
        recent = [t for t in failures if t > now - PAIR_WINDOW]
        today = [t for t in failures if t > now - DAY]
        # Told once, with the last failure: silent until then (and not recorded).
        if len(recent) >= PAIR_TRIES or len(today) >= PAIR_DAILY:
            return "pair_refused", "rate limited"
        digest = self.bot.pairing.digest(code)
        if issued_code(ctx.state, digest, now) is None:
            ctx.emit(PairFailed(chat_id=chat_id, at=now))
            text = "That code is wrong, used or expired. Ask for a new one."
            if len(today) + 1 >= PAIR_DAILY:
                text += " Too many wrong codes from this chat today: none is checked for a day."
            elif len(recent) + 1 >= PAIR_TRIES:
                text += " Too many wrong codes from this chat: none is checked for ten minutes."
            self._say(update, text)
            return "pair_failed", "unknown or expired code"
        who = telegram_principal(update.user_id or 0, update.user_name)
        ctx.emit(
            ChatPaired(
                chat_id=chat_id,
                title=update.chat_title or str(chat_id),
                chat_type=update.chat_type or "private",
                code_hash=digest,
                by=who,
                at=now,
            )
        )
        self._say(update, f"Paired with {ctx.state.agent}. Write to talk to it.")
        return "paired", f"by {who.id}"

    async def _hint(self, update: Update) -> tuple[str, str]:
        """Tell an unpaired chat how to pair, at most once a day. The hint is sent here, not
        through the outbox, so that it is one row (this update's, outcome ``hinted``) rather
        than three: sent, then recorded; a crash between the two sends it again (at least once,
        whatever the channel's ``delivery``). Not sent, the update is ignored (no row)."""
        ctx, now = self.ctx, time.time()
        last = ctx.state.hinted.get(str(update.chat_id))
        if last is not None and now - last < HINT_EVERY:
            return "ignored", "not paired (hinted today)"
        if self.limits.wait(now, self.bot.settings.global_per_second) > 0:
            return "ignored", "not paired (the bot's send rate is used up: no hint)"
        ctx.ensure_lease()
        try:
            await self.bot.api.send_text(
                update.chat, HINT, thread=update.thread, reply_to=update.message_id
            )
        except SendError as exc:
            if exc.action == "retry":
                self.limits.hold(exc.retry_after)
            return "ignored", f"not paired (the hint was not sent: {exc.detail})"
        self.limits.sent(time.time())
        return "hinted", "not paired"

    # -- conversations ---------------------------------------------------------------------

    def _say(self, update: Update, text: str) -> None:
        outbound.queue(
            self.ctx,
            update.chat,
            text,
            kind="notice",
            thread=update.thread,
            reply_to=update.message_id,
        )

    def _key(self, update: Update) -> str:
        per_thread = self.bot.settings.per_thread
        return chat_key(update.chat, update.thread if per_thread else None)

    async def _conversation(self, update: Update, text: str) -> tuple[str, bool]:
        """The chat's conversation run, started with ``text`` if it has none (or its last
        one failed or was cancelled): (run, started now)."""
        ctx = self.ctx
        key = self._key(update)
        who = telegram_principal(update.user_id or 0, update.user_name)
        run = ctx.state.conversations.get(key)
        if run is not None:
            row = await actor_row(
                runtime.of(self.ctx).pool, run, fields=("summary.status", "summary.error_class")
            )
            if row is None or row.summary_dict.get("status") not in ("failed", "cancelled"):
                self._sent_to = run
                return run, False
            # It failed before the channel read its end: say so here, since the conversation
            # is not read any more.
            ctx.emit(ConversationEnded(key=key, run=run, at=time.time()))
            error_class = str(row.summary_dict.get("error_class"))
            self._say(update, f"{ended(error_class)}: this message starts a new one.")
        count = ctx.state.started.get(key, 0)
        name = f"{self.actor_id}\0{key}\0{count}"
        run = f"run/{uuid.uuid5(_NAMESPACE, name)}"
        agent = self.bot.agent.name
        ctx.spawn(RUN_KIND, run, {"agent": agent}, route=agent_route(agent))
        # On the system lane, as the chat's later messages (run.say) are: a run takes its
        # system lane first, so a start on the user lane would come after them.
        start = StartRun(agent=agent, input=text, by=who)
        ctx.send(run, start, dedupe_key="start", system=True)
        ctx.emit(
            ConversationStarted(
                key=key, chat_id=update.chat, thread=update.thread, run=run, at=time.time()
            )
        )
        self._sent_to = run
        return run, True

    async def _forward(self, update: Update, text: str) -> tuple[str, str]:
        cap = runtime.of(self.ctx).settings.max_message_bytes
        if utf8_size(text) > cap:
            self._say(update, f"That message is over {cap} bytes: send it in parts.")
            return "refused", f"{utf8_size(text)} bytes, over {cap}"
        run, started = await self._conversation(update, text)
        if not started:
            who = telegram_principal(update.user_id or 0, update.user_name)
            self.ctx.send(
                run, Say(text=text, by=who, who=who.name, channel="telegram"), system=True
            )
        return ("started" if started else "forwarded"), run

    async def _file(self, update: Update) -> tuple[str, str]:
        settings = self.bot.settings
        agent = self.bot.agent
        if agent.sandbox is None:
            self._say(update, f"{agent.name} has no workspace: it cannot take files.")
            return "refused", "no sandbox"
        cap = runtime.of(self.ctx).settings.max_message_bytes
        if utf8_size(update.text) > cap:
            self._say(update, f"That caption is over {cap} bytes: send it in parts.")
            return "refused", f"a caption of {utf8_size(update.text)} bytes, over {cap}"
        size = update.file_size
        if size is not None and size > settings.max_file_bytes:
            self._say(update, f"That file is {size} bytes; at most {settings.max_file_bytes}.")
            return "refused", f"{size} bytes"
        if not await directory_of(self.ctx).route_served(SANDBOX_ROUTE):
            self._say(update, "No worker can open a workspace now (none has Docker): try later.")
            return "refused", "no sandbox worker"
        try:
            data = await self.bot.api.download(update.file_id, settings.max_file_bytes)
        except SendError as exc:
            self._say(update, f"That file could not be fetched: {redact(exc.detail)}")
            return "refused", exc.detail
        name = _safe_name(update.file_name) or f"file-{update.update_id}"
        path = f"uploads/{name}"
        note = f"[a file arrived: {WORKSPACE}/{path}, {len(data)} bytes]"
        text = f"{note}\n{update.text}" if update.text.strip() else note
        run, started = await self._conversation(update, text)
        address = sandbox_address(run)
        self.ctx.spawn(
            SANDBOX_KIND,
            address,
            {"run": run, "settings": agent.sandbox.as_args()},
            route=SANDBOX_ROUTE,
            parent=run,
        )
        files = {path: base64.b64encode(data).decode()}
        self.ctx.send(address, WriteFiles(files=files, request_id=f"update-{update.update_id}"))
        if not started:
            who = telegram_principal(update.user_id or 0, update.user_name)
            self.ctx.send(
                run, Say(text=text, by=who, who=who.name, channel="telegram"), system=True
            )
        return "file", path

    # -- decisions -------------------------------------------------------------------------

    async def _approvers(self, prompt: Prompt) -> tuple[str, tuple[int, ...]]:
        """The agent whose call the prompt shows, and the users who may decide its calls: the
        approvers of that agent's own bot (a child run's call needs the child's agent's)."""
        name = prompt.opened.agent
        if not name:  # a prompt opened by an earlier version: the agent of the run it names
            row = await actor_row(
                runtime.of(self.ctx).pool, prompt.opened.run, fields=("args.agent",)
            )
            name = str((row.args_dict.get("agent") if row is not None else None) or "")
        if name == self.bot.agent.name:
            return name, self.bot.settings.approvers
        return name, approvers_of(agents_of(self.ctx).named(name))

    def _decide(self, update: Update, decision: str, approved: bool, reason: str) -> str:
        """Send a decision to the run; returns what to tell the user. The chat is told who
        decided when the channel reads the decision in the run's journal (what the run applied,
        not what was asked), or now for a child run's call (its journal is not read here)."""
        ctx = self.ctx
        prompt = ctx.state.prompts[decision]
        who = telegram_principal(update.user_id or 0, update.user_name)
        ctx.send(
            prompt.opened.run,
            Decide(
                call_id=prompt.opened.call_id,
                approved=approved,
                by=who,
                who=who.name,
                reason=reason[:2000],
                channel="telegram",
            ),
            system=True,
        )
        ctx.emit(
            DecisionSent(
                decision=decision, approved=approved, by=who, reason=reason[:2000], at=time.time()
            )
        )
        verb = "Approved" if approved else "Denied"
        if prompt.opened.run not in ctx.state.watches:
            outbound.queue(
                ctx,
                prompt.opened.chat_id,
                printable(f"{verb} by {who.name}: {prompt.opened.name}."),
                kind="notice",
                thread=update.thread,
            )
        return f"{verb}."

    def _prompt_here(self, update: Update, decision: str) -> Prompt | None:
        """The prompt ``decision`` if it was sent to this chat (or to the group this chat
        was before it became a supergroup), and this chat is paired."""
        state = self.ctx.state
        prompt = state.prompts.get(decision)
        if prompt is None or str(update.chat) not in state.chats:
            return None
        chat = prompt.opened.chat_id
        if update.chat_id not in (chat, state.migrated.get(str(chat))):
            return None
        return prompt

    async def _waits(self, prompt: Prompt) -> bool:
        """Whether the prompt's call still waits for a decision (by the run's row: a decision
        made elsewhere may not be read here yet). The run refuses a late one anyway."""
        row = await actor_row(
            runtime.of(self.ctx).pool, prompt.opened.run, fields=("summary.waiting_on",)
        )
        waiting = row.summary_dict.get("waiting_on") if row is not None else None
        return isinstance(waiting, list) and prompt.opened.call_id in waiting

    async def _refusal(self, update: Update, decision: str) -> tuple[str, str, str] | None:
        """Why ``update`` cannot decide ``decision``: (outcome, detail, what to tell the
        user), or None if it can."""
        prompt = self.ctx.state.prompts[decision]
        agent, approvers = await self._approvers(prompt)
        if update.user_id is None or update.user_id not in approvers:
            if agent == self.bot.agent.name:
                text = f"Only the agent's approvers can decide (your user id: {update.user_id})."
            elif approvers:
                text = (
                    f"Only the approvers of {agent}, whose call it is, can decide it (your user "
                    f"id: {update.user_id})."
                )
            else:
                opened = prompt.opened
                text = (
                    f"{agent}, whose call it is, has no approvers on Telegram. "
                    f"{where_to_decide(opened.run, opened.call_id)}"
                )
            return "refused", f"user {update.user_id} is not an approver of {agent}", text
        if prompt.state != "open" or not await self._waits(prompt):
            text = "This call no longer waits for a decision."
            return "stale", f"decision {decision} does not wait", text
        if not prompt.opened.decidable:
            # Its prompt could not show the whole call: what was approved would not be what runs.
            opened = prompt.opened
            text = (
                "This call is too long to show whole here, so it cannot be decided from "
                f"Telegram. {where_to_decide(opened.run, opened.call_id)}"
            )
            return (
                "refused",
                f"decision {decision} cannot be made here (call not shown whole)",
                text,
            )
        return None

    async def _callback(self, update: Update) -> tuple[str, str]:
        api = self.bot.api
        self.ctx.ensure_lease()  # answering is an effect, as a send is
        match = CALLBACK.fullmatch(update.callback_data)
        if match is None:
            await api.answer_callback(update.callback_id, "This button is not one of mine.")
            return "ignored", "unknown button"
        approved, decision = match.group(1) == "a", match.group(2)
        if update.chat_id is None or self._prompt_here(update, decision) is None:
            await api.answer_callback(update.callback_id, "This button is not known here.")
            return "stale", "unknown decision"
        refused = await self._refusal(update, decision)
        if refused is not None:
            outcome, detail, text = refused
            if len(text) > CALLBACK_TEXT:
                # Where to decide does not fit a button's answer (the run and both commands):
                # the chat is told in full, under the prompt, and the answer says so.
                self._say(update, text)
                text = f"{text.split('. ', 1)[0]}. Where to decide it is in the chat."
            await api.answer_callback(update.callback_id, text)
            return outcome, detail
        answer = self._decide(update, decision, approved, "by a button in Telegram")
        await api.answer_callback(update.callback_id, answer)
        return "decided", decision

    async def _reply_decision(self, update: Update, decision: str) -> tuple[str, str]:
        words = update.text.strip().split(maxsplit=1)
        first = words[0].lower().strip(".!,:;") if words else ""
        decidable = self.ctx.state.prompts[decision].opened.decidable
        if first not in YES | NO and decidable:  # else: told where it is decided
            self._say(update, "Reply with approve or deny (and a reason, if you like) to decide.")
            return "ignored", "a reply to a prompt that decides nothing"
        refused = await self._refusal(update, decision)
        if refused is not None:
            self._say(update, refused[2])
            return refused[0], refused[1]
        reason = words[1] if len(words) > 1 else "by a reply in Telegram"
        self._decide(update, decision, first in YES, reason)
        return "decided", decision


def _safe_name(name: str) -> str:
    """A file name a user sent, as a name in ``uploads/`` (no directories, no odd characters)."""
    base = name.replace("\\", "/").rsplit("/", 1)[-1]
    base = re.sub(r"[^A-Za-z0-9._ -]", "_", base).strip(" .")
    return base[:120]
