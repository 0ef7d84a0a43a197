"""A run's state: what its events make of it, and what is read from it (summary, waiting calls,
what a decision would do). The fold itself, one handler per event type, is in
:mod:`toren.runs._fold` (imported here as :func:`fold`); the receipt is in
:mod:`toren.runs.receipt`."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from decimal import Decimal
from typing import Any, TypeVar, get_args, get_origin

import attrs
from pyrsistent import PMap, PSet, PVector, pmap, pset, pvector

from toren._agent.model import Message, ModelResponse, Text, ToolCall
from toren._core.codec import converter
from toren._core.history import History, Ledger
from toren.runs._fold import canonical as canonical
from toren.runs._fold import fold as fold
from toren.runs._fold import occurrence_key as occurrence_key
from toren.runs._fold import waiting_ids
from toren.runs.events import (
    ENDED,
    ApprovalDecided,
    ChildFinished,
    ChildStarted,
    ContextCompacted,
    Decide,
    DecisionOutcome,
    ModelCalled,
    ModelCalling,
    Status,
    ToolIntended,
    ToolResulted,
)
from toren.runs.fork_events import RunForked
from toren.runs.rate_events import RateWaited
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
# cancelled run's status is ``cancelled`` (it was ``failed``). 8: ``rate_wait``. 9: ``version``.
# 10: ``forked``. 11: ``cost_marks``, Histories with a released front (history.released).
SNAPSHOT_VERSION = 11


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
    # the running costs above that the receipt reads and that were released with the old
    # turns of a long conversation (see toren.runs.release_events), by "kept:N" and
    # "compaction:N" (the cost of the first N)
    cost_marks: PMap[str, Decimal] = attrs.field(factory=pmap)
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
    # the first ``settled_calls`` calls are taken by value and never checked again: a fork's
    # prefix, and the calls of a version a run moved on from (see docs/versioning.md)
    settled_calls: int = 0
    # the agent version it runs on (run.started, run.upgraded); "": started before versions
    version: str = ""
    # a fork: where it came from, the calls it took by value, its sandbox's starting checkpoint
    forked: RunForked | None = None
    failed_attempts: int = 0  # consecutive failed attempts at the current step
    tool_failures: int = 0  # consecutive model turns whose tool calls all failed
    unreadable: int = 0  # calls answered with something that could not be read (paid, unpriced)
    # the model call announced for the next step and not answered yet (see ModelCalling), and
    # the calls lost in flight (see ModelLost) with their estimated cost
    calling: ModelCalling | None = None
    # the rate limit the announced call waits on (cleared when a call is announced again)
    rate_wait: RateWaited | None = None
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
    watcher: str = ""  # told of each end (see StartRun)
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


def context_messages(state: RunState) -> Sequence[Message]:
    """The conversation as the next request carries it: the latest compaction's prefix, then
    the conversation from its base on (the whole conversation when none was made)."""
    if not state.compactions:
        return state.messages
    latest = state.compactions[-1]
    return (*latest.prefix, *state.messages[latest.base :])


def occurrences_of(state: RunState, name: str, arguments: Any) -> int:
    """How many intents the run has recorded for ``name`` with these arguments."""
    return state.occurrences.get(occurrence_key(name, arguments), 0)


def waiting_on(state: RunState) -> list[ToolCall]:
    """The tool calls the run waits for a decision on (the model's request for each); none
    once the run has ended (a decision can no longer be applied)."""
    if state.status in ENDED:
        return []
    waiting = waiting_ids(state)
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
        # for the costs surface (toren.runs.costs), which sums rows without folding journals
        "input_tokens": r.input_tokens,
        "output_tokens": r.output_tokens,
        "waiting_on": [] if state.status in ENDED else sorted(waiting_ids(state)),
        "error_class": state.error_class,
        "parent": state.parent or None,
        "children": [c.run_id for c in state.children_running],
        "version": state.version,
    }


def final_text(response: ModelResponse) -> str:
    """The text of a final response."""
    return "".join(b.text for b in response.content if isinstance(b, Text))
