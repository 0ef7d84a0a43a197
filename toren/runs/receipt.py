"""A run's receipt: what it cost, read from the totals its state keeps as calls are recorded."""

from __future__ import annotations

from decimal import Decimal
from typing import TYPE_CHECKING

import attrs

from toren.runs.release_events import cumulative

if TYPE_CHECKING:
    from toren.runs.state import RunState


@attrs.frozen(kw_only=True)
class Receipt:
    """What a run cost: calls made and replayed, tokens, dollars paid and not re-paid, and the
    calls lost in flight with their estimated cost."""

    calls_made: int
    calls_replayed: int
    input_tokens: int
    output_tokens: int
    usd_paid: Decimal
    usd_not_repaid: Decimal
    unpriced_calls: int
    # what the runs this one started by cross-agent calls cost (each child once, as of its
    # end, its own children included); ``usd_total`` is this run's and its children's
    child_runs: int = 0
    child_calls_made: int = 0
    child_input_tokens: int = 0
    child_output_tokens: int = 0
    child_usd_paid: Decimal = Decimal(0)
    child_unpriced_calls: int = 0
    # context compactions made (each a soft or a hard one) and the input tokens they took out
    # of the requests that triggered them (estimated: before less after, summed)
    compactions_soft: int = 0
    compactions_hard: int = 0
    tokens_saved: int = 0
    # model calls lost in flight: sent by a worker that stopped before recording the answer, and
    # made again (see ModelLost); not in ``calls_made``. The provider may have billed each: what
    # they cost is estimated (their estimated input at the model's price), never in usd_paid.
    calls_lost: int = 0
    usd_lost_estimated: Decimal = Decimal(0)
    child_calls_lost: int = 0
    child_usd_lost_estimated: Decimal = Decimal(0)
    # a fork's calls taken by value from the run it was forked from, and what they cost there:
    # not made or paid by the fork (not in ``calls_made`` or ``usd_paid``), counted in
    # ``calls_replayed`` and ``usd_not_repaid``
    calls_inherited: int = 0
    usd_inherited: Decimal = Decimal(0)

    @property
    def usd_total(self) -> Decimal:
        """Dollars paid by this run and by the child runs it started."""
        return self.usd_paid + self.child_usd_paid


def receipt(state: RunState) -> Receipt:
    """The receipt of a run as recorded so far (from totals the fold keeps: no walk over its
    calls)."""
    marks = state.cost_marks
    replayed = min(state.replayed, len(state.kept_cost))
    compactions = min(state.compactions_replayed, len(state.compaction_cost))
    not_repaid = cumulative(state.kept_cost, replayed, marks, "kept")
    # summary calls served from the journal are not paid again either
    not_repaid += cumulative(state.compaction_cost, compactions, marks, "compaction")
    inherited = state.forked.calls if state.forked else 0
    made = len(state.voided) + len(state.calls) - inherited
    paid_there = min(inherited, len(state.kept_cost))
    return Receipt(
        calls_made=made + state.unreadable + state.summary_calls,
        calls_replayed=state.replayed,
        input_tokens=state.input_tokens,
        output_tokens=state.output_tokens,
        usd_paid=state.usd_paid,
        usd_not_repaid=not_repaid,
        unpriced_calls=state.unpriced + state.unreadable,
        child_runs=state.child_runs,
        child_calls_made=state.child_calls,
        child_input_tokens=state.child_input_tokens,
        child_output_tokens=state.child_output_tokens,
        child_usd_paid=state.child_usd,
        child_unpriced_calls=state.child_unpriced,
        compactions_soft=state.compactions_soft,
        compactions_hard=state.compactions_hard,
        tokens_saved=state.tokens_saved,
        calls_lost=state.lost_calls,
        usd_lost_estimated=state.lost_usd,
        child_calls_lost=state.child_lost_calls,
        child_usd_lost_estimated=state.child_lost_usd,
        calls_inherited=inherited,
        usd_inherited=cumulative(state.kept_cost, paid_there, marks, "kept"),
    )
