"""What ``toren jobs show`` prints of a run: the record ``--json`` gives and a line for each event
of its timeline (read from the journal, never folded again here).

Each journal row is decoded into its event class by the kernel's codec, as the fold reads it, and
its line is drawn by the function that one table gives for that class. A row the codec cannot
read (a type this version does not know, a payload that does not decode) or an event with no
line of its own is shown by its type name."""

from __future__ import annotations

import json
import time
import types
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from toren._core.actor import ActorFailed
from toren._core.codec import decode
from toren._core.journal import JournalEntry
from toren._core.terminal import printable
from toren.runs import (
    ApprovalDecided,
    ApprovalRequested,
    ChildApprovalRequested,
    ChildFinished,
    ChildStarted,
    ContextCompacted,
    DecisionRefused,
    DecisionsMuted,
    HistoryReleased,
    MessageReceived,
    ModelCalled,
    ModelCalling,
    ModelLost,
    RateWaited,
    RunCompleted,
    RunFailed,
    RunForked,
    RunResumed,
    RunRetried,
    RunRetrying,
    RunStarted,
    RunState,
    RunUpgraded,
    SandboxFailed,
    SandboxNoted,
    SandboxRequested,
    StepsInvalidated,
    TimerFired,
    TimerSet,
    ToolCall,
    ToolIntended,
    ToolResulted,
    receipt,
)

E = TypeVar("E")


def record(run_id: str, state: RunState) -> dict[str, Any]:
    """The run record ``toren jobs show --json`` prints."""
    r = receipt(state)
    figures = {
        "calls_made": r.calls_made,
        "calls_replayed": r.calls_replayed,
        "input_tokens": r.input_tokens,
        "output_tokens": r.output_tokens,
        "usd_paid": str(r.usd_paid),
        "usd_not_repaid": str(r.usd_not_repaid),
        "unpriced_calls": r.unpriced_calls,
        "compactions_soft": r.compactions_soft,
        "compactions_hard": r.compactions_hard,
        "tokens_saved": r.tokens_saved,
        "child_runs": r.child_runs,
        "child_calls_made": r.child_calls_made,
        "child_usd_paid": str(r.child_usd_paid),
        "usd_total": str(r.usd_total),
        "calls_lost": r.calls_lost,
        "usd_lost_estimated": str(r.usd_lost_estimated),
        "child_calls_lost": r.child_calls_lost,
        "child_usd_lost_estimated": str(r.child_usd_lost_estimated),
        "calls_inherited": r.calls_inherited,
        "usd_inherited": str(r.usd_inherited),
    }
    return {
        "id": run_id,
        "agent": state.agent,
        "status": state.status,
        "input": state.input,
        "output": state.output,
        "error": {"class": state.error_class, "message": state.error} if state.error else None,
        **figures,  # the receipt's figures, at the top level for scripts
        "receipt": figures,
        "parent": state.parent or None,
        "children": [
            {
                "run": c.run_id,
                "agent": c.agent,
                "call_id": call_id,
                "status": state.finished[c.run_id].status if c.run_id in state.finished else None,
            }
            for call_id, c in state.children.items()
        ],
    }


def event_record(entry: JournalEntry) -> dict[str, Any]:
    """One event as ``toren jobs show --json`` lists it: ``seq``, ``type``, ``at`` and ``data``
    as the API's events give them, and ``text``, its line on the timeline."""
    return {
        "seq": entry.seq,
        "type": entry.type,
        "at": entry.at.isoformat() if entry.at else None,
        "text": describe(entry.type, entry.data),
        "data": entry.data,
    }


def describe(event_type: str, data: Any) -> str:
    """One timeline line for an event, :func:`~toren._core.terminal.printable` (control characters,
    bidi controls, NUL and lone surrogates shown as escapes), its line breaks shown as ``\\n``
    so that no text in a run can make a line that looks like another event."""
    return printable(_line(event_type, data)).replace("\n", "\\n")


def _line(event_type: str, data: Any) -> str:
    """The line of a journal row, or its type name when it has none (see the module's doc)."""
    try:
        event = decode(event_type, data)
    except Exception:  # noqa: BLE001  (unknown or undecodable: shown by its type, never fatal)
        return event_type
    draw = _LINES.get(type(event))
    return draw(event) if draw is not None else event_type


def _cost(cost_usd: str | None) -> str:
    return f"${cost_usd}" if cost_usd else "unpriced"


# --- the run's course ------------------------------------------------------------------------


def _started(e: RunStarted) -> str:
    return f"started {e.agent}: {e.input[:200]}"


def _message_received(e: MessageReceived) -> str:
    return f"message from {e.who}: {e.text[:200]}"


def _steps_invalidated(e: StepsInvalidated) -> str:
    return f"steps from {e.from_step} invalidated: {e.reason}"


def _released(e: HistoryReleased) -> str:
    return (
        f"calls before step {e.before_calls} settled; the turns before them let go of "
        "(a long conversation keeps its recent turns; the journal or its archive has them)"
    )


def _rate_waited(e: RateWaited) -> str:
    why = "blocked after a 429" if e.reason == "blocked" else f"{e.reason} used up"
    until = time.strftime("%H:%M:%S UTC", time.gmtime(e.until))
    return f"waiting for rate limit {e.limit} ({e.caps}) until {until}: {why}"


def _retrying(e: RunRetrying) -> str:
    return f"attempt {e.attempt} failed, retrying in {e.delay:g}s: {e.error}"


def _retried(e: RunRetried) -> str:
    return f"retried by {e.who}"


def _upgraded(e: RunUpgraded) -> str:
    how = "history taken as recorded" if e.how == "value" else "history checked again"
    by = f" by {e.by.name}" if e.by is not None else ""
    return f"upgraded from version {e.from_version or '(unknown)'} to {e.to_version}{by} ({how})"


def _forked(e: RunForked) -> str:
    who = f" by {e.by.name}" if e.by is not None else ""
    edit = ""
    if e.message is not None:
        edit = f"; the last message replaced: {e.message[:200]}"
    elif e.input is not None:
        edit = f"; the input replaced: {e.input[:200]}"
    version = "; on the agent's current version" if e.upgrade else ""
    return (
        f"forked from {e.source} at step {e.step}{who}: the {e.calls} call(s) above copied, "
        f"replayed and not paid again{edit}{version}"
    )


def _resumed(e: RunResumed) -> str:
    return f"resumed from the journal ({e.replayed} calls replayed, not re-paid)"


def _completed(e: RunCompleted) -> str:
    return f"completed: {e.output[:200]}"


def _failed(e: RunFailed) -> str:
    if e.error_class == "cancelled":  # a cancel ends the run with its own status
        return f"cancelled: {e.message}"
    return f"failed [{e.error_class}]: {e.message}"


def _given_up(e: ActorFailed) -> str:
    return f"failed [{e.error_class}]: {e.error}"


# --- model calls and the context -------------------------------------------------------------


def _model_called(e: ModelCalled) -> str:
    usage = e.response.usage
    calls = [b.name for b in e.response.content if isinstance(b, ToolCall)]
    asked = f" -> {', '.join(calls)}" if calls else ""
    return (
        f"model call {e.step} ({e.model}): {usage.input_tokens} in, "
        f"{usage.output_tokens} out, {_cost(e.cost_usd)}, {e.latency_ms} ms{asked}"
    )


def _model_calling(e: ModelCalling) -> str:
    return (
        f"model call {e.step} ({e.model}) next: about "
        f"{e.input_tokens} input tokens, {_cost(e.cost_usd)} estimated"
    )


def _model_lost(e: ModelLost) -> str:
    times = "once" if e.count == 1 else f"{e.count} times"
    return (
        f"model call {e.step} ({e.model}) lost in flight {times}: its worker "
        f"stopped before recording the answer; the provider may have billed it (about "
        f"{_cost(e.cost_usd)} estimated)"
    )


def _compacted(e: ContextCompacted) -> str:
    why = "the provider refused the request as too large" if e.reason == "refused" else ""
    what = f"{e.elided} tool results elided" if e.elided else ""
    if e.tier == "hard":
        usage = e.summary.usage if e.summary is not None else None
        tokens_in, tokens_out = (usage.input_tokens, usage.output_tokens) if usage else (0, 0)
        what = ", ".join(
            x
            for x in (
                what,
                f"{e.summarised} messages summarised by {e.model} "
                f"({tokens_in} in, {tokens_out} out, {_cost(e.cost_usd)}, "
                f"{e.latency_ms} ms)",
            )
            if x
        )
    return (
        f"context compacted ({e.tier}{'; ' + why if why else ''}): about "
        f"{e.tokens_before} -> {e.tokens_after} input tokens; {what}"
    )


# --- tool calls, decisions, timers and the sandbox -------------------------------------------


def _tool_intended(e: ToolIntended) -> str:
    return f"tool {e.name} intent {json.dumps(e.arguments)}"


def _tool_resulted(e: ToolResulted) -> str:
    mark = "denied" if e.denied else "error" if e.is_error else "result"
    cut = f" (cut from {e.truncated_from} bytes)" if e.truncated_from else ""
    return f"tool {mark}{cut}: {e.content[:120]}"


def _approval_requested(e: ApprovalRequested) -> str:
    where = f" in {e.cwd}" if e.cwd else ""
    return f"approval requested for {e.name} {json.dumps(e.arguments)}{where}"


def _approval_decided(e: ApprovalDecided) -> str:
    verdict = "approved" if e.approved else "denied"
    reason = f" ({e.reason})" if e.reason else ""
    return f"{verdict} by {e.who} via {e.channel}{reason}"


def _decision_refused(e: DecisionRefused) -> str:
    verdict = "approval" if e.approved else "denial"
    return (
        f"{verdict} of call {e.call_id} by {e.who} via {e.channel} "
        f"refused ({e.outcome.replace('_', ' ')}); not recorded as a decision"
    )


def _decisions_muted(e: DecisionsMuted) -> str:
    return (
        f"{e.recorded} decisions refused within the hour: those refused in the "
        f"{int(e.until - e.at)} s after this are answered but not recorded"
    )


def _timer_set(e: TimerSet) -> str:
    return f"sleeping {e.seconds:g}s (durable timer)"


def _timer_fired(e: TimerFired) -> str:
    return "woke up"


def _sandbox_requested(e: SandboxRequested) -> str:
    return f"call {e.call_id} sent to the sandbox {e.sandbox}"


def _sandbox_noted(e: SandboxNoted) -> str:
    return f"sandbox: {e.text}"


def _sandbox_failed(e: SandboxFailed) -> str:
    return f"sandbox failed: {e.error}"


# --- cross-agent calls -----------------------------------------------------------------------


def _child_started(e: ChildStarted) -> str:
    return f"child run {e.run_id} of {e.agent} started (call {e.call_id})"


def _child_finished(e: ChildFinished) -> str:
    how = e.status + (f" [{e.error_class}]" if e.error_class else "")
    return f"child run {e.run_id} {how}, ${e.usd_paid}"


def _child_approval_requested(e: ChildApprovalRequested) -> str:
    return (
        f"child run {e.run_id} ({e.agent}) asks approval for {e.name} "
        f"{json.dumps(e.arguments)} (call {e.child_call_id})"
    )


def _on(kind: type[E], draw: Callable[[E], str]) -> tuple[type, Callable[[Any], str]]:
    """A row of the table: events of ``kind`` are drawn by ``draw`` (typed so that they match)."""
    return kind, draw


_LINES: Mapping[type, Callable[[Any], str]] = types.MappingProxyType(
    dict(
        [
            _on(ModelCalled, _model_called),
            _on(ModelCalling, _model_calling),
            _on(ModelLost, _model_lost),
            _on(ToolIntended, _tool_intended),
            _on(ToolResulted, _tool_resulted),
            _on(ApprovalRequested, _approval_requested),
            _on(SandboxRequested, _sandbox_requested),
            _on(SandboxNoted, _sandbox_noted),
            _on(SandboxFailed, _sandbox_failed),
            _on(ApprovalDecided, _approval_decided),
            _on(DecisionRefused, _decision_refused),
            _on(DecisionsMuted, _decisions_muted),
            _on(ChildStarted, _child_started),
            _on(ChildFinished, _child_finished),
            _on(ChildApprovalRequested, _child_approval_requested),
            _on(ContextCompacted, _compacted),
            _on(RunFailed, _failed),
            _on(ActorFailed, _given_up),
            _on(RunCompleted, _completed),
            _on(RunStarted, _started),
            _on(MessageReceived, _message_received),
            _on(RunRetrying, _retrying),
            _on(RateWaited, _rate_waited),
            _on(HistoryReleased, _released),
            _on(RunRetried, _retried),
            _on(RunUpgraded, _upgraded),
            _on(StepsInvalidated, _steps_invalidated),
            _on(TimerSet, _timer_set),
            _on(TimerFired, _timer_fired),
            _on(RunResumed, _resumed),
            _on(RunForked, _forked),
        ]
    )
)
"""Each event class with a line of its own on the timeline, and what draws it."""
