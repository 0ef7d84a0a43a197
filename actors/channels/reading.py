"""Reading runs' journals: a conversation's replies, its approval prompts, its files; what
observers see.

The channel keeps, per run it watches, how far it has read (``run.read``), and records that in
the same step as the outbound messages what it read causes: a crash repeats neither, nor loses
one. One query reads every watched run's new events (by the journal's primary key).
"""

from __future__ import annotations

import json
import logging
import secrets
import shlex
import time
from datetime import UTC, datetime
from typing import Any

from toren import ActorFailed, Context
from toren.actors.channels import outbound, runtime
from toren.channels import (
    TEXT_LIMIT,
    ChannelState,
    ConversationEnded,
    ObservedRun,
    PromptClosed,
    PromptOpened,
    RunRead,
)
from toren.kernel import actor_row, actors_of_kind, decode, events, events_after, printable
from toren.runs import (
    RUN_KIND,
    ApprovalDecided,
    ApprovalRequested,
    ChildApprovalRequested,
    RunCompleted,
    RunFailed,
    ToolIntended,
    ToolResulted,
)

log = logging.getLogger("toren.channel")

BATCH = 500
NEW_RUNS = 50
"""New runs of an observed agent read at most per step."""
_TURN_ENDS = {"run.completed", "run.failed", "toren.failed"}
_TURN_STARTS = {"run.started", "message.received", "run.retried"}
_INTERESTING = {
    "run.completed",
    "run.failed",
    "toren.failed",
    "approval.requested",
    "approval.decided",
    "child.approval_requested",
    "tool.intent",
    "tool.result",
}


def _args(arguments: Any) -> str:
    """A call's arguments as the chat shows them: JSON, with every character that could hide
    or reorder what is read (bidi controls, C0 and C1 controls, lone surrogates) written as an
    escape, as the CLI and the console show them (``"/home/\\u202efdp.sh"``, not a path that
    reads backwards)."""
    try:
        text = json.dumps(arguments, ensure_ascii=False, indent=1)
    except (TypeError, ValueError):
        text = repr(arguments)
    return printable(text)


def where_to_decide(run: str, call_id: str) -> str:
    """Where a call that cannot be decided from the chat is seen whole and decided."""
    call = shlex.quote(printable(call_id))
    return (
        f"See it whole and decide it on the console's page of run {run}, or with:\n"
        f"toren jobs approve {run} --call {call}\n"
        f"toren jobs deny {run} --call {call}"
    )


def _from_the_chat(kind: str, data: Any) -> int:
    """Whether an event is the run taking a message a channel sent it: its start, or what a
    Telegram user said (1), or not (0)."""
    if kind == "run.started":
        return 1
    return int(
        kind == "message.received" and isinstance(data, dict) and data.get("channel") == "telegram"
    )


class Reader:
    """Reads the watched runs for one channel step.

    A run whose turn has ended (its last event that mattered completed or failed it) is read
    again when the channel sends it something (a step reads the runs before it handles updates,
    so that what an update sends a run wakes it after that step's reads); ``sweep`` reads every
    watched run (a run someone
    else sent a message to, from the CLI or the console), so that the cost of a tick grows with
    the conversations going on, not with every conversation the bot ever had."""

    def __init__(self, ctx: Context[ChannelState], *, sweep: bool = False) -> None:
        self.ctx = ctx
        self.pool = runtime.of(ctx).pool
        self.sweep = sweep

    async def read(self) -> None:
        await self._discover()
        watches = self.ctx.state.watches
        runs = sorted(r for r, w in watches.items() if w.active or self.sweep)
        if not runs:
            return
        rows = await events_after(self.pool, [(r, watches[r].seq) for r in runs], limit=BATCH)
        last: dict[str, int] = {}
        done: dict[str, bool] = {}
        heard: dict[str, int] = {}
        for run, entry in rows:
            seq = entry.seq
            last[run] = seq
            if entry.type in _TURN_STARTS:
                done[run] = False
                heard[run] = heard.get(run, 0) + _from_the_chat(entry.type, entry.data)
            if entry.type not in _INTERESTING:
                continue
            done[run] = entry.type in _TURN_ENDS
            try:
                event = decode(entry.type, entry.data)
            except Exception:  # noqa: BLE001  (a type this version cannot read: skipped, logged)
                log.warning("%s: event %s of %s could not be read", self.ctx.actor_id, seq, run)
                continue
            await self._event(run, seq, event)
        for run, seq in last.items():
            self.ctx.emit(
                RunRead(run=run, seq=seq, done=done.get(run, False), heard=heard.get(run, 0))
            )

    async def _discover(self) -> None:
        """Runs of observed agents that began since the last look."""
        state = self.ctx.state
        for agent in state.agent_observers:
            since = state.agent_seen.get(agent, time.time())
            new = await actors_of_kind(
                self.pool,
                RUN_KIND,
                args={"agent": agent},
                since=datetime.fromtimestamp(since, UTC),
                order="oldest",
                limit=NEW_RUNS,
            )
            for row in new:
                created = row.created_at.timestamp()
                self.ctx.emit(ObservedRun(agent=agent, run=row.actor_id, created=created))

    async def _event(self, run: str, seq: int, event: Any) -> None:
        watch = self.ctx.state.watches.get(run)
        if watch is None:
            return
        key = watch.conversation
        if key is not None:
            await self._conversation(run, seq, key, event)
        for chat in watch.observers:
            await self._observer(run, seq, chat, event)

    def _chat_of(self, key: str) -> tuple[int, int | None]:
        chat, _, thread = key.partition("/")
        return int(chat), (int(thread) if thread else None)

    async def _conversation(self, run: str, seq: int, key: str, event: Any) -> None:
        ctx = self.ctx
        chat, thread = self._chat_of(key)
        source = f"{run}#{seq}"
        if isinstance(event, RunCompleted):
            text = event.output if event.output.strip() else "(the agent answered nothing)"
            outbound.queue(ctx, chat, text, thread=thread, source=source)
        elif isinstance(event, ApprovalRequested):
            self._prompt(
                chat,
                thread,
                run,
                event.call_id,
                event.name,
                event.arguments,
                event.cwd,
                source,
                agent=ctx.state.agent,
            )
        elif isinstance(event, ChildApprovalRequested):
            name = f"{event.name} (in {event.agent}, run {event.run_id})"
            self._prompt(
                chat,
                thread,
                event.run_id,
                event.child_call_id,
                name,
                event.arguments,
                None,
                source,
                agent=event.agent,
            )
        elif isinstance(event, ApprovalDecided):
            for decision, prompt in ctx.state.prompts.items():
                opened = prompt.opened
                if opened.run != run or opened.call_id != event.call_id:
                    continue
                if prompt.state == "closed":
                    continue
                ctx.emit(
                    PromptClosed(
                        decision=decision, approved=event.approved, by=event.who, at=time.time()
                    )
                )
                verb = "Approved" if event.approved else "Denied"
                via = f" ({event.channel})" if event.channel != "telegram" else ""
                text = printable(f"{verb} by {event.who}{via}: {opened.name}.")
                outbound.queue(ctx, opened.chat_id, text, kind="notice", thread=thread)
        elif isinstance(event, RunFailed | ActorFailed):
            message = event.message if isinstance(event, RunFailed) else event.error
            text = (
                f"{ended(event.error_class)}: {outbound.cut(message, 1000)}\n"
                "Your next message starts a new one."
            )
            outbound.queue(ctx, chat, text, kind="notice", thread=thread, source=source)
            ctx.emit(ConversationEnded(key=key, run=run, at=time.time()))
        elif isinstance(event, ToolResulted) and not event.is_error and event.checkpoint:
            await self._sent_file(chat, thread, run, event, source)

    def _prompt(
        self,
        chat: int,
        thread: int | None,
        run: str,
        call_id: str,
        name: str,
        arguments: Any,
        cwd: str | None,
        source: str,
        *,
        agent: str,
    ) -> None:
        """Prompt ``chat`` for a decision on call ``call_id`` of ``run`` (the conversation's run,
        or a child run of its cross-agent call).

        The prompt decides (buttons, a reply) only if it shows the whole call: its head, every
        argument (escaped) and its tail in one Telegram message. A call too long for that is
        shown cut, without buttons; a reply to it decides nothing, and it says where the call
        is seen whole and decided."""
        ctx = self.ctx
        decision = secrets.token_urlsafe(12)  # 16 characters: "a:" + it is 18 bytes, under 64
        where = f"\n(in {cwd})" if cwd else ""
        head = printable(f"{ctx.state.agent} asks to run {name}:{where}\n")
        tail = (
            "\nApprove or deny with the buttons, or reply to this message: approve / deny, and why."
        )
        body = _args(arguments)
        decidable = outbound.units(head + body + tail) <= TEXT_LIMIT
        if not decidable:
            tail = (
                "\nThis call is too long to show whole in one message, so it cannot be decided "
                f"here. {where_to_decide(run, call_id)}"
            )
            body = outbound.cut(body, TEXT_LIMIT - outbound.units(head + tail))
        ctx.emit(
            PromptOpened(
                decision=decision,
                run=run,
                call_id=call_id,
                name=printable(name[:200]),
                chat_id=chat,
                decidable=decidable,
                at=time.time(),
                agent=agent,
            )
        )
        outbound.queue(
            ctx,
            chat,
            head + body + tail,
            kind="prompt",
            thread=thread,
            decision=decision,
            source=source,
        )

    async def _sent_file(
        self, chat: int, thread: int | None, run: str, event: ToolResulted, source: str
    ) -> None:
        if not event.content.endswith("will be sent to the chat"):
            return
        found = await events(
            self.pool, run, types=("tool.intent",), match={"call_id": [event.call_id]}, limit=1
        )
        intent = decode("tool.intent", found[0].data) if found else None
        if not isinstance(intent, ToolIntended) or intent.name != "send_file":
            return
        path = str(intent.arguments.get("path", ""))
        caption = str(intent.arguments.get("caption", ""))
        file = {"run": run, "path": path, "checkpoint": event.checkpoint}
        outbound.queue(
            self.ctx, chat, caption, kind="file", thread=thread, file=file, source=source
        )

    async def _observer(self, run: str, seq: int, chat: int, event: Any) -> None:
        ctx = self.ctx
        source = f"{run}#{seq}"
        text = ""
        if isinstance(event, ToolIntended):
            call = printable(event.name) + " " + outbound.cut(_args(event.arguments), 600)
            text = f"\U0001f527 {run}: {call}"
        elif isinstance(event, ApprovalRequested):
            call = printable(event.name) + " " + outbound.cut(_args(event.arguments), 600)
            text = (
                f"\u23f8 {run} waits for a decision on {call}\n"
                "(observers cannot decide: use the console, or toren jobs approve)"
            )
        elif isinstance(event, RunCompleted):
            row = await actor_row(self.pool, run, fields=("summary.usd_paid", "summary.calls_made"))
            summary = row.summary_dict if row is not None else {}
            cost = f"${summary.get('usd_paid', '0')} for {summary.get('calls_made', 0)} model calls"
            text = f"\u2705 {run} completed ({cost}):\n{outbound.cut(event.output, 1500)}"
        elif isinstance(event, RunFailed | ActorFailed):
            message = event.message if isinstance(event, RunFailed) else event.error
            how = (
                "cancelled" if event.error_class == "cancelled" else f"failed ({event.error_class})"
            )
            text = f"\u274c {run} {how}: {outbound.cut(message, 600)}"
        if text:
            outbound.queue(ctx, chat, text, kind="observer", source=source)


def ended(error_class: str) -> str:
    """How the chat is told its conversation ended without an answer: a cancel is not a failure."""
    if error_class == "cancelled":
        return "The conversation was cancelled"
    return f"The conversation failed ({error_class})"
