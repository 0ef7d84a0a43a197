"""Two-tier recorded compaction: keeping a long run's requests within its model's context window.

Before each model call the run projects the input tokens of the request it is about to send from
what the provider reported for the last one: ``input + output`` tokens of the last call, plus the
estimate (:func:`~toren.runs.estimate_tokens`) of the messages added since, scaled by how the
provider's count of the last request compared with the estimate of it. Against the model's window
(``Agent.context_window``, else the price library's model data; unknown: no threshold):

- past ``compact_soft`` of the window, the **soft** tier elides the tool results older than the
  last two assistant turns to stubs that say what was there (tool, call id, size, the first
  characters). No model call.
- past ``compact_hard``, or when the soft tier cannot take the request well back under
  ``compact_soft`` (three quarters of it, :data:`SOFT_ROOM`), the **hard** tier summarises
  everything before the last two assistant turns with one model call through the agent's own
  provider, recorded and priced like any call (:mod:`~toren.actors.runs.summarising`).

Pinned, never elided or summarised: the system prompt (it is not part of the conversation), the
task, and every human message (each is carried verbatim into the new prefix a hard compaction
makes). A provider's "request too large" refusal compacts at once with the strongest tier (all
tool results but the last turn's elided, then a summary) and the call is tried once more; a second
refusal fails the run (class ``provider``).

Each compaction is a :class:`~toren.runs.ContextCompacted` event holding the new prefix by value:
the conversation the run keeps (``RunState.messages``) is never rewritten, the next request is
``prefix + messages[base:]`` (:func:`~toren.runs.context_messages`), and a replay applies the
recorded prefix without compacting or calling the model again. The digest chain restarts at the
first call after a compaction (:mod:`~toren.actors.runs.request`), so checking a journal stays
linear and an invalidation stays exact on both sides of it.

Requests are measured as this code builds them (:func:`~toren.actors.runs.request.builder`, looked
up at each step: a changed build is the one used).
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Sequence

import attrs

from toren import Context
from toren.actors.runs import request
from toren.actors.runs.request import Build
from toren.actors.runs.summarising import (
    SUMMARY_MARK,
    SUMMARY_MAX_TOKENS,
    Summary,
    pinned,
    summarise,
    summary_request,
    tool_names,
)
from toren.providers import ProviderError, context_window, parse_model
from toren.runs import (
    Agent,
    ContextCompacted,
    Continue,
    Message,
    RunFailed,
    RunState,
    Text,
    ToolCall,
    ToolResult,
    estimate_tokens,
    release_due,
)
from toren.runs.events import CompactionReason, CompactionTier

log = logging.getLogger("toren.compaction")

KEEP_TURNS = 2  # assistant turns (with their results) a compaction leaves as they are
STUB_PREVIEW = 100  # characters of an elided tool result its stub keeps
# A soft compaction is made only if it takes the request under this fraction of the soft
# threshold; one that saves less gives way to the hard tier.
SOFT_ROOM = 0.75
# A compaction by threshold is made only if it can take out this fraction of the window: when
# what cannot be compacted (the task, human messages, the latest turns) is itself past the
# threshold, the run does not pay for a summary at every step to save a few tokens. Nor does
# it compact by threshold again before its context has grown by as much since the last one.
GAIN = 0.1
# Reported input tokens are believed within this factor of the estimate (either way).
MAX_RATIO = 4.0
ELIDED = "elided by Toren to save context"


@attrs.define
class LastSent:
    """The estimated tokens of the request the run's last call sent, as the code builds it now,
    kept by the run's actor between its steps: building and measuring that request again before
    every call cost what the conversation has grown to. It holds for the call whose digest it
    names, built for the same agent and build inputs (the very objects)."""

    digest: str | None = None
    agent: Agent | None = None
    inputs: object = None
    tokens: int = 0

    def holds(self, digest: str, agent: Agent, inputs: object) -> bool:
        return self.digest == digest and self.agent is agent and self.inputs is inputs


@attrs.frozen
class View:
    """A conversation as a request carries it: ``prefix``, then the run's messages from
    ``base`` on."""

    prefix: tuple[Message, ...]
    base: int

    def head(self, messages: Sequence[Message], cut: int) -> list[Message]:
        """What comes before ``messages[cut]`` (``cut >= base``) in this view."""
        return [*self.prefix, *messages[self.base : cut]]

    def all(self, messages: Sequence[Message]) -> list[Message]:
        return [*self.prefix, *messages[self.base :]]


def window_of(agent: Agent) -> int | None:
    """The agent's context window in tokens: its own setting, else the price library's model
    data; ``None`` when neither knows."""
    if agent.context_window is not None:
        return agent.context_window
    provider, model_id = parse_model(agent.model)
    return _library_window(provider, model_id)


@functools.cache
def _library_window(provider: str, model_id: str) -> int | None:
    return context_window(provider, model_id)


def _current(state: RunState) -> View:
    if not state.compactions:
        return View((), 0)
    latest = state.compactions[-1]
    return View(tuple(latest.prefix), latest.base)


def _in_effect(state: RunState, calls: int) -> ContextCompacted | None:
    """The latest compaction made when the run had made at most ``calls`` calls."""
    compactions = state.compactions
    # the latest are the ones looked for (never those a long conversation released)
    for i in range(len(compactions) - 1, compactions.released - 1, -1):
        if compactions[i].after_calls <= calls:
            return compactions[i]
    return None


def _since_last_call(state: RunState) -> list[ContextCompacted]:
    found = []
    for i in range(len(state.compactions) - 1, state.compactions.released - 1, -1):
        if state.compactions[i].after_calls < len(state.calls):
            break
        found.append(state.compactions[i])
    return found


# -- what the next request will hold ------------------------------------------------------------


@attrs.frozen
class Projection:
    tokens: int  # projected input tokens of the next request
    ratio: float  # the provider's count of the last request over its estimate


def project(state: RunState, agent: Agent, last_sent: LastSent) -> Projection:
    """The projected input tokens of the next request: the last call's reported input and
    output tokens, and the estimate of what was added since, calibrated by the last call.
    ``last_sent`` is the run actor's estimate of its last request, kept between steps."""
    build = request.builder(state.callees)
    view = _current(state).all(state.messages)
    if not state.calls:
        return Projection(estimate_tokens(build(agent, view)), 1.0)
    last = state.calls[-1]
    usage = last.response.usage
    memo = last_sent
    if memo.holds(last.digest, agent, state.callees):
        estimated = memo.tokens
    else:
        then = _in_effect(state, len(state.calls) - 1)
        sent = (
            [*then.prefix, *state.messages[then.base : last.messages_len]]
            if then is not None
            else state.messages[: last.messages_len]
        )
        estimated = estimate_tokens(build(agent, sent))
        memo.digest, memo.agent, memo.inputs = last.digest, agent, state.callees
        memo.tokens = estimated
    if usage.input_tokens <= 0 or estimated <= 0:  # no usage reported: the estimate alone
        return Projection(estimate_tokens(build(agent, view)), 1.0)
    # Usage is the provider's word, believed within a factor of MAX_RATIO of the estimate: a
    # gateway that reports nonsense must not make every step pay for a summary.
    reported = min(max(usage.input_tokens, estimated / MAX_RATIO), estimated * MAX_RATIO)
    ratio = reported / estimated
    if _since_last_call(state):
        return Projection(math.ceil(estimate_tokens(build(agent, view)) * ratio), ratio)
    added = state.messages[last.messages_len + 1 :]  # after the last call's own answer
    grown = estimate_tokens(list(added)) * ratio
    output = min(usage.output_tokens, agent.max_tokens)
    return Projection(math.ceil(reported + output + grown), ratio)


def _tokens(agent: Agent, build: Build, messages: Sequence[Message], ratio: float) -> int:
    return math.ceil(estimate_tokens(build(agent, messages)) * ratio)


def _turns_back(messages: Sequence[Message], start: int, keep: int) -> int | None:
    """The index of the ``keep``-th last assistant turn at or after ``start`` (the earliest
    there is, when fewer), or ``None`` when there is none."""
    found = None
    for i in range(len(messages) - 1, start - 1, -1):
        if messages[i].role == "assistant":
            found, keep = i, keep - 1
            if not keep:
                break
    return found


# -- the soft tier ------------------------------------------------------------------------------


def is_stub(block: ToolResult) -> bool:
    return block.content.startswith(f"[{ELIDED}:")


def stub(block: ToolResult, name: str) -> ToolResult:
    """What an elided tool result becomes: what was there, in a line."""
    size = len(block.content.encode("utf-8", "surrogatepass"))
    began = block.content[:STUB_PREVIEW]
    more = "..." if len(block.content) > STUB_PREVIEW else ""
    error = ", an error" if block.is_error else ""
    text = (
        f"[{ELIDED}: the result of {name} (call {block.tool_call_id}){error}, {size} bytes; "
        f"it began: {began!r}{more}]"
    )
    return ToolResult(tool_call_id=block.tool_call_id, content=text, is_error=block.is_error)


def _elided(messages: Sequence[Message]) -> tuple[list[Message], int]:
    """``messages`` with every tool result not yet elided made a stub, and how many were."""
    names = tool_names(messages)
    out: list[Message] = []
    count = 0
    for message in messages:
        if message.role != "user" or not any(
            isinstance(b, ToolResult) and not is_stub(b) for b in message.content
        ):
            out.append(message)
            continue
        blocks: list[Text | ToolCall | ToolResult] = []
        for block in message.content:
            if isinstance(block, ToolResult) and not is_stub(block):
                blocks.append(stub(block, names.get(block.tool_call_id, "a tool")))
                count += 1
            else:
                blocks.append(block)
        out.append(Message(role="user", content=tuple(blocks)))
    return out, count


def _soft(state: RunState, view: View, keep: int) -> tuple[View, int] | None:
    """``view`` with the tool results before its last ``keep`` assistant turns elided (``None``
    when none is left to elide)."""
    cut = _turns_back(state.messages, view.base, keep)
    if cut is None:
        return None
    head, count = _elided(view.head(state.messages, cut))
    if not count:
        return None
    return View(tuple(head), cut), count


# -- the step -----------------------------------------------------------------------------------


async def compact_if_needed(ctx: Context[RunState], agent: Agent, last_sent: LastSent) -> bool:
    """Before a model call: compact if the next request is projected past a threshold of the
    window. True when this step did something else instead of the call (a compaction was
    recorded and the next step makes the call; or the run failed or waits to retry)."""
    state = ctx.state
    if not state.calls or _since_last_call(state):
        # Nothing to compact yet; or compacted since the last call: the request is as small as
        # compaction makes it, so it is sent (a refusal still compacts once more).
        return False
    window = window_of(agent)
    if window is None:
        return False
    projection = project(state, agent, last_sent)
    if projection.tokens <= agent.compact_soft * window:
        return False
    latest = state.compactions[-1] if state.compactions else None
    if latest is not None and projection.tokens - latest.tokens_after < GAIN * window:
        return False  # the last compaction could do no better; a refusal still compacts
    return await _compact(ctx, agent, projection, window, reason="threshold")


async def after_refusal(
    ctx: Context[RunState], agent: Agent, last_sent: LastSent, exc: ProviderError
) -> None:
    """The provider refused the request as over the window: compact with the strongest tier
    and try once more; refused again after that, the run fails (class ``provider``)."""
    state = ctx.state
    if any(c.reason == "refused" for c in _since_last_call(state)):
        ctx.emit(
            RunFailed(
                error_class="provider",
                message="the request stays over the model's context window after compaction "
                f"(the conversation's latest turns alone are too large): {exc}",
            )
        )
        return
    window = window_of(agent)
    projection = project(state, agent, last_sent)
    log.warning(
        "%s: the provider refused the request as over the window; compacting: %s",
        ctx.actor_id,
        exc.message,
    )
    if not await _compact(ctx, agent, projection, window, reason="refused"):
        ctx.emit(
            RunFailed(
                error_class="provider",
                message="the request is over the model's context window and nothing is left "
                f"to compact (the task and the latest turn alone are too large): {exc}",
            )
        )


async def _compact(
    ctx: Context[RunState],
    agent: Agent,
    projection: Projection,
    window: int | None,
    *,
    reason: CompactionReason,
) -> bool:
    """Compact the run's context (soft, else hard); True when the step did something."""
    state = ctx.state
    messages, build, ratio = state.messages, request.builder(state.callees), projection.ratio
    refused = reason == "refused"
    keep = 1 if refused else KEEP_TURNS
    current = _current(state)
    soft = _soft(state, current, keep)
    view = soft[0] if soft else current
    elided = soft[1] if soft else 0
    soft_limit = agent.compact_soft * window if window else math.inf
    past_hard = window is not None and projection.tokens > agent.compact_hard * window
    if not refused and not past_hard:
        if not soft:
            return False  # nothing to elide: the hard tier waits for its own threshold
        after = _tokens(agent, build, view.all(messages), ratio)
        # A soft compaction that leaves little room under the soft threshold would come back
        # within a step or two (each one a new prefix in the journal, and a cold prompt cache
        # at the provider): past that, the hard tier is what the run needs.
        if after <= SOFT_ROOM * soft_limit:
            _record(ctx, agent, reason, "soft", view, projection.tokens, after, elided=elided)
            return True
    cut = _turns_back(messages, view.base, keep)
    # The last two turns, unless they alone are past the soft threshold: the last one.
    if (
        cut is not None
        and not refused
        and _tokens(agent, build, messages[cut:], ratio) > soft_limit
    ):
        cut = _turns_back(messages, view.base, 1)
    head = view.head(messages, cut) if cut is not None else []
    if cut is None or not any(m.role == "assistant" for m in head):
        if not soft:
            return False  # nothing to elide, nothing to summarise
        after = _tokens(agent, build, view.all(messages), ratio)
        _record(ctx, agent, reason, "soft", view, projection.tokens, after, elided=elided)
        return True
    if not refused and window is not None:
        # What the summary can save: the head, less the prefix that replaces it (the task and
        # the pinned human messages, and a summary of up to SUMMARY_MAX_TOKENS).
        kept = estimate_tokens([state.input, *pinned(state, head)]) * ratio + SUMMARY_MAX_TOKENS
        if estimate_tokens(list(head)) * ratio - kept < GAIN * window:
            if not soft:
                return False
            after = _tokens(agent, build, view.all(messages), ratio)
            _record(ctx, agent, reason, "soft", view, projection.tokens, after, elided=elided)
            return True
    budget = int((window or 4 * SUMMARY_MAX_TOKENS) * agent.compact_soft * 4 / ratio)
    summary = await summarise(ctx, agent, summary_request(agent, head, budget))
    if summary is None:
        return True
    prefix = Message(
        role="user",
        content=(
            Text(text=state.input),
            *pinned(state, head),
            Text(text=SUMMARY_MARK + summary.text),
        ),
    )
    hard = View((prefix,), cut)
    after = _tokens(agent, build, hard.all(messages), ratio)
    _record(
        ctx,
        agent,
        reason,
        "hard",
        hard,
        projection.tokens,
        after,
        elided=elided,
        summarised=len(head),
        summary=summary,
    )
    return True


def _record(
    ctx: Context[RunState],
    agent: Agent,
    reason: CompactionReason,
    tier: CompactionTier,
    view: View,
    before: int,
    after: int,
    *,
    elided: int = 0,
    summarised: int = 0,
    summary: Summary | None = None,
) -> None:
    """Record the compaction and go on: the model call is the next step (which checks the
    budget first, the summary call's cost included)."""
    ctx.emit(
        ContextCompacted(
            tier=tier,
            reason=reason,
            after_calls=len(ctx.state.calls),
            base=view.base,
            prefix=view.prefix,
            tokens_before=before,
            tokens_after=after,
            elided=elided,
            summarised=summarised,
            model=agent.model if summary else "",
            summary=summary.response if summary else None,
            cost_usd=str(summary.cost) if summary and summary.cost is not None else None,
            latency_ms=summary.latency_ms if summary else 0,
        )
    )
    log.info(
        "%s: compacted (%s, %s): about %d input tokens to %d",
        ctx.actor_id,
        tier,
        reason,
        before,
        after,
    )
    retention = getattr(agent, "retention", None)
    if tier == "hard" and getattr(retention, "conversation_keep_for", None) is not None:
        # A conversation that never ends lets go of the turns before the previous hard
        # compaction (toren.runs.release_events): its snapshot stays bounded.
        released = release_due(ctx.state)
        if released is not None:
            ctx.emit(released)
    ctx.send(ctx.actor_id, Continue())
