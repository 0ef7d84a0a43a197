"""A run's receipt as ``toren jobs show`` (and ``toren jobs restore``) print it: one line."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from toren.runs.receipt import Receipt


def receipt_line(r: Receipt) -> str:
    """``receipt: N calls made, ...``: what the run made, replayed, paid, lost and compacted,
    and its child runs' share (each part only when there is something to say)."""
    return (
        f"receipt: {r.calls_made} calls made, "
        f"{r.calls_replayed} replayed; {r.input_tokens} in / {r.output_tokens} out "
        f"tokens; ${r.usd_paid} paid, ${r.usd_not_repaid} not re-paid"
        + (f"; {r.unpriced_calls} unpriced" if r.unpriced_calls else "")
        + (
            f"; {r.calls_lost} lost in flight (about "
            f"${r.usd_lost_estimated} estimated, not in paid)"
            if r.calls_lost
            else ""
        )
        + (
            f"; compactions: {r.compactions_soft} soft, {r.compactions_hard} hard, "
            f"about {r.tokens_saved} input tokens saved"
            if r.compactions_soft or r.compactions_hard
            else ""
        )
        + (
            f"; child runs: {r.child_runs}, {r.child_calls_made} calls, "
            f"${r.child_usd_paid} (total ${r.usd_total})"
            + (
                f", {r.child_calls_lost} lost in flight (about "
                f"${r.child_usd_lost_estimated} estimated)"
                if r.child_calls_lost
                else ""
            )
            if r.child_runs
            else ""
        )
    )
