"""Mutations: patches the harness loads into a worker process, each removing one protection.

A mutation is how the matrix shows that it detects the bugs it exists for: with one protection
gone, some cells must turn red. They are loaded by :mod:`chaos.app` when ``CHAOS_MUTATION``
names one, so they live only in worker processes the harness starts; Toren's own code has no
switch for them. A mutation of the kernel's statements replaces their fragments by name
(:mod:`toren._core.step_sql`), never their text.

- ``no-fencing``: the step commit and the message claim no longer check ``owner`` and
  ``epoch``, so a zombie worker's stale write is accepted.
- ``effect-before-intent``: a tool runs before its ``tool.intent`` is recorded (intent and result
  are committed together, after the effect): the journal can miss an effect the world saw.
- ``consume-on-claim``: a message is deleted when it is claimed, in its own transaction, instead
  of in the step that records what it caused: a crash in between loses the message.
- ``unbound-decisions``: a decision is applied to the first call waiting for one, whatever call
  it names (as before decisions named their call): a stale approval approves the wrong call.
- ``child-end-after-commit``: a child run tells its parent that it ended in a send of its own,
  after the step that records its end committed, instead of in that step (its outbox): a crash
  in between leaves the parent waiting for ever.
- ``sandbox-runs-again``: a sandboxed call whose step was cut (its ``sandbox.go`` handled again)
  is run again instead of looked for in the container (as if every sandbox were declared
  rerunnable): a command in flight at a crash runs twice.
- ``telegram-confirm-before-record``: a channel confirms a poll's updates to Telegram (the offset
  of a second ``getUpdates``) as soon as it has them, before the step that records them and what
  they cause: a crash in between and Telegram never gives them again.
- ``telegram-send-unrecorded``: a bot declared at most once sends as at least once, without
  recording ``outbox.sending`` in a step of its own first: a crash between a send and its record
  sends the message again.
- ``calls-unannounced``: a run no longer announces the model call its next step makes
  (``model.calling``): a call lost in flight at a crash is made again and counted nowhere, and
  the receipt shows fewer calls than the provider received.
- ``turn-ends-later``: an answer that asks for no tool ends its turn (``run.completed``) in the
  run's next step, not in the commit that records it: a message that arrives in between is taken
  first, and the answer never reaches the chat.
- ``early-message-dropped``: a message handled before its run's start is recorded at once, not
  sent again behind the start: the start's fold begins the conversation without it.
- ``schedule-slot-unkeyed``: a schedule starts each slot's run under a fresh id instead of one
  derived from the schedule and the slot (its idempotency key): a slot fired again (a backfill
  of a range whose slots ran) starts a second run.
- ``upgrade-by-replay``: a run moved to another version records ``run.upgraded`` as a replay
  whatever its agent's policy says (``next_turn`` takes the history by value): the calls made on
  the old version are checked against the new version's requests, invalidated from the first
  (the system prompt differs) and paid again.
- ``fork-prefix-short``: a fork's journal is copied one event short of its step (the source's
  last event before it left out): the fork begins from a state its source never had (the ticket's
  call without its result), runs that call again under its source's key, and asks the
  tracker for an effect its source applied. Forks are made by the client that asks for one
  (``toren.runs.fork_run``), so the harness applies it in its own process, for the cell's
  duration (:func:`applied_here`).
- ``ack-before-commit``: a worker's group commit tells the steps of a batch that they landed as
  soon as the batch is on its way, and learns how its commit went afterwards (a batch that
  failed is only logged): a step's next effect (a model call, a tool run) can happen before the
  step that announced it committed, and a batch that fails (refused by the database, cut in
  flight) loses steps its actors were told had landed; their next steps commit after a hole.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

MUTATIONS = (
    "no-fencing",
    "effect-before-intent",
    "consume-on-claim",
    "unbound-decisions",
    "child-end-after-commit",
    "sandbox-runs-again",
    "telegram-confirm-before-record",
    "telegram-send-unrecorded",
    "calls-unannounced",
    "turn-ends-later",
    "early-message-dropped",
    "schedule-slot-unkeyed",
    "upgrade-by-replay",
    "fork-prefix-short",
    "ack-before-commit",
)
# The mutations of what the harness's own process runs (the client side): applied there too.
HERE = frozenset({"fork-prefix-short"})

# The fence without its check of owner and epoch (still typed by them: a parameter the statement
# does not name has no type).
_UNFENCED = (
    "WHERE actor_id = {actor_id} AND {owner}::uuid IS NOT NULL AND {epoch}::bigint IS NOT NULL"
    " AND status = 'live'"
)


def _no_fencing() -> None:
    from toren._core import mailbox as _mailbox
    from toren._core import step_sql

    step_fence = f"""fence AS (
    SELECT actor_id, watched_until, limits FROM toren.actors
    {_UNFENCED}
    FOR SHARE
)"""
    claim_fence = f"""fence AS (
    SELECT actor_id, limits FROM toren.actors
    {_UNFENCED}
    FOR SHARE
)"""
    _mailbox._COMMIT = step_sql.step_statement({**step_sql.STEP_FRAGMENTS, "fence": step_fence})
    _mailbox._CLAIM_NEXT = step_sql.claim_statement(
        {**step_sql.CLAIM_FRAGMENTS, "fence": claim_fence}
    )


def _effect_before_intent() -> None:
    from toren.actors.runs import RunActor, ahead

    # No intent recorded ahead, with the step before the tool's (issue 33): the tool's own step
    # records it, and runs the tool at once.
    ahead.intend = lambda ctx, agent: None
    original = RunActor._tool_step

    async def tool_step(self: RunActor, ctx: Any, agent: Any, call: Any) -> None:
        before = len(ctx.events)
        await original(self, ctx, agent, call)
        if any(e[1] == "tool.intent" for e in ctx.events[before:]):
            # Run it in the same handler: the intent reaches the journal only with the result.
            await original(self, ctx, agent, ctx.state.pending_calls[0])

    RunActor._tool_step = tool_step  # type: ignore[method-assign]


def _consume_on_claim() -> None:
    from toren._core import mailbox as _mailbox
    from toren._core import step_sql

    # The claim deletes the message (and says it delivered it once more, as the update did).
    claim = """next AS (
    SELECT id FROM toren.mailbox
    WHERE actor_id = {actor_id} AND visible_at <= now() AND EXISTS (SELECT 1 FROM fence)
    ORDER BY lane, id LIMIT 1
), claimed AS (
    DELETE FROM toren.mailbox m USING next WHERE m.id = next.id
    RETURNING m.id, m.lane, m.sender, m.kind, m.body, m.reply_to, m.deliveries + 1 AS deliveries,
              m.attempts, m.timer_name IS NOT NULL AS is_timer
)"""
    _mailbox._CLAIM_NEXT = step_sql.claim_statement({**step_sql.CLAIM_FRAGMENTS, "claim": claim})
    # Claims happen only in claim_next (mutated above), never in a step's commit, which consumes
    # nothing (the claim did).
    step = {
        **step_sql.STEP_FRAGMENTS,
        "consume": """consumed AS (
    SELECT {message_id}::bigint AS id FROM fence WHERE NOT EXISTS (SELECT 1 FROM clash)
)""",
        "claim": """nxt AS (
    SELECT m.id FROM toren.mailbox m
    WHERE {claim} AND false AND m.actor_id = {actor_id} AND m.visible_at <= now()
      AND m.id <> {message_id}
      AND (m.timer_name IS NULL OR m.timer_name <> ALL({replaced_timers}::text[]))
      AND EXISTS (SELECT 1 FROM consumed)
    ORDER BY m.lane, m.id LIMIT 1
), claimed AS (
    UPDATE toren.mailbox m SET deliveries = m.deliveries + 1
    FROM nxt WHERE m.id = nxt.id
    RETURNING m.id, m.lane, m.sender, m.kind, m.body, m.reply_to, m.deliveries, m.attempts,
              m.timer_name IS NOT NULL AS is_timer
)""",
        "claim_own": """own AS (
    SELECT o.ord FROM o
    WHERE {claim} AND false AND o.recipient = {actor_id} AND o.delay <= 0
      AND o.dedupe_key IS NULL AND NOT EXISTS (SELECT 1 FROM nxt)
    ORDER BY o.lane, o.ord LIMIT 1
)""",
    }
    _mailbox._COMMIT = step_sql.step_statement(step)


def _unbound_decisions() -> None:
    import attrs

    import toren.runs
    from toren.actors.runs import deciding
    from toren.runs import DecisionOutcome, state, waiting_on

    bound = state.judge_decision

    def judge_decision(run_state: Any, decision: Any) -> Any:
        waiting = sorted(c.id for c in waiting_on(run_state))
        if not waiting:
            return bound(run_state, decision)
        detail = f"applied to {waiting[0]}, the first call waiting"
        return DecisionOutcome(call_id=waiting[0], outcome="applied", detail=detail)

    for module in (state, toren.runs, deciding):
        module.judge_decision = judge_decision  # type: ignore[attr-defined]
    original = deciding.decide

    def decide(ctx: Any, msg: Any) -> None:
        # The decision is recorded for the call it was applied to, as it was before.
        outcome = judge_decision(ctx.state, msg)
        if outcome.outcome == "applied" and outcome.call_id != msg.call_id:
            msg = attrs.evolve(msg, call_id=outcome.call_id)
        original(ctx, msg)

    deciding.decide = decide


def _child_end_after_commit() -> None:
    import orjson

    from toren._core import host as _host
    from toren._core import mailbox as _mailbox
    from toren._core.codec import decode, type_name
    from toren.actors.runs import calls
    from toren.runs import ChildEnded

    ended = type_name(ChildEnded(call_id="", run_id="", agent="", status=""))
    held: dict[str, list[Any]] = {}  # by the child's run id: the ends it has not sent yet
    after_step = calls.after_step

    def after_step_holding_ends(ctx: Any, was_running: Any) -> None:
        before = len(ctx.outgoing)
        after_step(ctx, was_running)
        added = ctx.outgoing[before:]
        held[ctx.actor_id] = [o for o in added if o.kind == ended]
        ctx.outgoing[before:] = [o for o in added if o.kind != ended]

    step = _host.ActorHost._step

    async def step_then_send(self: Any, actor: Any, envelope: Any, state: Any, seq: int) -> Any:
        out = await step(self, actor, envelope, state, seq)  # committed (kill points inside)
        for o in held.pop(self.actor_id, ()):
            msg = decode(o.kind, orjson.loads(o.body))
            await _mailbox.send(self.pool, o.to, msg, sender=self.actor_id)
        return out

    calls.after_step = after_step_holding_ends
    _host.ActorHost._step = step_then_send  # type: ignore[method-assign]


def _sandbox_runs_again() -> None:
    import attrs

    from toren.actors.sandboxes.actor import SandboxActor

    exec_ = SandboxActor._exec

    def exec_rerunnable(self: SandboxActor, ctx: Any, msg: Any) -> None:
        # Recorded as rerunnable: a sandbox.go handled again runs the command again.
        exec_(self, ctx, attrs.evolve(msg, rerunnable=True))

    SandboxActor._exec = exec_rerunnable  # type: ignore[method-assign]


def _telegram_confirm_before_record() -> None:
    from toren.actors.channels.telegram import BotApi

    fetch = BotApi.get_updates

    async def get_updates(self: BotApi, offset: int, wait: float) -> list[dict[str, Any]]:
        updates = await fetch(self, offset, wait)
        ids = [u["update_id"] for u in updates if isinstance(u.get("update_id"), int)]
        if ids:
            await fetch(self, max(ids) + 1, 0)  # confirmed now, recorded later
        return updates

    BotApi.get_updates = get_updates  # type: ignore[method-assign]


def _telegram_send_unrecorded() -> None:
    import attrs

    from toren.actors.channels import runtime

    bot = runtime.Channels.bot

    def sends_at_least_once(self: runtime.Channels, name: str) -> runtime.Bot:
        found = bot(self, name)
        if found.settings.delivery != "at_most_once":
            return found
        settings = attrs.evolve(found.settings, delivery="at_least_once")
        return attrs.evolve(found, settings=settings)

    runtime.Channels.bot = sends_at_least_once  # type: ignore[method-assign]


def _calls_unannounced() -> None:
    from toren.actors.runs import inflight

    def announce_nothing(ctx: Any, agent: Any, build: Any) -> None:
        """Announces nothing: a call lost in flight leaves no trace."""

    def never_unannounced(state: Any) -> bool:
        """A call found unannounced is made at once (not announced first, in a step of its
        own): without announcements every call is."""
        return False

    inflight.announce = announce_nothing
    inflight.calls_next = never_unannounced


def _turn_ends_later() -> None:
    from toren.actors.runs import steps
    from toren.runs import Continue

    def end_turn(ctx: Any, agent: Any) -> None:
        ctx.send(ctx.actor_id, Continue())  # the next step completes the run (if nothing came)

    steps.end_turn = end_turn


def _early_message_dropped() -> None:
    from toren.actors.runs import steps
    from toren.runs import MessageReceived, author

    def recorded_at_once(ctx: Any, msg: Any) -> None:
        who, via = author(msg)
        ctx.emit(MessageReceived(text=msg.text, who=who, channel=via, by=msg.by))

    steps.after_the_start = recorded_at_once


def _schedule_slot_unkeyed() -> None:
    import uuid

    from toren.actors.schedules import actor

    def fresh_run_id(agent: str, key: str) -> str:
        return f"run/{uuid.uuid4()}"  # the slot's key dropped

    actor.keyed_run_id = fresh_run_id  # type: ignore[attr-defined]


def _upgrade_by_replay() -> None:
    from toren.actors.runs import versions

    recorded = versions.RunUpgraded  # type: ignore[attr-defined]

    def by_replay(**fields: Any) -> Any:
        return recorded(**{**fields, "how": "replay"})

    versions.RunUpgraded = by_replay  # type: ignore[attr-defined,assignment]


def _fork_prefix_short() -> Callable[[], None]:
    import toren.runs.fork as forks

    copy = forks.copy_journal  # type: ignore[attr-defined]

    async def one_short(conn: Any, source: str, target: str, *, before: int, **more: Any) -> int:
        copied: int = await copy(conn, source, target, before=before - 1, **more)
        return copied

    forks.copy_journal = one_short  # type: ignore[attr-defined]

    def undo() -> None:
        forks.copy_journal = copy  # type: ignore[attr-defined]

    return undo


def _ack_before_commit() -> None:
    import asyncio
    import logging

    from toren._core import group_commit

    log = logging.getLogger("chaos")
    # What a step that landed returns, as far as its host reads it: ours, consumed, nothing
    # claimed next (the host claims again).
    landed = {"owned": True, "clash": None, "consumed": True, "id": None}

    async def lead(self: Any, statement: str, leader: Any) -> bool:
        batch = [leader]
        while self._queue and len(batch) < self.max_batch:
            batch.append(self._queue.popleft())
        if len(batch) == 1:
            return True
        try:
            self.batches += 1
            self.batched += len(batch)
            group_commit.log.debug(
                "sending a batch of %d steps: %s", len(batch), [w.args[0] for w in batch]
            )
            group_commit.kill_point("batch.sending")
            sending = asyncio.ensure_future(self.pool.fetchmany(statement, [w.args for w in batch]))
            await asyncio.sleep(0)  # on its way: every member told it landed
            for waiter in batch:
                waiter.row = landed
                waiter.turn.set()
            try:
                await sending
            except Exception as exc:  # the bug: told already, only logged
                log.warning("a batch acknowledged before its commit failed: %r", exc)
                return False
            group_commit.kill_point("batch.committed")
            group_commit.log.debug("a batch of %d steps committed", len(batch))
            return False
        finally:
            self._free()

    group_commit.GroupCommit._lead = lead  # type: ignore[method-assign]


@contextlib.contextmanager
def applied_here(name: str | None) -> Iterator[None]:
    """Apply mutation ``name`` in this process for the block's duration, if it mutates the
    client side (:data:`HERE`); else do nothing (the workers load it)."""
    if name not in HERE:
        yield
        return
    undo = _fork_prefix_short()
    try:
        yield
    finally:
        undo()


def load(name: str) -> None:
    """Apply mutation ``name`` to this process.

    Raises:
        ValueError: no mutation has that name.
    """
    patches = {
        "no-fencing": _no_fencing,
        "effect-before-intent": _effect_before_intent,
        "consume-on-claim": _consume_on_claim,
        "unbound-decisions": _unbound_decisions,
        "child-end-after-commit": _child_end_after_commit,
        "sandbox-runs-again": _sandbox_runs_again,
        "telegram-confirm-before-record": _telegram_confirm_before_record,
        "telegram-send-unrecorded": _telegram_send_unrecorded,
        "calls-unannounced": _calls_unannounced,
        "turn-ends-later": _turn_ends_later,
        "early-message-dropped": _early_message_dropped,
        "schedule-slot-unkeyed": _schedule_slot_unkeyed,
        "upgrade-by-replay": _upgrade_by_replay,
        "fork-prefix-short": _fork_prefix_short,  # the workers make no fork: changes nothing
        "ack-before-commit": _ack_before_commit,
    }
    if name not in patches:
        raise ValueError(f"unknown mutation {name!r}; known: {', '.join(MUTATIONS)}")
    patches[name]()
    import logging

    logging.getLogger("chaos").warning("mutation loaded: %s", name)
