"""What a run is made of: the messages it receives and the events it records.

Every event carries ``v``, the event format's version (1 today). A later version adds events
or fields with defaults; recorded journals of every earlier version are kept as test fixtures.
"""

from __future__ import annotations

from typing import Any, Literal

import attrs

from toren._codec import message
from toren._model import ModelResponse
from toren._principal import Principal

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
    by: Principal | None = None  # None only in a message queued by an earlier version


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


Outcome = Literal["applied", "repeated", "not_waiting", "conflict"]


@message("run.decision_outcome")
@attrs.frozen(kw_only=True)
class DecisionOutcome:
    """What a run did with a :class:`Decide`.

    ``applied``: recorded as the call's decision. ``repeated``: the call was already decided
    the same way (nothing new recorded). ``not_waiting``: the call does not wait for a decision
    (``waiting`` names what does). ``conflict``: the call was already decided the other way.
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


@message("message.received")
@attrs.frozen(kw_only=True)
class MessageReceived:
    text: str
    who: str  # ``by.name``
    channel: str  # ``by.via``
    by: Principal | None = None
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
    by: Principal | None = None  # who cancelled it (class ``cancelled``)
    v: int = FORMAT
