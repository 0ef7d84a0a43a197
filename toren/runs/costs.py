"""What runs cost, by agent and by day, pruned or not: ``GET /costs`` and ``toren costs``.

Each run counts once, under its own agent and the UTC day its row was made: its own calls,
tokens and dollars (a parent's receipt also shows what its children cost; here each child is
counted under its own agent, so nothing is counted twice). Live runs are summed from their rows'
summaries (what each step records: no journal is read), pruned runs from their audit records
(:mod:`toren.runs.audit`); dollars are decimals summed in Postgres ``numeric``, exactly, so the
totals are the same before and after a prune.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import date, datetime
from decimal import Decimal
from typing import TYPE_CHECKING, Any, Literal

import attrs

from toren._core.db import one_snapshot
from toren._core.errors import TorenError
from toren._core.pruning import json_integer, summary_totals
from toren.runs.events import RUN_KIND

if TYPE_CHECKING:
    from toren._core.rows import Db

Group = Literal["agent", "day"]
_COUNTS = ("calls_made", "input_tokens", "output_tokens")  # a run's integers, summed
GROUPS: tuple[Group, ...] = ("agent", "day")


class InvalidCosts(TorenError):
    """A costs query that cannot be answered (a grouping that is not ``agent`` or ``day``)."""

    def __init__(self, detail: str) -> None:
        self.detail = detail
        super().__init__(detail)


@attrs.frozen(kw_only=True)
class CostRow:
    """The runs of one agent (and/or one day) and what they cost.

    Attributes:
        agent: The agent (``None`` when not grouped by agent).
        day: The UTC day the runs were started (``None`` when not grouped by day).
        runs: Runs counted, of which ``pruned`` from audit records.
        calls_made: Model calls made (paid).
        input_tokens: Input tokens; ``output_tokens`` output tokens. (Runs that took no step
            since this version count 0 until their next step.)
        usd_paid: Dollars paid, exact.
    """

    agent: str | None
    day: date | None
    runs: int
    pruned: int
    calls_made: int
    input_tokens: int
    output_tokens: int
    usd_paid: Decimal

    def to_json(self) -> dict[str, Any]:
        """As the API answers it (dollars as a decimal string, the day as ``YYYY-MM-DD``)."""
        return {
            "agent": self.agent,
            "day": self.day.isoformat() if self.day is not None else None,
            "runs": self.runs,
            "pruned": self.pruned,
            "calls_made": self.calls_made,
            "input_tokens": self.input_tokens,
            "output_tokens": self.output_tokens,
            "usd_paid": str(self.usd_paid),
        }


def groups(text: str | Sequence[str]) -> tuple[Group, ...]:
    """``"agent,day"`` (or a list) as groupings, checked.

    Raises:
        InvalidCosts: one is not ``agent`` or ``day``, or one is given twice.
    """
    names = [n.strip() for n in text.split(",")] if isinstance(text, str) else list(text)
    names = [n for n in names if n]
    if any(n not in GROUPS for n in names) or len(set(names)) != len(names):
        raise InvalidCosts("by must list agent and/or day, once each (by=agent,day)")
    return tuple(n for n in GROUPS if n in names)


_AUDIT = f"""
SELECT {{keys}} count(*) AS runs,
       coalesce(sum({json_integer("receipt", "calls_made")}), 0) AS calls_made,
       coalesce(sum({json_integer("receipt", "input_tokens")}), 0) AS input_tokens,
       coalesce(sum({json_integer("receipt", "output_tokens")}), 0) AS output_tokens,
       sum(coalesce((receipt->>'usd_paid')::numeric, 0)) AS usd_paid
FROM toren.run_audit
WHERE ($1::timestamptz IS NULL OR created_at >= $1) AND ($2::timestamptz IS NULL OR created_at < $2)
{{grouped}}
"""


def _zero() -> dict[str, Any]:
    """A :class:`CostRow`'s figures before any run is counted."""
    return {"runs": 0, "pruned": 0, **dict.fromkeys(_COUNTS, 0), "usd_paid": Decimal(0)}


async def costs(
    db: Db,
    by: Sequence[Group] = ("agent",),
    *,
    since: datetime | None = None,
    until: datetime | None = None,
) -> list[CostRow]:
    """Runs started in ``[since, until)`` and what they cost, grouped ``by`` agent and/or day
    (neither: one row of totals), ordered by agent then day."""
    by = groups(list(by))
    keys = []
    if "agent" in by:
        keys.append("agent AS group_key")
    if "day" in by:
        keys.append("(created_at AT TIME ZONE 'UTC')::date AS day")
    grouped = f"GROUP BY {', '.join(str(i + 1) for i in range(len(keys)))}" if keys else ""
    # Both sums in one snapshot: a prune (or a restore) commits the audit record and the
    # run's row going (or coming) at once, and two snapshots would see a run in neither
    # (its cost lost) or in both (counted twice).
    async with one_snapshot(db) as conn:
        audit = await conn.fetch(
            _AUDIT.format(keys="".join(f"{k}, " for k in keys), grouped=grouped), since, until
        )
        live = await summary_totals(
            conn,
            kind=RUN_KIND,
            group_arg="agent" if "agent" in by else None,
            by_day="day" in by,
            decimals=("usd_paid",),
            integers=_COUNTS,
            since=since,
            until=until,
        )
    totals: dict[tuple[str | None, date | None], dict[str, Any]] = {}
    for row, pruned in [(dict(r), True) for r in audit] + [(r, False) for r in live]:
        key = (row.get("group_key"), row.get("day"))
        into = totals.setdefault(key, _zero())
        n = int(row["runs"] if pruned else row["actors"])
        into["runs"] += n
        into["pruned"] += n if pruned else 0
        for k in _COUNTS:
            into[k] += int(row[k] or 0)
        into["usd_paid"] += Decimal(row["usd_paid"] or 0)
    if not by and not totals:
        totals[(None, None)] = _zero()
    return [
        CostRow(agent=agent, day=day, **values)
        for (agent, day), values in sorted(
            totals.items(), key=lambda kv: (kv[0][0] or "", kv[0][1] or date.min)
        )
    ]
