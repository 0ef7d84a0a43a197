"""A run's state: the fold of its events, and what is read from it (summary, waiting calls, what
a decision would do; the receipt is in :mod:`toren.runs.receipt`)."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from decimal import Decimal
from typing import Any, TypeVar, get_args, get_origin

import attrs
from pyrsistent import PMap, PSet, PVector, pmap, pset, pvector

from toren._agent.model import Message, ModelResponse, Text, ToolCall, ToolResult
from toren._core.actor import ActorFailed
from toren._core.codec import converter
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
    Decide,
    DecisionOutcome,
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
from toren.runs.receipt import receipt

V = TypeVar("V")


def _register_snapshot_hooks() -> None:
    """Teach the payload converter the persistent types and decimals a run's state holds, so
    that the state can be written as a snapshot and read back."""

    def origin_is(kind: type) -> Callable[[Any], bool]:
        return lambda t: t is kind or get_origin(t) is kind

    def vector_out(t: Any) -> Callable[[Any], Any]:
        (item,) = get_args(t) or (Any,)
        return lambda v: [converter.unstructure(x, item) for x in v]

    def vector_in(t: Any) -> Callable[[Any, Any], Any]:
        (item,) = get_args(t) or (Any,)
        hook = converter.get_structure_hook(item)
        return lambda v, _: pvector([hook(x, item) for x in v])

    def map_out(t: Any) -> Callable[[Any], Any]:
        _, item = get_args(t) or (str, Any)
        return lambda v: {k: converter.unstructure(x, item) for k, x in v.items()}

    def map_in(t: Any) -> Callable[[Any, Any], Any]:
        _, item = get_args(t) or (str, Any)
        hook = converter.get_structure_hook(item)
        # Sized for twice as many: a map that grows past its size is copied whole.
        return lambda v, _: pmap({k: hook(x, item) for k, x in v.items()}, pre_size=2 * len(v))

    converter.register_unstructure_hook_factory(origin_is(PVector), vector_out)
    converter.register_structure_hook_factory(origin_is(PVector), vector_in)
    converter.register_unstructure_hook_factory(origin_is(PMap), map_out)
    converter.register_structure_hook_factory(origin_is(PMap), map_in)
    converter.register_unstructure_hook_factory(origin_is(PSet), lambda t: lambda v: sorted(v))
    converter.register_structure_hook_factory(
        origin_is(PSet), lambda t: lambda v, _: pset(v, pre_size=2 * len(v))
    )
    converter.register_unstructure_hook(Decimal, str)
    converter.register_structure_hook(Decimal, lambda v, _: Decimal(v))


_register_snapshot_hooks()


# The shape of RunState as snapshots store it: bump it when a field is added, removed or changes
# meaning, so that older snapshots are set aside (folded from the journal instead). 7: a
# cancelled run's status is ``cancelled`` (it was ``failed``).
SNAPSHOT_VERSION = 7


@attrs.frozen(kw_only=True)
class RunState:
    """A run as its events make it.

    Its sequences and maps are persistent: each event adds to them without copying, so folding
    a journal costs time linear in its length, and a state can be kept while later ones are
    made from it. The long sequences (calls, conversation) are :class:`~toren._core.history.History`
    values, which a snapshot stores in chunks read back only when something reads into them.
    Totals for the receipt, the tool-call ids used and the count of each distinct tool call
    are kept as events arrive, so that no step walks the whole run.
    """

    agent: str = ""
    input: str = ""
    status: Status = "running"
    messages: History[Message] = attrs.field(factory=History)
    calls: History[ModelCalled] = attrs.field(factory=History)
    # calls paid for, then invalidated
    voided: History[ModelCalled] = attrs.field(factory=History)
    # human messages: (calls recorded before it, text)
    heard: History[tuple[int, str]] = attrs.field(factory=History)
    intents: Ledger[ToolIntended] = attrs.field(factory=Ledger)
    results: Ledger[ToolResulted] = attrs.field(factory=Ledger)
    decisions: PMap[str, ApprovalDecided] = attrs.field(factory=pmap)
    asked: PSet[str] = attrs.field(factory=pset)
    replayed: int = 0
    # human messages waiting for pending tool results
    inbox: PVector[str] = attrs.field(factory=pvector)
    # running totals over every call made (kept and voided), and the cost of the kept calls
    # so far, call by call (for what replaying the first N of them saved)
    usd_paid: Decimal = Decimal(0)
    unpriced: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    kept_cost: History[Decimal] = attrs.field(factory=History)
    # context compactions (see ContextCompacted): those in effect, with the running cost of
    # their summary calls (for what replaying the first N of them saved); every compaction
    # made counts in the totals, those voided by an invalidation too
    compactions: History[ContextCompacted] = attrs.field(factory=History)
    compaction_cost: History[Decimal] = attrs.field(factory=History)
    compactions_replayed: int = 0
    summary_calls: int = 0
    compactions_soft: int = 0
    compactions_hard: int = 0
    tokens_saved: int = 0
    # every tool-call id the run's calls carried, kept and voided (a new call's must differ)
    tool_ids: PSet[str] = attrs.field(factory=pset)
    # tool intents recorded, by tool and canonical arguments (see occurrence_key)
    occurrences: PMap[str, int] = attrs.field(factory=pmap)
    # the first ``checked_calls`` calls were checked against the request parameters
    # ``checked_as`` (see RunResumed): an activation with the same parameters checks the rest
    checked_as: str = ""
    checked_calls: int = 0
    failed_attempts: int = 0  # consecutive failed attempts at the current step
    tool_failures: int = 0  # consecutive model turns whose tool calls all failed
    unreadable: int = 0  # calls answered with something that could not be read (paid, unpriced)
    # the model call announced for the next step and not answered yet (see ModelCalling), and
    # the calls lost in flight (see ModelLost) with their estimated cost
    calling: ModelCalling | None = None
    lost_calls: int = 0
    lost_usd: Decimal = Decimal(0)
    started_at: float = 0.0
    parked_since: float | None = None
    parked_seconds: float = 0.0  # time spent waiting on humans: not charged to the wall clock
    output: str | None = None
    error_class: str | None = None
    error: str | None = None
    # cross-agent calls: a child run's parent (see RunStarted), the children this run started
    # by call id (and those that ended), how callees are described to its model, and the
    # running totals of what its children cost
    parent: str = ""
    parent_call: str = ""
    chain: tuple[str, ...] = ()
    depth_limit: int | None = None  # how deep the chain may go, set by the runs above
    # refused decisions recorded (decision.refused, and decision.refusals_muted past the
    # bound) in the window that started at ``refusals_since``
    refusals_since: float = 0.0
    refusals: int = 0
    budget_cap: Decimal | None = None
    children: PMap[str, ChildStarted] = attrs.field(factory=pmap)  # latest child of a call
    finished: PMap[str, ChildFinished] = attrs.field(factory=pmap)  # by child run id
    running: PMap[str, ChildStarted] = attrs.field(factory=pmap)  # not ended yet, by run id
    callees: PMap[str, str] = attrs.field(factory=pmap)
    retries: int = 0  # times the run was retried after failing (a new attempt at its calls)
    child_runs: int = 0
    child_calls: int = 0
    child_usd: Decimal = Decimal(0)
    child_input_tokens: int = 0
    child_output_tokens: int = 0
    child_unpriced: int = 0
    child_lost_calls: int = 0
    child_lost_usd: Decimal = Decimal(0)
    # the run's sandbox (its actor, once spawned), the calls sent to it without a result yet,
    # and why it failed if the kernel gave up on it
    sandbox: str = ""
    sandbox_waiting: PSet[str] = attrs.field(factory=pset)
    sandbox_failed: str | None = None

    @property
    def children_running(self) -> list[ChildStarted]:
        """Child runs started by this run's calls that have not ended yet."""
        return list(self.running.values())

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
            state,
            agent=event.agent,
            input=event.input,
            messages=History([first]),
            started_at=event.at,
            parent=event.parent,
            parent_call=event.parent_call,
            chain=tuple(event.chain),
            depth_limit=event.depth_limit,
            budget_cap=Decimal(event.budget_usd) if event.budget_usd is not None else None,
        )
    if isinstance(event, ModelCalled):
        turn = Message(role="assistant", content=tuple(event.response.content))
        cost = Decimal(event.cost_usd) if event.cost_usd is not None else Decimal(0)
        before = state.kept_cost[-1] if state.kept_cost else Decimal(0)
        usage = event.response.usage
        checked = state.checked_calls
        if (
            event.checked_as
            and event.checked_as == state.checked_as
            and checked == len(state.calls)
        ):
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
    if isinstance(event, ModelCalling):
        return attrs.evolve(state, calling=event)
    if isinstance(event, ModelLost):
        return attrs.evolve(
            state,
            lost_calls=state.lost_calls + max(0, event.count),
            lost_usd=state.lost_usd + max(Decimal(0), _decimal(event.cost_usd)),
            # a live run makes the call again (it stays announced); an ended one does not
            calling=None if state.status in ENDED else state.calling,
        )
    if isinstance(event, MessageReceived):
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
    if isinstance(event, ModelUnreadable):
        return attrs.evolve(state, unreadable=state.unreadable + 1, calling=None)
    if isinstance(event, ContextCompacted):
        return _compacted(state, event)
    if isinstance(event, StepsInvalidated):
        return _invalidate(state, event.from_step)
    if isinstance(event, RunRetrying):  # the call was answered, with a failure
        return attrs.evolve(state, failed_attempts=event.attempt, calling=None)
    if isinstance(event, RunRetried):
        waits = bool(_waiting_ids(state)) or bool(state.running)  # a human, or a child run
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
    if isinstance(event, ToolIntended):
        occurrences = state.occurrences
        earlier = state.intents.get(event.call_id)
        if earlier is not None:  # not recorded by Toren, but a fold must not miscount
            occurrences = _count(occurrences, occurrence_key(earlier.name, earlier.arguments), -1)
        occurrences = _count(occurrences, occurrence_key(event.name, event.arguments), 1)
        return attrs.evolve(
            state, intents=state.intents.set(event.call_id, event), occurrences=occurrences
        )
    if isinstance(event, ToolResulted):
        result = ToolResult(
            tool_call_id=event.call_id, content=event.content, is_error=event.is_error
        )
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
            state, asked=state.asked.add(event.call_id), status="parked", parked_since=event.at
        )
    if isinstance(event, ApprovalDecided):
        waited = event.at - state.parked_since if state.parked_since is not None else 0.0
        return attrs.evolve(
            state,
            decisions=state.decisions.set(event.call_id, event),
            status="running",
            parked_since=None,
            parked_seconds=state.parked_seconds + max(0.0, waited),
        )
    if isinstance(event, SandboxRequested):
        return attrs.evolve(
            state,
            sandbox=event.sandbox,
            sandbox_waiting=state.sandbox_waiting.add(event.call_id),
        )
    if isinstance(event, SandboxFailed):
        return attrs.evolve(state, sandbox_failed=event.error)
    if isinstance(event, CalleesDescribed):
        return attrs.evolve(state, callees=state.callees.update(event.descriptions))
    if isinstance(event, ChildStarted):
        return attrs.evolve(
            state,
            children=state.children.set(event.call_id, event),
            running=state.running.set(event.run_id, event),
            status="parked",
            parked_since=event.at,
        )
    if isinstance(event, ChildFinished):
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
        if state.status == "parked" and not _waiting_ids(state) and not state.running:
            waited = event.at - state.parked_since if state.parked_since is not None else 0.0
            state = attrs.evolve(
                state,
                status="running",
                parked_since=None,
                parked_seconds=state.parked_seconds + max(0.0, waited),
            )
        return state
    if isinstance(event, DecisionRefused | DecisionsMuted):
        if event.at - state.refusals_since >= REFUSAL_WINDOW:
            return attrs.evolve(state, refusals_since=event.at, refusals=1)
        return attrs.evolve(state, refusals=state.refusals + 1)
    if isinstance(event, RunResumed):
        state = attrs.evolve(
            state,
            replayed=max(state.replayed, event.replayed),
            compactions_replayed=len(state.compactions),
        )
        if event.checked_as:
            state = attrs.evolve(state, checked_as=event.checked_as, checked_calls=len(state.calls))
        return state
    if isinstance(event, RunCompleted):
        # Until someone writes again, the run waits on a human (see MessageReceived).
        since = event.at if event.at else state.parked_since
        return attrs.evolve(
            state, status="completed", output=event.output, calling=None, parked_since=since
        )
    if isinstance(event, RunFailed):
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
    if isinstance(event, ActorFailed):  # the kernel gave up on the run (restart intensity)
        return attrs.evolve(
            state,
            status="failed",
            error_class=event.error_class,
            error=event.error,
            calling=None,
        )
    return state


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


def context_messages(state: RunState) -> Sequence[Message]:
    """The conversation as the next request carries it: the latest compaction's prefix, then
    the conversation from its base on (the whole conversation when none was made)."""
    if not state.compactions:
        return state.messages
    latest = state.compactions[-1]
    return (*latest.prefix, *state.messages[latest.base :])


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
    while compactions and state.compactions[compactions - 1].after_calls > len(kept):
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


def occurrences_of(state: RunState, name: str, arguments: Any) -> int:
    """How many intents the run has recorded for ``name`` with these arguments."""
    return state.occurrences.get(occurrence_key(name, arguments), 0)


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


def _waiting_ids(state: RunState) -> set[str]:
    return {a for a in state.asked if a not in state.decisions}


def waiting_on(state: RunState) -> list[ToolCall]:
    """The tool calls the run waits for a decision on (the model's request for each); none
    once the run has ended (a decision can no longer be applied)."""
    if state.status in ENDED:
        return []
    waiting = _waiting_ids(state)
    found: list[ToolCall] = []
    for call in reversed(state.calls):  # they wait in the latest turns: stop once all are seen
        if len(found) == len(waiting):
            break
        blocks = call.response.content
        found.extend(b for b in reversed(blocks) if isinstance(b, ToolCall) and b.id in waiting)
    return found[::-1]


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
        "waiting_on": [] if state.status in ENDED else sorted(_waiting_ids(state)),
        "error_class": state.error_class,
        "parent": state.parent or None,
        "children": [c.run_id for c in state.children_running],
    }


def final_text(response: ModelResponse) -> str:
    """The text of a final response."""
    return "".join(b.text for b in response.content if isinstance(b, Text))
