"""A run's state: the fold of its events, and what is read from it (receipt, summary, waiting
calls, what a decision would do)."""

from __future__ import annotations

from decimal import Decimal
from typing import Any

import attrs

from toren._actor import ActorFailed
from toren._model import Message, ModelResponse, Text, ToolCall, ToolResult
from toren.runs.events import (
    ApprovalDecided,
    ApprovalRequested,
    Decide,
    DecisionOutcome,
    MessageReceived,
    ModelCalled,
    ModelUnreadable,
    RunCompleted,
    RunFailed,
    RunResumed,
    RunRetried,
    RunRetrying,
    RunStarted,
    Status,
    StepsInvalidated,
    TimerFired,
    TimerSet,
    ToolIntended,
    ToolResulted,
)


@attrs.frozen(kw_only=True)
class RunState:
    """A run as its events make it."""

    agent: str = ""
    input: str = ""
    status: Status = "running"
    messages: tuple[Message, ...] = ()
    calls: tuple[ModelCalled, ...] = ()
    voided: tuple[ModelCalled, ...] = ()  # calls paid for, then invalidated
    heard: tuple[tuple[int, str], ...] = ()  # human messages: (calls recorded before it, text)
    intents: dict[str, ToolIntended] = attrs.field(factory=dict)
    results: dict[str, ToolResulted] = attrs.field(factory=dict)
    decisions: dict[str, ApprovalDecided] = attrs.field(factory=dict)
    asked: frozenset[str] = frozenset()
    replayed: int = 0
    inbox: tuple[str, ...] = ()  # human messages waiting for pending tool results
    failed_attempts: int = 0  # consecutive failed attempts at the current step
    tool_failures: int = 0  # consecutive model turns whose tool calls all failed
    unreadable: int = 0  # calls answered with something that could not be read (paid, unpriced)
    started_at: float = 0.0
    parked_since: float | None = None
    parked_seconds: float = 0.0  # time spent waiting on humans: not charged to the wall clock
    output: str | None = None
    error_class: str | None = None
    error: str | None = None

    @property
    def digest(self) -> str | None:
        """The chained digest of the last recorded call."""
        return self.calls[-1].digest if self.calls else None

    def working_seconds(self, now: float) -> float:
        """Time since the start, less the time parked on a human or a timer."""
        parked = self.parked_seconds + (now - self.parked_since if self.parked_since else 0.0)
        return now - self.started_at - parked

    @property
    def awaiting_model(self) -> bool:
        """The conversation ends with a user turn: the model speaks next."""
        return bool(self.messages) and self.messages[-1].role == "user"

    @property
    def pending_calls(self) -> list[ToolCall]:
        """Tool calls of the last response that have no result yet, in order."""
        if not self.calls:
            return []
        last = self.calls[-1].response
        return [b for b in last.content if isinstance(b, ToolCall) and b.id not in self.results]


def fold(state: RunState, event: Any) -> RunState:
    """The state after ``event``; pure, for replay."""
    if isinstance(event, RunStarted):
        first = Message(role="user", content=(Text(text=event.input),))
        return attrs.evolve(
            state, agent=event.agent, input=event.input, messages=(first,), started_at=event.at
        )
    if isinstance(event, ModelCalled):
        turn = Message(role="assistant", content=tuple(event.response.content))
        return attrs.evolve(
            state,
            calls=(*state.calls, event),
            messages=(*state.messages, turn),
            status="running",
            failed_attempts=0,
        )
    if isinstance(event, MessageReceived):
        state = attrs.evolve(state, heard=(*state.heard, (len(state.calls), event.text)))
        if state.pending_calls:
            return attrs.evolve(state, inbox=(*state.inbox, event.text))
        status: Status = "running" if state.status in ("completed", "running") else state.status
        return attrs.evolve(
            state,
            messages=_append_user(state.messages, Text(text=event.text)),
            status=status,
            output=None if status == "running" else state.output,
        )
    if isinstance(event, ModelUnreadable):
        return attrs.evolve(state, unreadable=state.unreadable + 1)
    if isinstance(event, StepsInvalidated):
        return _invalidate(state, event.from_step)
    if isinstance(event, RunRetrying):
        return attrs.evolve(state, failed_attempts=event.attempt)
    if isinstance(event, RunRetried):
        waits = bool(_waiting_ids(state))
        return attrs.evolve(
            state,
            status="parked" if waits else "running",
            parked_since=event.at if waits else None,
            error_class=None,
            error=None,
            failed_attempts=0,
            tool_failures=0,
        )
    if isinstance(event, ToolIntended):
        return attrs.evolve(state, intents={**state.intents, event.call_id: event})
    if isinstance(event, ToolResulted):
        result = ToolResult(
            tool_call_id=event.call_id, content=event.content, is_error=event.is_error
        )
        after = attrs.evolve(
            state,
            results={**state.results, event.call_id: event},
            messages=_append_user(state.messages, result),
            status="running",
        )
        if not after.pending_calls:
            after = attrs.evolve(after, tool_failures=_tool_failures(after))
        if after.inbox and not after.pending_calls:
            # Human messages that arrived while tools ran join the turn of their results.
            messages = after.messages
            for text in after.inbox:
                messages = _append_user(messages, Text(text=text))
            after = attrs.evolve(after, messages=messages, inbox=())
        return after
    if isinstance(event, TimerSet):
        return attrs.evolve(state, status="parked", parked_since=event.at)
    if isinstance(event, TimerFired):
        waited = event.at - state.parked_since if state.parked_since is not None else 0.0
        return attrs.evolve(
            state,
            status="running",
            parked_since=None,
            parked_seconds=state.parked_seconds + max(0.0, waited),
        )
    if isinstance(event, ApprovalRequested):
        return attrs.evolve(
            state, asked=state.asked | {event.call_id}, status="parked", parked_since=event.at
        )
    if isinstance(event, ApprovalDecided):
        waited = event.at - state.parked_since if state.parked_since is not None else 0.0
        return attrs.evolve(
            state,
            decisions={**state.decisions, event.call_id: event},
            status="running",
            parked_since=None,
            parked_seconds=state.parked_seconds + max(0.0, waited),
        )
    if isinstance(event, RunResumed):
        return attrs.evolve(state, replayed=max(state.replayed, event.replayed))
    if isinstance(event, RunCompleted):
        return attrs.evolve(state, status="completed", output=event.output)
    if isinstance(event, RunFailed):
        return attrs.evolve(
            state, status="failed", error_class=event.error_class, error=event.message
        )
    if isinstance(event, ActorFailed):  # the kernel gave up on the run (restart intensity)
        return attrs.evolve(
            state, status="failed", error_class=event.error_class, error=event.error
        )
    return state


def _tool_failures(state: RunState) -> int:
    """The count of consecutive failed tool turns once the last turn's results are all in: one
    more if every call of the turn failed (a denial is not a failure), else none."""
    calls = state.calls[-1].response.tool_calls if state.calls else []
    results = [state.results.get(c.id) for c in calls]
    failed = bool(results) and all(r is not None and r.is_error and not r.denied for r in results)
    return state.tool_failures + 1 if failed else 0


def _invalidate(state: RunState, from_step: int) -> RunState:
    """Void calls ``from_step`` on: the conversation goes back to what call ``from_step`` was
    sent, their tool calls are forgotten, and human messages heard since are applied again."""
    kept, void = state.calls[: from_step - 1], state.calls[from_step - 1 :]
    if not void:
        return state
    void_ids = {c.id for call in void for c in call.response.tool_calls}
    messages = state.messages[: void[0].messages_len]
    for before, text in state.heard:
        if before >= from_step:  # heard after the first void call: not in its request
            messages = _append_user(messages, Text(text=text))
    return attrs.evolve(
        state,
        calls=kept,
        voided=(*state.voided, *void),
        messages=messages,
        intents={k: v for k, v in state.intents.items() if k not in void_ids},
        results={k: v for k, v in state.results.items() if k not in void_ids},
        decisions={k: v for k, v in state.decisions.items() if k not in void_ids},
        asked=frozenset(a for a in state.asked if a not in void_ids),
        inbox=(),
        replayed=min(state.replayed, len(kept)),
        status="running",
    )


def _append_user(messages: tuple[Message, ...], block: Text | ToolResult) -> tuple[Message, ...]:
    """Add to the trailing user turn (tool results of one assistant turn travel together, and
    turns alternate), or start one."""
    if messages and messages[-1].role == "user":
        last = messages[-1]
        return (*messages[:-1], Message(role="user", content=(*last.content, block)))
    return (*messages, Message(role="user", content=(block,)))


@attrs.frozen(kw_only=True)
class Receipt:
    """What a run cost: calls made and replayed, tokens, dollars paid and not re-paid."""

    calls_made: int
    calls_replayed: int
    input_tokens: int
    output_tokens: int
    usd_paid: Decimal
    usd_not_repaid: Decimal
    unpriced_calls: int


def receipt(state: RunState) -> Receipt:
    """The receipt of a run as recorded so far."""
    paid = Decimal(0)
    unpriced = 0
    every = (*state.voided, *state.calls)
    for call in every:
        if call.cost_usd is None:
            unpriced += 1
        else:
            paid += Decimal(call.cost_usd)
    not_repaid = sum(
        (Decimal(c.cost_usd) for c in state.calls[: state.replayed] if c.cost_usd is not None),
        Decimal(0),
    )
    return Receipt(
        calls_made=len(every) + state.unreadable,
        calls_replayed=state.replayed,
        input_tokens=sum(c.response.usage.input_tokens for c in every),
        output_tokens=sum(c.response.usage.output_tokens for c in every),
        usd_paid=paid,
        usd_not_repaid=not_repaid,
        unpriced_calls=unpriced + state.unreadable,
    )


def _waiting_ids(state: RunState) -> set[str]:
    return set(state.asked - state.decisions.keys())


def waiting_on(state: RunState) -> list[ToolCall]:
    """The tool calls the run waits for a decision on (the model's request for each); none
    once the run has ended (a decision can no longer be applied)."""
    if state.status in ("completed", "failed"):
        return []
    waiting = _waiting_ids(state)
    return [
        block
        for call in state.calls
        for block in call.response.content
        if isinstance(block, ToolCall) and block.id in waiting
    ]


def judge_decision(state: RunState, decision: Decide) -> DecisionOutcome:
    """What a run in ``state`` does with ``decision``: apply it only to the call it names, and
    only while that call waits; a repeat of the decision already made is answered as such."""
    waiting = tuple(c.id for c in waiting_on(state))
    call_id = decision.call_id
    done_verb = "approved" if decision.approved else "denied"
    done = state.decisions.get(call_id)
    if done is not None:
        how = "approved" if done.approved else "denied"
        if done.approved == decision.approved:
            detail = f"call {call_id} was already {how} by {done.who}"
            return DecisionOutcome(call_id=call_id, outcome="repeated", detail=detail)
        detail = f"call {call_id} was already {how} by {done.who}; it cannot be {done_verb} now"
        return DecisionOutcome(call_id=call_id, outcome="conflict", detail=detail, waiting=waiting)
    if call_id in waiting:
        detail = f"{done_verb} call {call_id}"
        return DecisionOutcome(call_id=call_id, outcome="applied", detail=detail)
    if not call_id:
        what = "a decision must name the call it decides"
    else:
        what = f"the run is not waiting for a decision on call {call_id!r}"
    if waiting:
        names = {c.id: c.name for c in waiting_on(state)}
        what += "; it waits for " + ", ".join(f"{names[c]} (call {c})" for c in waiting)
    else:
        what += f"; it waits for no decision (status {state.status})"
    return DecisionOutcome(call_id=call_id, outcome="not_waiting", detail=what, waiting=waiting)


def summary(state: RunState) -> dict[str, Any]:
    """What lists show of a run without folding its journal (kept on its actor row)."""
    r = receipt(state)
    return {
        "agent": state.agent,
        "status": state.status,
        "input": state.input[:200],
        "calls_made": r.calls_made,
        "calls_replayed": r.calls_replayed,
        "usd_paid": str(r.usd_paid),
        "waiting_on": []
        if state.status in ("completed", "failed")
        else sorted(_waiting_ids(state)),
        "error_class": state.error_class,
    }


def final_text(response: ModelResponse) -> str:
    """The text of a final response."""
    return "".join(b.text for b in response.content if isinstance(b, Text))
