"""Agent runs as data: the messages a run receives, the events it records, and their fold.

Public, because the run actor, the CLI and the API all build on it.

A run is an actor (``run/<uuid>``, kind ``toren.run``) whose journal is the record of what the
agent did: every model call with its response, usage and cost, every tool call's intent and
result, every approval asked and given. Its state is the fold of those events (:func:`fold`), so
anything that can read the journal (the CLI, the API) sees the same run the worker sees, and a
resumed run rebuilds it without calling anything again.

The event format is versioned: every event carries ``v`` (1 today). A later version adds events
or fields with defaults; recorded journals of every earlier version are kept as test fixtures.
"""

from __future__ import annotations

import uuid
from decimal import Decimal
from typing import TYPE_CHECKING, Any, Literal

import attrs

from toren._agents import Agent, Tool, ToolContext, agent_named, agent_route, served_routes
from toren._codec import decode, message
from toren._digest import GENESIS, chain
from toren._errors import TorenError, UnknownActor
from toren._model import Message, ModelRequest, ModelResponse, Text, ToolCall, ToolResult, ToolSpec

__all__ = [
    "FORMAT",
    "GENESIS",
    "RUN_KIND",
    "Agent",
    "ApprovalDecided",
    "ApprovalRequested",
    "Cancel",
    "Continue",
    "Decide",
    "IdempotencyConflict",
    "Message",
    "MessageReceived",
    "ModelCalled",
    "ModelRequest",
    "Receipt",
    "Retry",
    "RunCompleted",
    "RunFailed",
    "RunResumed",
    "RunRetried",
    "RunRetrying",
    "RunStarted",
    "RunState",
    "Say",
    "StartRun",
    "StepsInvalidated",
    "TimerFired",
    "TimerSet",
    "Tool",
    "ToolContext",
    "ToolIntended",
    "ToolResulted",
    "ToolSpec",
    "Wake",
    "agent_named",
    "agent_route",
    "cancel",
    "chain",
    "decide",
    "final_text",
    "fold",
    "read_run",
    "receipt",
    "retry",
    "say",
    "served_routes",
    "start_run",
]

if TYPE_CHECKING:
    from toren._client import Client

RUN_KIND = "toren.run"
FORMAT = 1

Status = Literal["running", "parked", "completed", "failed"]
ErrorClass = Literal[
    "provider", "attempts", "timeout", "budget", "tool", "cancelled", "crashloop", "config"
]

# --- messages a run receives ----------------------------------------------------------------


@message("run.start")
@attrs.frozen(kw_only=True)
class StartRun:
    """Begin the run (sent with the spawn)."""

    agent: str
    input: str


@message("run.continue")
@attrs.frozen
class Continue:
    """Do the next unit of work (a model call, a tool intent, a tool execution)."""


@message("run.decide")
@attrs.frozen(kw_only=True)
class Decide:
    """A human's decision on a parked tool call."""

    approved: bool
    who: str
    reason: str = ""
    channel: str = "cli"


@message("run.wake")
@attrs.frozen(kw_only=True)
class Wake:
    """A durable timer set by the sleep tool fired."""

    call_id: str


@message("run.say")
@attrs.frozen(kw_only=True)
class Say:
    """A human message to the run: applied at the next step boundary; to a completed run, it
    continues the conversation."""

    text: str
    who: str
    channel: str = "cli"


@message("run.cancel")
@attrs.frozen(kw_only=True)
class Cancel:
    who: str
    reason: str = ""


@message("run.retry")
@attrs.frozen(kw_only=True)
class Retry:
    """Resume a failed run from its last good step; completed calls are not paid again."""

    who: str


# --- events a run records -------------------------------------------------------------------


@message("run.started")
@attrs.frozen(kw_only=True)
class RunStarted:
    agent: str
    input: str
    at: float = 0.0  # when (unix seconds, the worker's clock)
    v: int = FORMAT


@message("model.called")
@attrs.frozen(kw_only=True)
class ModelCalled:
    """One completed model call, replayed by value on resume (never sent again)."""

    step: int
    digest: str
    model: str
    response: ModelResponse
    cost_usd: str | None  # decimal as text; None: the model has no known price
    latency_ms: int
    messages_len: int = 0  # how many conversation messages the request carried
    v: int = FORMAT


@message("steps.invalidated")
@attrs.frozen(kw_only=True)
class StepsInvalidated:
    """The request this code would make at ``from_step`` differs from the recorded one: that
    call and every later one are void and will be paid again. The journal keeps them."""

    from_step: int
    reason: str
    v: int = FORMAT


@message("tool.intent")
@attrs.frozen(kw_only=True)
class ToolIntended:
    """Committed before the tool runs; its key makes a re-run after a crash safe (keyed tools)."""

    call_id: str
    name: str
    arguments: dict[str, Any]
    idempotency_key: str
    v: int = FORMAT


@message("tool.result")
@attrs.frozen(kw_only=True)
class ToolResulted:
    call_id: str
    content: str
    is_error: bool = False
    v: int = FORMAT


@message("approval.requested")
@attrs.frozen(kw_only=True)
class ApprovalRequested:
    call_id: str
    name: str
    arguments: dict[str, Any]
    at: float = 0.0
    v: int = FORMAT


@message("approval.decided")
@attrs.frozen(kw_only=True)
class ApprovalDecided:
    call_id: str
    approved: bool
    who: str
    reason: str
    channel: str
    at: float = 0.0
    v: int = FORMAT


@message("message.received")
@attrs.frozen(kw_only=True)
class MessageReceived:
    text: str
    who: str
    channel: str
    v: int = FORMAT


@message("run.retrying")
@attrs.frozen(kw_only=True)
class RunRetrying:
    """A step failed in a way worth another attempt (after ``delay`` seconds)."""

    attempt: int
    error: str
    delay: float
    v: int = FORMAT


@message("run.retried")
@attrs.frozen(kw_only=True)
class RunRetried:
    """A failed run was resumed from its last good step."""

    who: str
    v: int = FORMAT


@message("timer.set")
@attrs.frozen(kw_only=True)
class TimerSet:
    """The run sleeps (the sleep tool): parked on a durable timer until ``at + seconds``."""

    call_id: str
    seconds: float
    at: float = 0.0
    v: int = FORMAT


@message("timer.fired")
@attrs.frozen(kw_only=True)
class TimerFired:
    call_id: str
    at: float = 0.0
    v: int = FORMAT


@message("run.resumed")
@attrs.frozen(kw_only=True)
class RunResumed:
    """The run went on from its journal; ``replayed`` calls were served from it, not re-sent."""

    replayed: int
    v: int = FORMAT


@message("run.completed")
@attrs.frozen(kw_only=True)
class RunCompleted:
    output: str
    v: int = FORMAT


@message("run.failed")
@attrs.frozen(kw_only=True)
class RunFailed:
    error_class: str
    message: str
    v: int = FORMAT


# --- state ----------------------------------------------------------------------------------


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
    if isinstance(event, StepsInvalidated):
        return _invalidate(state, event.from_step)
    if isinstance(event, RunRetrying):
        return attrs.evolve(state, failed_attempts=event.attempt)
    if isinstance(event, RunRetried):
        return attrs.evolve(
            state, status="running", error_class=None, error=None, failed_attempts=0
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
    return state


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
        calls_made=len(every),
        calls_replayed=state.replayed,
        input_tokens=sum(c.response.usage.input_tokens for c in every),
        output_tokens=sum(c.response.usage.output_tokens for c in every),
        usd_paid=paid,
        usd_not_repaid=not_repaid,
        unpriced_calls=unpriced,
    )


def waiting_on(state: RunState) -> list[ToolCall]:
    """The tool calls the run waits for a decision on (the model's request for each)."""
    waiting = state.asked - state.decisions.keys()
    return [
        block
        for call in state.calls
        for block in call.response.content
        if isinstance(block, ToolCall) and block.id in waiting
    ]


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
        "waiting_on": sorted(state.asked - state.decisions.keys()),
        "error_class": state.error_class,
    }


def final_text(response: ModelResponse) -> str:
    """The text of a final response."""
    return "".join(b.text for b in response.content if isinstance(b, Text))


# --- starting, steering and reading runs ----------------------------------------------------

_KEY_NAMESPACE = uuid.UUID("7c1f4f7e-3b0a-4f59-9a55-2f1c9b1d8e42")


class IdempotencyConflict(TorenError):
    """A run was started with a key that an earlier run with another input used."""

    def __init__(self, key: str, run_id: str) -> None:
        self.key = key
        self.run_id = run_id
        super().__init__(
            f"idempotency key {key!r} already started {run_id} with a different agent or input; "
            "use a new key for a new run"
        )


async def start_run(
    client: Client, agent: str, input: str, *, idempotency_key: str | None = None
) -> str:
    """Start a run of ``agent`` on ``input``; returns its id (``run/<uuid>``).

    With an ``idempotency_key``, starting again with the same key and input returns the same
    run; the same key with another agent or input raises :class:`IdempotencyConflict`.
    """
    run_uuid = uuid.uuid5(_KEY_NAMESPACE, idempotency_key) if idempotency_key else uuid.uuid4()
    run_id = f"run/{run_uuid}"
    created = await client.spawn(RUN_KIND, run_id, {"agent": agent}, route=agent_route(agent))
    if not created and idempotency_key is not None:
        started = await _started(client, run_id)
        pending = await client.pool.fetchval(
            "SELECT body FROM toren.mailbox WHERE actor_id = $1 AND kind = 'run.start'", run_id
        )
        existing = started or (StartRun(**pending) if pending else None)
        if existing is not None and (existing.agent, existing.input) != (agent, input):
            raise IdempotencyConflict(idempotency_key, run_id)
    await client.send(run_id, StartRun(agent=agent, input=input), dedupe_key="start")
    return run_id


async def _started(client: Client, run_id: str) -> RunStarted | None:
    row = await client.pool.fetchrow(
        "SELECT data FROM toren.journal WHERE actor_id = $1 AND type = 'run.started'", run_id
    )
    return decode("run.started", row["data"]) if row else None


async def decide(
    client: Client, run_id: str, *, approved: bool, who: str, reason: str = "", channel: str = "cli"
) -> None:
    """Approve or deny the tool call a parked run waits on (recorded with who and why)."""
    await client.send(
        run_id, Decide(approved=approved, who=who, reason=reason, channel=channel), system=True
    )


async def read_run(client: Client, run_id: str) -> RunState:
    """The run's state, folded from its journal here (no worker involved).

    Raises:
        UnknownActor: no such run.
    """
    row = await client.actor(run_id)
    if row["kind"] != RUN_KIND:
        raise UnknownActor(run_id)
    state = RunState()
    for entry in await client.journal(run_id):
        state = fold(state, decode(entry.type, entry.data))
    return state


async def say(client: Client, run_id: str, text: str, *, who: str, channel: str = "cli") -> None:
    """A human message to the run (applied at the next step boundary)."""
    await client.send(run_id, Say(text=text, who=who, channel=channel), system=True)


async def cancel(client: Client, run_id: str, *, who: str, reason: str = "") -> None:
    """Cancel the run: it fails with class ``cancelled`` at its next step boundary."""
    await client.send(run_id, Cancel(who=who, reason=reason), system=True)


async def retry(client: Client, run_id: str, *, who: str) -> None:
    """Resume a failed run from its last good step (completed calls are not paid again)."""
    await client.send(run_id, Retry(who=who), system=True)
