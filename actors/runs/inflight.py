"""Model calls in flight: announced before they are made, counted when they are lost.

A run's model call is made by a step of its own (one handled ``Continue``), and its result is
committed with that step. A worker that dies (or is cut from the database, or outlives its
lease) while the request is at the provider leaves nothing in the journal: the call is made
again on resume, as it must be, and the provider has been asked twice.

So the call a step is about to make is announced (``model.calling``) in the commit that
precedes it, the commit of the step before: no write of its own, no round trip. The step that
makes the call finds the announcement unanswered, as it always does; if its message was also
claimed before (its ``deliveries``: a claim that never committed), each earlier claim may have
sent the request, and the step records them as lost in flight (``model.lost``) before making the
call again. The receipt counts them apart from the calls made, with their estimated cost.

The count is exact when a worker stopped with the request sent or answered; a worker that
stopped between the commit that announced the call and the send (a moment: the commit, the claim
of the step's message, the build of the request) is counted too, with nothing received. Either
way, the receipt never shows fewer requests than the provider received.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from decimal import Decimal

from toren import Context
from toren.providers import parse_model, price
from toren.runs import (
    Agent,
    Message,
    ModelCalling,
    ModelLost,
    ModelRequest,
    RunState,
    Usage,
    context_messages,
    estimate_tokens,
)

log = logging.getLogger("toren.run")

Build = Callable[[Agent, Iterable[Message]], ModelRequest]


def announce(ctx: Context[RunState], agent: Agent | None, build: Build) -> None:
    """At the end of a step: if the run's next step is a model call not announced yet, announce
    it in this step's commit, with its estimated input tokens and their cost."""
    state = ctx.state
    if agent is None or not calls_next(state):
        return
    tokens = estimated_input(state, agent, build)
    cost = _input_price(agent.model, tokens)
    ctx.emit(
        ModelCalling(
            step=len(state.calls) + 1,
            model=agent.model,
            input_tokens=tokens,
            cost_usd=str(cost) if cost is not None else None,
        )
    )


def calls_next(state: RunState) -> bool:
    """Whether the run's next step is a model call not announced yet."""
    return (
        state.status == "running"
        and state.calling is None
        and state.awaiting_model
        and not state.pending_calls
    )


def note_lost(ctx: Context[RunState], *, handled: bool = False) -> None:
    """At the start of a step that goes on with the run (or of the one that gives it up): the
    announced call is unanswered, and the message in hand was claimed before without a commit,
    so each earlier claim may have sent the request. Record them as lost in flight (they commit
    with this step). ``handled``: this claim was handled too and never committed (a message
    dead-lettered after its handler or its commit failed), so it counts as well."""
    calling = ctx.state.calling
    envelope = ctx.envelope
    if calling is None or envelope is None:
        return
    count = envelope.deliveries - (0 if handled else 1)
    if count <= 0:
        return
    each = _amount(calling.cost_usd)
    cost = each * count if each is not None else None
    log.warning(
        "%s: model call %d (%s) was in flight when its worker stopped (%d time(s)); it may "
        "have been billed; it is made again",
        ctx.actor_id,
        calling.step,
        calling.model,
        count,
    )
    ctx.emit(
        ModelLost(
            step=calling.step,
            model=calling.model,
            count=count,
            input_tokens=calling.input_tokens,
            cost_usd=str(cost) if cost is not None else None,
        )
    )


def estimated_input(state: RunState, agent: Agent, build: Build) -> int:
    """The input tokens of the next request, estimated: the last call's as the provider reported
    them, its answer, and an estimate of what was added since (or a compaction's estimate of the
    request after it); the whole request estimated when there is no call to go from. Costs what
    was added since the last call, not the conversation."""
    calls = state.calls
    if calls:
        last = calls[-1]
        latest = state.compactions[-1] if state.compactions else None
        if latest is not None and latest.after_calls >= len(calls):
            return latest.tokens_after
        usage = last.response.usage
        if usage.input_tokens > 0:
            messages = state.messages
            added = [messages[i] for i in range(last.messages_len + 1, len(messages))]
            return usage.input_tokens + usage.output_tokens + estimate_tokens(added)
    return estimate_tokens(build(agent, context_messages(state)))


def _amount(text: str | None) -> Decimal | None:
    """A recorded estimate, if it is a price (an announcement in a journal is not trusted: one
    that is not a finite, non-negative number is unpriced, and never stops the run)."""
    try:
        value = Decimal(text) if text is not None else None
    except ArithmeticError:
        return None
    return value if value is not None and value.is_finite() and value >= 0 else None


def _input_price(model: str, tokens: int) -> Decimal | None:
    """What ``tokens`` input tokens cost at ``model``'s price; ``None``: unpriced."""
    try:
        provider, model_id = parse_model(model)
        return price(provider, model_id, Usage(input_tokens=tokens, output_tokens=0))
    except Exception:  # an estimate never stops a run
        log.debug("could not price an estimate for %s", model, exc_info=True)
        return None
