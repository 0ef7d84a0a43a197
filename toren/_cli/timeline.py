"""What ``toren jobs show`` prints of a run: the record ``--json`` gives and a line for each event
of its timeline (read from the journal, never folded again here)."""

from __future__ import annotations

import json
from typing import Any

from toren._core.journal import JournalEntry
from toren._core.terminal import printable
from toren.runs import RunState, receipt


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


def describe(event_type: str, data: dict[str, Any]) -> str:
    """One timeline line for an event, :func:`~toren._core.terminal.printable` (control characters,
    bidi controls, NUL and lone surrogates shown as escapes), its line breaks shown as ``\\n``
    so that no text in a run can make a line that looks like another event."""
    return printable(_describe(event_type, data)).replace("\n", "\\n")


def _compacted(data: dict[str, Any]) -> str:
    why = "the provider refused the request as too large" if data["reason"] == "refused" else ""
    what = f"{data['elided']} tool results elided" if data.get("elided") else ""
    if data["tier"] == "hard":
        summary = data.get("summary") or {}
        usage = summary.get("usage") or {"input_tokens": 0, "output_tokens": 0}
        cost = f"${data['cost_usd']}" if data.get("cost_usd") else "unpriced"
        what = ", ".join(
            x
            for x in (
                what,
                f"{data['summarised']} messages summarised by {data['model']} "
                f"({usage['input_tokens']} in, {usage['output_tokens']} out, {cost}, "
                f"{data['latency_ms']} ms)",
            )
            if x
        )
    return (
        f"context compacted ({data['tier']}{'; ' + why if why else ''}): about "
        f"{data['tokens_before']} -> {data['tokens_after']} input tokens; {what}"
    )


def _describe(event_type: str, data: dict[str, Any]) -> str:
    if event_type == "model.called":
        usage = data["response"]["usage"]
        cost = f"${data['cost_usd']}" if data.get("cost_usd") else "unpriced"
        calls = [b["name"] for b in data["response"]["content"] if "name" in b]
        asked = f" -> {', '.join(calls)}" if calls else ""
        return (
            f"model call {data['step']} ({data['model']}): {usage['input_tokens']} in, "
            f"{usage['output_tokens']} out, {cost}, {data['latency_ms']} ms{asked}"
        )
    if event_type == "model.calling":
        cost = f"${data['cost_usd']}" if data.get("cost_usd") else "unpriced"
        return (
            f"model call {data['step']} ({data['model']}) next: about "
            f"{data['input_tokens']} input tokens, {cost} estimated"
        )
    if event_type == "model.lost":
        cost = f"${data['cost_usd']}" if data.get("cost_usd") else "unpriced"
        times = "once" if data["count"] == 1 else f"{data['count']} times"
        return (
            f"model call {data['step']} ({data['model']}) lost in flight {times}: its worker "
            f"stopped before recording the answer; the provider may have billed it (about "
            f"{cost} estimated)"
        )
    if event_type == "tool.intent":
        return f"tool {data['name']} intent {json.dumps(data['arguments'])}"
    if event_type == "tool.result":
        mark = "denied" if data.get("denied") else "error" if data.get("is_error") else "result"
        cut = f" (cut from {data['truncated_from']} bytes)" if data.get("truncated_from") else ""
        return f"tool {mark}{cut}: {data['content'][:120]}"
    if event_type == "approval.requested":
        where = f" in {data['cwd']}" if data.get("cwd") else ""
        return f"approval requested for {data['name']} {json.dumps(data['arguments'])}{where}"
    if event_type == "sandbox.requested":
        return f"call {data['call_id']} sent to the sandbox {data['sandbox']}"
    if event_type == "sandbox.noted":
        return f"sandbox: {data['text']}"
    if event_type == "sandbox.failed":
        return f"sandbox failed: {data['error']}"
    if event_type == "approval.decided":
        verdict = "approved" if data["approved"] else "denied"
        reason = f" ({data['reason']})" if data.get("reason") else ""
        return f"{verdict} by {data['who']} via {data['channel']}{reason}"
    if event_type == "decision.refused":
        verdict = "approval" if data["approved"] else "denial"
        return (
            f"{verdict} of call {data['call_id']} by {data['who']} via {data['channel']} "
            f"refused ({data['outcome'].replace('_', ' ')}); not recorded as a decision"
        )
    if event_type == "decision.refusals_muted":
        return (
            f"{data['recorded']} decisions refused within the hour: those refused in the "
            f"{int(data['until'] - data['at'])} s after this are answered but not recorded"
        )
    if event_type == "child.started":
        return f"child run {data['run_id']} of {data['agent']} started (call {data['call_id']})"
    if event_type == "child.finished":
        how = data["status"] + (f" [{data['error_class']}]" if data.get("error_class") else "")
        return f"child run {data['run_id']} {how}, ${data['usd_paid']}"
    if event_type == "child.approval_requested":
        return (
            f"child run {data['run_id']} ({data['agent']}) asks approval for {data['name']} "
            f"{json.dumps(data['arguments'])} (call {data['child_call_id']})"
        )
    if event_type == "context.compacted":
        return _compacted(data)
    if event_type == "run.failed":
        if data["error_class"] == "cancelled":  # a cancel ends the run with its own status
            return f"cancelled: {data['message']}"
        return f"failed [{data['error_class']}]: {data['message']}"
    if event_type == "toren.failed":
        return f"failed [{data['error_class']}]: {data['error']}"
    if event_type == "run.completed":
        return f"completed: {data['output'][:200]}"
    if event_type == "run.started":
        return f"started {data['agent']}: {data['input'][:200]}"
    if event_type == "message.received":
        return f"message from {data['who']}: {data['text'][:200]}"
    if event_type == "run.retrying":
        return f"attempt {data['attempt']} failed, retrying in {data['delay']:g}s: {data['error']}"
    if event_type == "run.retried":
        return f"retried by {data['who']}"
    if event_type == "steps.invalidated":
        return f"steps from {data['from_step']} invalidated: {data['reason']}"
    if event_type == "timer.set":
        return f"sleeping {data['seconds']:g}s (durable timer)"
    if event_type == "timer.fired":
        return "woke up"
    if event_type == "run.resumed":
        return f"resumed from the journal ({data['replayed']} calls replayed, not re-paid)"
    return event_type
