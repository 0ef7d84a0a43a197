"""What a run is made of: the messages it receives and the events it records.

Every event carries ``v``, the event format's version (1 today). A later version adds events
or fields with defaults; recorded journals of every earlier version are kept as test fixtures.
"""

from __future__ import annotations

from typing import Any, Literal

import attrs

from toren._agent.model import Message, ModelResponse
from toren._agent.principal import Principal
from toren._core.codec import message

RUN_KIND = "toren.run"
FORMAT = 1

Status = Literal["running", "parked", "completed", "failed", "cancelled"]
STATUSES: tuple[Status, ...] = ("running", "parked", "completed", "failed", "cancelled")
"""Every status a run has (summaries, filters, metrics): ``cancelled`` is a run ended by a
cancel (its ``run.failed`` records class ``cancelled``), apart from ``failed``."""
ENDED: tuple[Status, ...] = ("completed", "failed", "cancelled")
"""The statuses of a run that has ended: it takes no step until written to (completed) or
retried (failed); a cancelled run stays so."""
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
    by: Principal | None = None  # None only in a message queued by an earlier version
    # A child run started by another run's cross-agent call: the parent run, its tool call, the
    # agents above it (the chain a cycle is checked against), the parent's budget left, and how
    # deep the chain may go (the smallest max_call_depth above it; None in a start sent by an
    # earlier version: then only the child's own agent's limit counts).
    parent: str = ""
    parent_call: str = ""
    chain: tuple[str, ...] = ()
    budget_usd: str | None = None
    depth_limit: int | None = None
    watcher: str = ""  # told of each end (a call id-less run.child_ended): its schedule


@message("run.continue")
@attrs.frozen
class Continue:
    """Do the next unit of work (a model call, a tool intent, a tool execution)."""


@message("run.decide")
@attrs.frozen(kw_only=True)
class Decide:
    """A human's decision on one parked tool call, named by ``call_id``.

    It is applied only if that call waits for a decision when the run handles it; otherwise it
    is refused (``decision.refused`` on the timeline) and never recorded as a decision. Sent
    with :meth:`~toren.Client.ask`, it is answered with a :class:`DecisionOutcome`.
    """

    call_id: str = ""  # empty only in a message queued by a version that did not name calls
    approved: bool
    by: Principal | None = None  # None only in a message queued by an earlier version
    reason: str = ""
    who: str = ""  # what an earlier version recorded instead of ``by``
    channel: str = "cli"


Outcome = Literal["applied", "repeated", "not_waiting", "conflict", "forbidden"]


@message("run.decision_outcome")
@attrs.frozen(kw_only=True)
class DecisionOutcome:
    """What a run did with a :class:`Decide`.

    ``applied``: recorded as the call's decision. ``repeated``: the call was already decided
    the same way (nothing new recorded). ``not_waiting``: the call does not wait for a decision
    (``waiting`` names what does). ``conflict``: the call was already decided the other way.
    ``forbidden``: who sent it may not decide this run's calls (a Telegram user who is not an
    approver of the run's agent's bot, whichever chat showed the call).
    """

    call_id: str
    outcome: Outcome
    detail: str
    waiting: tuple[str, ...] = ()

    @property
    def accepted(self) -> bool:
        """Whether the decision stands (applied now or before)."""
        return self.outcome in ("applied", "repeated")


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
    by: Principal | None = None  # None only in a message queued by an earlier version
    who: str = ""
    channel: str = "cli"


@message("run.cancel")
@attrs.frozen(kw_only=True)
class Cancel:
    by: Principal | None = None  # None only in a message queued by an earlier version
    who: str = ""
    reason: str = ""


@message("run.retry")
@attrs.frozen(kw_only=True)
class Retry:
    """Resume a failed run from its last good step; completed calls are not paid again."""

    by: Principal | None = None  # None only in a message queued by an earlier version
    who: str = ""


@message("run.child_ended")
@attrs.frozen(kw_only=True)
class ChildEnded:
    """A child run tells its parent that it ended (completed, failed or cancelled: its
    ``status``, ``failed`` with class ``cancelled`` from an earlier version), with what it cost
    (its own calls and its children's, at its end). Sent at each end; the parent takes the
    first for each call."""

    call_id: str  # the parent's tool call that started the child
    run_id: str
    agent: str
    status: str
    output: str = ""
    error_class: str | None = None
    error: str | None = None
    usd_paid: str = "0"
    calls_made: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    unpriced_calls: int = 0
    # model calls lost in flight (see ModelLost) and their estimated cost, its children's too
    lost_calls: int = 0
    lost_usd: str = "0"


@message("run.child_asked")
@attrs.frozen(kw_only=True)
class ChildAsked:
    """A child run (or a child of it) asks a human to decide one of its tool calls: the parent
    records it for its timeline (the decision goes to the child)."""

    call_id: str  # the parent's tool call that started the child
    run_id: str  # the run that waits (the child, or a run below it)
    agent: str
    child_call_id: str
    name: str
    arguments: dict[str, Any]


def author(msg: Say | Decide | Cancel | Retry) -> tuple[str, str]:
    """The name and surface a human message came from (a message queued by an earlier version
    carries only a free-text name)."""
    if msg.by is not None:
        return msg.by.name, msg.by.via
    return msg.who, getattr(msg, "channel", "cli")


# --- events a run records -------------------------------------------------------------------


@message("run.started")
@attrs.frozen(kw_only=True)
class RunStarted:
    agent: str
    input: str
    at: float = 0.0  # when (unix seconds, the worker's clock)
    by: Principal | None = None  # who started it (None in journals of earlier versions)
    # set for a child run (see StartRun)
    parent: str = ""
    parent_call: str = ""
    chain: tuple[str, ...] = ()
    budget_usd: str | None = None
    depth_limit: int | None = None  # None in journals of earlier versions: no limit from above
    watcher: str = ""  # see StartRun
    version: str = ""  # its agent's version (toren.runs.agent_version); "": not recorded
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
    checked_as: str = ""  # the request parameters it was made with (see RunResumed)
    v: int = FORMAT


@message("model.calling")
@attrs.frozen(kw_only=True)
class ModelCalling:
    """The model call the run's next step makes, announced in the commit before that step (the
    commit of the step before it: no write of its own). Its result (``model.called``, a summary
    call's ``context.compacted``, ``model.unreadable``), a failed attempt (``run.retrying``) or
    the run's end answers it. A step that finds it unanswered and its own message claimed
    before (a worker died or lost its lease mid-step) records the earlier attempts as
    ``model.lost``.

    ``step`` is the conversation step the call is for; ``input_tokens`` an estimate of its
    request (see :mod:`toren._agent.estimate`), ``cost_usd`` the price of that input at the model's
    price (decimal as text; ``None``: unpriced). Both are estimates: the output is unknown."""

    step: int
    model: str
    input_tokens: int
    cost_usd: str | None
    v: int = FORMAT


@message("model.lost")
@attrs.frozen(kw_only=True)
class ModelLost:
    """Model calls lost in flight: the step announced by ``model.calling`` was begun ``count``
    times by workers that stopped before recording its result (killed, cut from the database,
    past their lease), so the provider may have received (and billed) each of those requests.
    The call is then made again. ``cost_usd`` is the estimated cost of the ``count`` requests
    (their estimated input at the model's price; ``None``: unpriced). Counted on the receipt as
    lost in flight, apart from the calls made."""

    step: int
    model: str
    count: int
    input_tokens: int
    cost_usd: str | None
    v: int = FORMAT


@message("model.unreadable")
@attrs.frozen(kw_only=True)
class ModelUnreadable:
    """A model call the provider answered with something that could not be read (malformed,
    nested too deeply, a number too long). It was probably paid for: the receipt counts it as
    made and unpriced, and it is never asked again by itself (the run fails with class
    ``provider``; a retry asks again). It is not part of the conversation."""

    step: int
    digest: str
    model: str
    error: str
    latency_ms: int
    v: int = FORMAT


@message("steps.invalidated")
@attrs.frozen(kw_only=True)
class StepsInvalidated:
    """The request this code would make at ``from_step`` differs from the recorded one: that
    call and every later one are void and will be paid again. The journal keeps them."""

    from_step: int
    reason: str
    v: int = FORMAT


CompactionTier = Literal["soft", "hard"]
CompactionReason = Literal["threshold", "refused"]


@message("context.compacted")
@attrs.frozen(kw_only=True)
class ContextCompacted:
    """The run's context was compacted: every later request carries ``prefix`` in place of the
    conversation before ``base``, recorded by value (a replay applies it; it never compacts or
    summarises again). The digest chain restarts at the first call after it.

    ``tier`` ``soft``: old tool results elided to stubs, no model call. ``hard``: the turns
    before ``base`` summarised by a model call (``model``, ``summary``, ``cost_usd``,
    ``latency_ms``: counted on the receipt like any call). ``reason`` ``threshold``: the next
    request was projected past a threshold of the window; ``refused``: the provider refused
    the request as over the window. ``after_calls``: how many calls the run had made then.
    ``base`` indexes the full conversation (``RunState.messages``; ``messages[base]`` is an
    assistant turn). ``tokens_before`` is the projected input that triggered it,
    ``tokens_after`` the estimate after it; ``elided`` counts the tool results stubbed and
    ``summarised`` the messages summarised."""

    tier: CompactionTier
    reason: CompactionReason
    after_calls: int
    base: int
    prefix: tuple[Message, ...]
    tokens_before: int
    tokens_after: int
    elided: int = 0
    summarised: int = 0
    model: str = ""
    summary: ModelResponse | None = None
    cost_usd: str | None = None  # decimal as text; None: unpriced, or no call made
    latency_ms: int = 0
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
    """A tool call's result as the model gets it (capped; ``truncated_from`` is the size in
    bytes of what the tool returned when it was cut). A denial is an error result with
    ``denied`` set: unlike the other errors, it does not count toward the attempts cap."""

    call_id: str
    content: str
    is_error: bool = False
    denied: bool = False
    truncated_from: int | None = None
    checkpoint: str | None = None  # a sandboxed call: the workspace's checkpoint after it
    v: int = FORMAT


@message("approval.requested")
@attrs.frozen(kw_only=True)
class ApprovalRequested:
    call_id: str
    name: str
    arguments: dict[str, Any]
    at: float = 0.0
    cwd: str | None = None  # a sandboxed command: the directory it would run in
    v: int = FORMAT


@message("approval.decided")
@attrs.frozen(kw_only=True)
class ApprovalDecided:
    call_id: str
    approved: bool
    who: str  # ``by.name`` (kept for readers of earlier journals)
    reason: str
    channel: str  # ``by.via``
    at: float = 0.0
    by: Principal | None = None
    v: int = FORMAT


@message("decision.refused")
@attrs.frozen(kw_only=True)
class DecisionRefused:
    """A decision that was not applied: its call did not wait for one (``not_waiting``), or
    was already decided the other way (``conflict``). Kept for the timeline; never a decision."""

    call_id: str
    approved: bool
    who: str
    reason: str
    channel: str
    outcome: str
    at: float = 0.0
    by: Principal | None = None
    v: int = FORMAT


REFUSALS_RECORDED = 20
"""Refused decisions a run records per hour (``decision.refused``); past them one
``decision.refusals_muted`` says that the rest of the hour's are answered, not recorded."""
REFUSAL_WINDOW = 3600.0
"""Seconds of a window of refused decisions: it starts at the first refusal after the last one
ended."""


@message("decision.refusals_muted")
@attrs.frozen(kw_only=True)
class DecisionsMuted:
    """More than :data:`REFUSALS_RECORDED` decisions were refused since ``since``: this one
    and those until ``until`` are answered (refused, as ever) but not recorded, so that bogus
    decisions cannot grow the journal without bound."""

    since: float
    until: float
    recorded: int  # the decision.refused events recorded since ``since``
    at: float = 0.0


@message("message.received")
@attrs.frozen(kw_only=True)
class MessageReceived:
    text: str
    who: str  # ``by.name``
    channel: str  # ``by.via``
    by: Principal | None = None
    at: float = 0.0  # when taken (0.0: earlier journals); ends a completed run's human wait
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
    """A failed run was resumed from its last good step (parked again if a call of it still
    waits for a decision)."""

    who: str
    at: float = 0.0
    by: Principal | None = None
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
    """The run went on from its journal; ``replayed`` calls were served from it, not re-sent.

    ``checked_as`` names the request parameters (model, system prompt, tools, Toren's version)
    the recorded calls were checked against: while they stay the same, a later activation
    checks only the calls recorded since."""

    replayed: int
    checked_as: str = ""
    v: int = FORMAT


@message("callees.described")
@attrs.frozen(kw_only=True)
class CalleesDescribed:
    """How the agents this run may call are described to its model (each callee's
    ``description``, from the cards live workers publish), recorded so that every request of
    the run describes them the same way, live and after a replay."""

    descriptions: dict[str, str]
    v: int = FORMAT


@message("child.started")
@attrs.frozen(kw_only=True)
class ChildStarted:
    """A cross-agent call started child run ``run_id`` (in the same commit): the run parks
    until the child ends."""

    call_id: str
    run_id: str
    agent: str
    at: float = 0.0
    v: int = FORMAT


@message("sandbox.requested")
@attrs.frozen(kw_only=True)
class SandboxRequested:
    """A tool call was sent to the run's sandbox (spawned in the same commit if it was the
    first): the run waits for its result (``run.sandbox_done``)."""

    call_id: str
    sandbox: str
    at: float = 0.0
    v: int = FORMAT


@message("sandbox.failed")
@attrs.frozen(kw_only=True)
class SandboxFailed:
    """The kernel gave up on the run's sandbox (it kept crashing): the calls waiting on it got
    error results, and later sandbox calls get one at once."""

    error: str
    at: float = 0.0
    v: int = FORMAT


@message("sandbox.noted")
@attrs.frozen(kw_only=True)
class SandboxNoted:
    """What the run's sandbox told it (for the timeline): recreated from a checkpoint."""

    text: str
    at: float = 0.0
    v: int = FORMAT


@message("child.finished")
@attrs.frozen(kw_only=True)
class ChildFinished:
    """A child run ended; its cost (its own calls and its children's) counts in this run's."""

    call_id: str
    run_id: str
    agent: str
    status: str
    # its output (cut to this run's tool-result cap) or its error, kept for a call whose result
    # could not be recorded when the child ended (this run had failed meanwhile)
    output: str = ""
    error_class: str | None = None
    error: str | None = None
    usd_paid: str = "0"
    calls_made: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    unpriced_calls: int = 0
    lost_calls: int = 0  # model calls lost in flight (see ModelLost), estimated at lost_usd
    lost_usd: str = "0"
    at: float = 0.0
    v: int = FORMAT


@message("child.approval_requested")
@attrs.frozen(kw_only=True)
class ChildApprovalRequested:
    """A run below this one waits for a human decision on one of its tool calls (decide it
    from this run's page or the child's: the decision goes to ``run_id``)."""

    call_id: str  # this run's call that started the child
    run_id: str
    agent: str
    child_call_id: str
    name: str
    arguments: dict[str, Any]
    at: float = 0.0
    v: int = FORMAT


@message("run.completed")
@attrs.frozen(kw_only=True)
class RunCompleted:
    output: str
    # When the turn ended (0.0 in journals of earlier versions): until a message continues the
    # conversation, the run waits on a human, which is not counted toward the wall clock.
    at: float = 0.0
    v: int = FORMAT


@message("run.failed")
@attrs.frozen(kw_only=True)
class RunFailed:
    error_class: str
    message: str
    by: Principal | None = None  # who cancelled it (class ``cancelled``)
    v: int = FORMAT
