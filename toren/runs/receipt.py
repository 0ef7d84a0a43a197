"""A run's receipt: what it cost, read from the totals its state keeps as calls are recorded."""

from __future__ import annotations

from decimal import Decimal
from typing import TYPE_CHECKING

import attrs

if TYPE_CHECKING:
    from toren.runs.state import RunState


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
    """The receipt of a run as recorded so far (from totals the fold keeps: no walk over its
    calls)."""
    replayed = min(state.replayed, len(state.kept_cost))
    return Receipt(
        calls_made=len(state.voided) + len(state.calls) + state.unreadable,
        calls_replayed=state.replayed,
        input_tokens=state.input_tokens,
        output_tokens=state.output_tokens,
        usd_paid=state.usd_paid,
        usd_not_repaid=state.kept_cost[replayed - 1] if replayed else Decimal(0),
        unpriced_calls=state.unpriced + state.unreadable,
    )
