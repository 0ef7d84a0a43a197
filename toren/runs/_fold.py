"""The fold of a run's events: :func:`fold` finds the handler of each event by its class in one
table, and each handler says what its event does to a :class:`~toren.runs.state.RunState`.

Every handler is pure and returns a new state made with ``attrs.evolve`` (the state's sequences
and maps are persistent, so no handler copies what the run accumulated). An event with no handler
(one kept for the timeline only, such as ``sandbox.noted``) leaves the state as it is.
"""

from __future__ import annotations

import hashlib
import types
from collections.abc import Callable, Mapping
from decimal import Decimal
from typing import TYPE_CHECKING, Any, TypeAlias, TypeVar

import attrs
from pyrsistent import PMap, pset, pvector

from toren._agent.model import Message, Text, ToolResult
from toren._core.actor import ActorFailed
from toren._core.history import History, Ledger
from toren._core.json_text import dumps
from toren.runs.events import (
    ENDED,
    REFUSAL_WINDOW,
    ApprovalDecided,
    ApprovalRequested,
    CalleesDescribed,
    ChildFinished,
    ChildStarted,
    ContextCompacted,
    DecisionRefused,
    DecisionsMuted,
    MessageReceived,
    ModelCalled,
    ModelCalling,
    ModelLost,
    ModelUnreadable,
    RunCompleted,
    RunFailed,
    RunResumed,
    RunRetried,
    RunRetrying,
    RunStarted,
    SandboxFailed,
    SandboxRequested,
    Status,
    StepsInvalidated,
    TimerFired,
    TimerSet,
    ToolIntended,
    ToolResulted,
)
from toren.runs.fork_events import RunForked, forked
from toren.runs.rate_events import RateWaited
from toren.runs.release_events import HistoryReleased, released
from toren.runs.version_events import RunUpgraded

if TYPE_CHECKING:
    from toren.runs.state import RunState

E = TypeVar("E")
Handler: TypeAlias = "Callable[[RunState, Any], RunState]"


def fold(state: RunState, event: Any) -> RunState:
    """The state after ``event``; pure, for replay."""
    handle = _HANDLERS.get(type(event))
    if handle is None:
        handle = _inherited(type(event))
        if handle is None:
            return state
    return handle(state, event)


def _inherited(kind: type) -> Handler | None:
    """The handler of the nearest class ``kind`` derives from that has one (an instance of a
    subclass of an event folds as that event)."""
    for base in kind.__mro__[1:]:
        handle = _HANDLERS.get(base)
        if handle is not None:
            return handle
    return None


# --- the run's course ------------------------------------------------------------------------


def _started(state: RunState, event: RunStarted) -> RunState:
    first = Message(role="user", content=(Text(text=event.input),))
    return attrs.evolve(
        state,
        agent=event.agent,
        input=event.input,
        messages=History([first]),
        started_at=event.at,
        parent=event.parent,
        parent_call=event.parent_call,
        watcher=event.watcher,
        chain=tuple(event.chain),
        depth_limit=event.depth_limit,
        budget_cap=Decimal(event.budget_usd) if event.budget_usd is not None else None,
        version=event.version,
    )


def _upgraded(state: RunState, event: RunUpgraded) -> RunState:
    # Taken by value: the calls so far are never checked (nor paid) again.
    settled = len(state.calls) if event.how == "value" else state.settled_calls
    return attrs.evolve(state, version=event.to_version, settled_calls=settled)


def _message_received(state: RunState, event: MessageReceived) -> RunState:
    state = attrs.evolve(state, heard=state.heard.append((len(state.calls), event.text)))
    if state.pending_calls:
        return attrs.evolve(state, inbox=state.inbox.append(event.text))
    status: Status = "running" if state.status in ("completed", "running") else state.status
    if state.status == "completed":  # the wait since the turn ended was not work
        waited = event.at - state.parked_since if event.at and state.parked_since else 0.0
        state = attrs.evolve(
            state, parked_since=None, parked_seconds=state.parked_seconds + max(0.0, waited)
        )
    return attrs.evolve(
        state,
        messages=_append_user(state.messages, Text(text=event.text)),
        status=status,
        output=None if status == "running" else state.output,
    )


def _steps_invalidated(state: RunState, event: StepsInvalidated) -> RunState:
    return _invalidate(state, event.from_step)


def _retrying(state: RunState, event: RunRetrying) -> RunState:
    # the call was answered, with a failure
    return attrs.evolve(state, failed_attempts=event.attempt, calling=None)


def _retried(state: RunState, event: RunRetried) -> RunState:
    waits = bool(waiting_ids(state)) or bool(state.running)  # a human, or a child run
    return attrs.evolve(
        state,
        retries=state.retries + 1,
        status="parked" if waits else "running",
        parked_since=event.at if waits else None,
        error_class=None,
        error=None,
        failed_attempts=0,
        tool_failures=0,
        # A call sent to the sandbox is sent again: the sandbox answers from its journal
        # if the call ran (it never runs a call twice).
        sandbox_waiting=pset(),
    )


def _resumed(state: RunState, event: RunResumed) -> RunState:
    state = attrs.evolve(
        state,
        replayed=max(state.replayed, event.replayed),
        compactions_replayed=len(state.compactions),
    )
    if event.checked_as:
        state = attrs.evolve(state, checked_as=event.checked_as, checked_calls=len(state.calls))
    return state


def _completed(state: RunState, event: RunCompleted) -> RunState:
    # Until someone writes again, the run waits on a human (see MessageReceived).
    since = event.at if event.at else state.parked_since
    return attrs.evolve(
        state, status="completed", output=event.output, calling=None, parked_since=since
    )


def _failed(state: RunState, event: RunFailed) -> RunState:
    cancelled = event.error_class == "cancelled"
    return attrs.evolve(
        state,
        status="cancelled" if cancelled else "failed",
        error_class=event.error_class,
        error=event.message,
        # A cancel comes from outside the steps, possibly while the step that makes the
        # announced call was in flight with a worker that died: kept, so that step, claimed
        # again, counts the call as lost (a cancelled run is never retried).
        calling=state.calling if cancelled else None,
    )


def _given_up(state: RunState, event: ActorFailed) -> RunState:
    # the kernel gave up on the run (restart intensity)
    return attrs.evolve(
        state,
        status="failed",
        error_class=event.error_class,
        error=event.error,
        calling=None,
    )


# --- model calls -----------------------------------------------------------------------------


def _model_called(state: RunState, event: ModelCalled) -> RunState:
    turn = Message(role="assistant", content=tuple(event.response.content))
    cost = Decimal(event.cost_usd) if event.cost_usd is not None else Decimal(0)
    before = state.kept_cost[-1] if state.kept_cost else Decimal(0)
    usage = event.response.usage
    checked = state.checked_calls
    if event.checked_as and event.checked_as == state.checked_as and checked == len(state.calls):
        checked += 1  # made by code with the parameters the calls before it were checked for
    return attrs.evolve(
        state,
        calls=state.calls.append(event),
        tool_ids=state.tool_ids.update(c.id for c in event.response.tool_calls),
        checked_calls=checked,
        messages=state.messages.append(turn),
        status="running",
        failed_attempts=0,
        usd_paid=state.usd_paid + cost,
        unpriced=state.unpriced + (event.cost_usd is None),
        input_tokens=state.input_tokens + usage.input_tokens,
        output_tokens=state.output_tokens + usage.output_tokens,
        kept_cost=state.kept_cost.append(before + cost),
        calling=None,
    )


def _model_calling(state: RunState, event: ModelCalling) -> RunState:
    return attrs.evolve(state, calling=event, rate_wait=None)


def _rate_waited(state: RunState, event: RateWaited) -> RunState:
    return attrs.evolve(state, rate_wait=event)


def _model_lost(state: RunState, event: ModelLost) -> RunState:
    return attrs.evolve(
        state,
        lost_calls=state.lost_calls + max(0, event.count),
        lost_usd=state.lost_usd + max(Decimal(0), _decimal(event.cost_usd)),
        # a live run makes the call again (it stays announced); an ended one does not
        calling=None if state.status in ENDED else state.calling,
    )


def _model_unreadable(state: RunState, event: ModelUnreadable) -> RunState:
    return attrs.evolve(state, unreadable=state.unreadable + 1, calling=None)


# --- tool calls, decisions, timers and the sandbox -------------------------------------------


def _tool_intended(state: RunState, event: ToolIntended) -> RunState:
    occurrences = state.occurrences
    earlier = state.intents.get(event.call_id)
    if earlier is not None:  # not recorded by Toren, but a fold must not miscount
        occurrences = _count(occurrences, occurrence_key(earlier.name, earlier.arguments), -1)
    occurrences = _count(occurrences, occurrence_key(event.name, event.arguments), 1)
    return attrs.evolve(
        state, intents=state.intents.set(event.call_id, event), occurrences=occurrences
    )


def _tool_resulted(state: RunState, event: ToolResulted) -> RunState:
    result = ToolResult(tool_call_id=event.call_id, content=event.content, is_error=event.is_error)
    after = attrs.evolve(
        state,
        results=state.results.set(event.call_id, event),
        messages=_append_user(state.messages, result),
        status="running",
        sandbox_waiting=state.sandbox_waiting.discard(event.call_id),
    )
    if not after.pending_calls:
        after = attrs.evolve(after, tool_failures=_tool_failures(after))
    if after.inbox and not after.pending_calls:
        # Human messages that arrived while tools ran join the turn of their results.
        messages = after.messages
        for text in after.inbox:
            messages = _append_user(messages, Text(text=text))
        after = attrs.evolve(after, messages=messages, inbox=pvector())
    return after


def _approval_requested(state: RunState, event: ApprovalRequested) -> RunState:
    return attrs.evolve(
        state, asked=state.asked.add(event.call_id), status="parked", parked_since=event.at
    )


def _approval_decided(state: RunState, event: ApprovalDecided) -> RunState:
    return _unparked(state, event.at, decisions=state.decisions.set(event.call_id, event))


def _refused(state: RunState, event: DecisionRefused | DecisionsMuted) -> RunState:
    if event.at - state.refusals_since >= REFUSAL_WINDOW:
        return attrs.evolve(state, refusals_since=event.at, refusals=1)
    return attrs.evolve(state, refusals=state.refusals + 1)


def _timer_set(state: RunState, event: TimerSet) -> RunState:
    return attrs.evolve(state, status="parked", parked_since=event.at)


def _timer_fired(state: RunState, event: TimerFired) -> RunState:
    return _unparked(state, event.at)


def _sandbox_requested(state: RunState, event: SandboxRequested) -> RunState:
    return attrs.evolve(
        state,
        sandbox=event.sandbox,
        sandbox_waiting=state.sandbox_waiting.add(event.call_id),
    )


def _sandbox_failed(state: RunState, event: SandboxFailed) -> RunState:
    return attrs.evolve(state, sandbox_failed=event.error)


# --- cross-agent calls -----------------------------------------------------------------------


def _callees_described(state: RunState, event: CalleesDescribed) -> RunState:
    return attrs.evolve(state, callees=state.callees.update(event.descriptions))


def _child_started(state: RunState, event: ChildStarted) -> RunState:
    return attrs.evolve(
        state,
        children=state.children.set(event.call_id, event),
        running=state.running.set(event.run_id, event),
        status="parked",
        parked_since=event.at,
    )


def _child_finished(state: RunState, event: ChildFinished) -> RunState:
    if event.status == "failed" and event.error_class == "cancelled":
        # Recorded before a cancelled run had a status of its own: read as today's.
        event = attrs.evolve(event, status="cancelled")
    state = attrs.evolve(
        state,
        finished=state.finished.set(event.run_id, event),
        running=state.running.discard(event.run_id),
        child_runs=state.child_runs + 1,
        child_calls=state.child_calls + event.calls_made,
        child_usd=state.child_usd + Decimal(event.usd_paid),
        child_input_tokens=state.child_input_tokens + event.input_tokens,
        child_output_tokens=state.child_output_tokens + event.output_tokens,
        child_unpriced=state.child_unpriced + event.unpriced_calls,
        child_lost_calls=state.child_lost_calls + max(0, event.lost_calls),
        child_lost_usd=state.child_lost_usd + max(Decimal(0), _decimal(event.lost_usd)),
    )
    if state.status == "parked" and not waiting_ids(state) and not state.running:
        state = _unparked(state, event.at)
    return state


# --- what the handlers share -----------------------------------------------------------------


def _unparked(state: RunState, at: float, **changes: Any) -> RunState:
    """Running again at ``at``, the wait since the run parked not counted as work; with
    ``changes`` made in the same step."""
    waited = at - state.parked_since if state.parked_since is not None else 0.0
    return attrs.evolve(
        state,
        **changes,
        status="running",
        parked_since=None,
        parked_seconds=state.parked_seconds + max(0.0, waited),
    )


def _decimal(text: str | None) -> Decimal:
    """A recorded amount (decimal as text); nothing for an unpriced one, or one that is not a
    finite number (a fold never fails on an amount)."""
    try:
        value = Decimal(text) if text is not None else Decimal(0)
    except ArithmeticError:
        return Decimal(0)
    return value if value.is_finite() else Decimal(0)


def _tool_failures(state: RunState) -> int:
    """The count of consecutive failed tool turns once the last turn's results are all in: one
    more if every call of the turn failed (a denial is not a failure), else none."""
    calls = state.calls[-1].response.tool_calls if state.calls else []
    results = [state.results.get(c.id) for c in calls]
    failed = bool(results) and all(r is not None and r.is_error and not r.denied for r in results)
    return state.tool_failures + 1 if failed else 0


def _compacted(state: RunState, event: ContextCompacted) -> RunState:
    """The state after a compaction: in effect from now on, its summary call (if any) paid."""
    paid = event.summary is not None
    cost = Decimal(event.cost_usd) if event.cost_usd is not None else Decimal(0)
    before = state.compaction_cost[-1] if state.compaction_cost else Decimal(0)
    used = event.summary.usage if event.summary is not None else None
    return attrs.evolve(
        state,
        compactions=state.compactions.append(event),
        compaction_cost=state.compaction_cost.append(before + cost),
        summary_calls=state.summary_calls + paid,
        usd_paid=state.usd_paid + cost,
        unpriced=state.unpriced + (paid and event.cost_usd is None),
        input_tokens=state.input_tokens + (used.input_tokens if used else 0),
        output_tokens=state.output_tokens + (used.output_tokens if used else 0),
        compactions_soft=state.compactions_soft + (event.tier == "soft"),
        compactions_hard=state.compactions_hard + (event.tier == "hard"),
        tokens_saved=state.tokens_saved + max(0, event.tokens_before - event.tokens_after),
        failed_attempts=0 if paid else state.failed_attempts,
        calling=None if paid else state.calling,  # a summary call answers the one announced
    )


def _invalidate(state: RunState, from_step: int) -> RunState:
    """Void calls ``from_step`` on: the conversation goes back to what call ``from_step`` was
    sent, their tool calls are forgotten, and human messages heard since are applied again."""
    kept, void = state.calls[: from_step - 1], state.calls[from_step - 1 :]
    if not void:
        return state
    void_ids = {c.id for call in void for c in call.response.tool_calls}
    occurrences = state.occurrences
    for call_id in void_ids:
        intent = state.intents.get(call_id)
        if intent is not None:
            occurrences = _count(occurrences, occurrence_key(intent.name, intent.arguments), -1)
    messages = state.messages[: void[0].messages_len]
    # Compactions made once the kept calls were made stay (the first void call was sent with
    # them); later ones go (what they paid stays in the totals).
    compactions = len(state.compactions)
    while compactions > state.compactions.released and state.compactions[
        compactions - 1
    ].after_calls > len(kept):
        compactions -= 1
    for before, text in state.heard:
        if before >= from_step:  # heard after the first void call: not in its request
            messages = _append_user(messages, Text(text=text))
    return attrs.evolve(
        state,
        calls=kept,
        voided=state.voided.extend(void),
        messages=messages,
        intents=_without(state.intents, void_ids),
        occurrences=occurrences,
        checked_calls=min(state.checked_calls, len(kept)),
        results=_without(state.results, void_ids),
        decisions=_without(state.decisions, void_ids),
        asked=state.asked.difference(void_ids),
        inbox=pvector(),
        kept_cost=state.kept_cost[: len(kept)],
        replayed=min(state.replayed, len(kept)),
        compactions=state.compactions[:compactions],
        compaction_cost=state.compaction_cost[:compactions],
        compactions_replayed=min(state.compactions_replayed, compactions),
        status="running",
    )


def canonical(arguments: Any) -> str:
    """Recorded (JSON-form) arguments as canonical JSON: what keys and counts compare."""
    return dumps(arguments, sort_keys=True)


def occurrence_key(name: str, arguments: Any) -> str:
    """What identical tool calls share: the tool and its canonical arguments (hashed)."""
    h = hashlib.sha256(f"{name}\0".encode("utf-8", "surrogatepass"))
    h.update(canonical(arguments).encode("utf-8", "surrogatepass"))
    return h.hexdigest()[:32]


def _count(counts: PMap[str, int], key: str, by: int) -> PMap[str, int]:
    n = counts.get(key, 0) + by
    return counts.set(key, n) if n > 0 else counts.discard(key)


def _without(items: Any, keys: set[str]) -> Any:
    """``items`` (a map, a Ledger) without ``keys``."""
    if isinstance(items, Ledger):
        return items.without(keys)
    drop = items.evolver()
    for key in keys:
        if key in items:
            del drop[key]
    return drop.persistent()


def _append_user(messages: History[Message], block: Text | ToolResult) -> History[Message]:
    """Add to the trailing user turn (tool results of one assistant turn travel together, and
    turns alternate), or start one."""
    if messages and messages[-1].role == "user":
        last = messages[-1]
        return messages.set(-1, Message(role="user", content=(*last.content, block)))
    return messages.append(Message(role="user", content=(block,)))


def waiting_ids(state: RunState) -> set[str]:
    """The calls asked about that wait for a decision."""
    return {a for a in state.asked if a not in state.decisions}


def _on(kind: type[E], handle: Callable[[RunState, E], RunState]) -> tuple[type, Handler]:
    """A row of the table: events of ``kind`` go to ``handle`` (typed so that they match)."""
    return kind, handle


_HANDLERS: Mapping[type, Handler] = types.MappingProxyType(
    dict(
        [
            _on(RunStarted, _started),
            _on(RunUpgraded, _upgraded),
            _on(RunForked, forked),
            _on(HistoryReleased, released),
            _on(ModelCalled, _model_called),
            _on(ModelCalling, _model_calling),
            _on(ModelLost, _model_lost),
            _on(RateWaited, _rate_waited),
            _on(MessageReceived, _message_received),
            _on(ModelUnreadable, _model_unreadable),
            _on(ContextCompacted, _compacted),
            _on(StepsInvalidated, _steps_invalidated),
            _on(RunRetrying, _retrying),
            _on(RunRetried, _retried),
            _on(ToolIntended, _tool_intended),
            _on(ToolResulted, _tool_resulted),
            _on(TimerSet, _timer_set),
            _on(TimerFired, _timer_fired),
            _on(ApprovalRequested, _approval_requested),
            _on(ApprovalDecided, _approval_decided),
            _on(SandboxRequested, _sandbox_requested),
            _on(SandboxFailed, _sandbox_failed),
            _on(CalleesDescribed, _callees_described),
            _on(ChildStarted, _child_started),
            _on(ChildFinished, _child_finished),
            _on(DecisionRefused, _refused),
            _on(DecisionsMuted, _refused),
            _on(RunResumed, _resumed),
            _on(RunCompleted, _completed),
            _on(RunFailed, _failed),
            _on(ActorFailed, _given_up),
        ]
    )
)
"""Each event class the fold reads, and its handler."""
