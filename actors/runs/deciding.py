"""A run's decisions: a human's approval or denial of one of its tool calls (``run.decide``).

A decision is applied only to the call it names and only while that call waits
(:func:`toren.runs.judge_decision`); one from a Telegram user is applied only if the user is an
approver of the run's agent's bot, whichever chat showed the call (the surfaces check who may
decide; the run checks the decisions that come from a chat itself). A refused decision is
recorded (``decision.refused``), at most ``REFUSALS_RECORDED`` an hour: past them one
``decision.refusals_muted`` says that the rest of the hour's are answered, not recorded, so
that a flood of bogus decisions grows neither the journal nor the log without bound. Every
decision is answered (its sender may be waiting in ``ask``).
"""

from __future__ import annotations

import logging
import time

from toren import Context
from toren.channels import approvers_of, telegram_user
from toren.kernel import kill_point
from toren.runs import (
    REFUSAL_WINDOW,
    REFUSALS_RECORDED,
    ApprovalDecided,
    Continue,
    Decide,
    DecisionOutcome,
    DecisionRefused,
    DecisionsMuted,
    RunState,
    agents_of,
    author,
    judge_decision,
)

log = logging.getLogger("toren.run")


def decide(ctx: Context[RunState], msg: Decide) -> bool:
    """Apply ``msg`` to the call it names, or refuse it; answer its sender either way.
    Returns whether it was applied (the run is sent on)."""
    outcome = judge_decision(ctx.state, msg)
    user = telegram_user(msg.by)
    if user is not None and user not in approvers_of(agents_of(ctx).named(ctx.state.agent)):
        # The surfaces check who may decide; the run checks it too, for the decisions that
        # come from a chat (a prompt for a child run's call shows in its parent's chat).
        detail = (
            f"Telegram user {user} is not an approver of {ctx.state.agent or 'this run'}"
            f"'s bot: it may not decide call {msg.call_id!r}"
        )
        outcome = DecisionOutcome(call_id=msg.call_id, outcome="forbidden", detail=detail)
    who, via = author(msg)
    if outcome.outcome == "applied":
        kill_point("decision.received")
        ctx.emit(
            ApprovalDecided(
                call_id=msg.call_id,
                approved=msg.approved,
                who=who,
                reason=msg.reason,
                channel=via,
                at=time.time(),
                by=msg.by,
            )
        )
        ctx.send(ctx.actor_id, Continue())
    elif outcome.outcome != "repeated":
        _refused(ctx, msg, outcome)
    ctx.reply(outcome)
    return outcome.outcome == "applied"


def _refused(ctx: Context[RunState], msg: Decide, outcome: DecisionOutcome) -> None:
    """Record a refused decision: each of the first REFUSALS_RECORDED in a window, then one
    ``decision.refusals_muted``; the rest of the window's are answered, not recorded (a flood of
    bogus decisions must not grow the journal, nor the log, without bound)."""
    state, now = ctx.state, time.time()
    recorded = state.refusals if now - state.refusals_since < REFUSAL_WINDOW else 0
    if recorded > REFUSALS_RECORDED:
        log.debug("%s: decision refused (not recorded): %s", ctx.actor_id, outcome.detail)
        return
    if recorded == REFUSALS_RECORDED:
        until = state.refusals_since + REFUSAL_WINDOW
        log.warning(
            "%s: %d decisions refused since %s; more until %s are refused without a record",
            ctx.actor_id,
            recorded,
            time.strftime("%H:%M:%S", time.gmtime(state.refusals_since)),
            time.strftime("%H:%M:%S", time.gmtime(until)),
        )
        muted = DecisionsMuted(since=state.refusals_since, until=until, recorded=recorded, at=now)
        ctx.emit(muted)
        return
    log.warning("%s: decision refused: %s", ctx.actor_id, outcome.detail)
    who, via = author(msg)
    ctx.emit(
        DecisionRefused(
            call_id=msg.call_id,
            approved=msg.approved,
            who=who,
            reason=msg.reason,
            channel=via,
            outcome=outcome.outcome,
            at=now,
            by=msg.by,
        )
    )
