"""Where a fork came from, as the surfaces show it: the run and step it was forked at (its
``run.forked`` event) and what its copied prefix saved (the calls it took by value, never paid
again, and what they had cost the source: its receipt's ``calls_inherited`` and
``usd_inherited``)."""

from __future__ import annotations

from decimal import Decimal
from typing import TYPE_CHECKING, Any

import attrs

from toren.runs.receipt import receipt

if TYPE_CHECKING:
    from toren.runs.state import RunState


@attrs.frozen(kw_only=True)
class ForkedFrom:
    """A fork's origin and what its prefix saved.

    Attributes:
        run: The run it was forked from (``run/<uuid>``).
        step: The step it was forked at: the first model call it made again (as ``toren jobs
            show`` numbers them).
        calls_replayed: The calls of the source it took by value (not paid again).
        usd_not_repaid: What those calls had cost.
    """

    run: str
    step: int
    calls_replayed: int
    usd_not_repaid: Decimal

    def line(self) -> str:
        """``forked from RUN at step K (N calls replayed, $X not paid again)``."""
        calls = "call" if self.calls_replayed == 1 else "calls"
        return (
            f"forked from {self.run} at step {self.step} ({self.calls_replayed} {calls} "
            f"replayed, ${self.usd_not_repaid} not paid again)"
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "run": self.run,
            "step": self.step,
            "calls_replayed": self.calls_replayed,
            "usd_not_repaid": str(self.usd_not_repaid),
        }


def forked_from(state: RunState) -> ForkedFrom | None:
    """Where the run whose state is ``state`` was forked from, or ``None`` if it is not a
    fork."""
    if state.forked is None:
        return None
    r = receipt(state)
    return ForkedFrom(
        run=state.forked.source,
        step=state.forked.step,
        calls_replayed=r.calls_inherited,
        usd_not_repaid=r.usd_inherited,
    )
