"""Where a fork came from, as the surfaces show it: the run and step it was forked at (its row's
``args.forked_from``, written when the fork was made) and what its copied prefix saved (the
calls it took by value, never paid again, and what they had cost the source)."""

from __future__ import annotations

from collections.abc import Mapping
from decimal import Decimal
from typing import TYPE_CHECKING, Any

import attrs

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


def forked_from(args: Mapping[str, Any], state: RunState) -> ForkedFrom | None:
    """Where the run with these row ``args`` and this ``state`` was forked from, or ``None``
    for a run that is not a fork."""
    origin = args.get("forked_from")
    if not isinstance(origin, dict):
        return None
    run, step = origin.get("run"), origin.get("step")
    if not isinstance(run, str) or not isinstance(step, int) or isinstance(step, bool):
        return None
    # The calls the fork took by value are the first ones it keeps; their cost is the running
    # total the fold keeps call by call.
    kept = min(state.settled_calls, len(state.kept_cost))
    saved = state.kept_cost[kept - 1] if kept else Decimal(0)
    return ForkedFrom(run=run, step=step, calls_replayed=kept, usd_not_repaid=saved)
