"""Listing runs from their summaries (kept on each run's actor row), without folding journals."""

from __future__ import annotations

from datetime import datetime
from typing import Any

import attrs

from toren._core.client import Client
from toren.runs.events import STATUSES


@attrs.frozen(kw_only=True)
class RunRow:
    """One run as a list shows it."""

    id: str
    agent: str
    status: str
    input: str  # the first 200 characters
    calls_made: int
    usd_paid: str
    error_class: str | None
    created_at: datetime

    def to_json(self) -> dict[str, Any]:
        return {**attrs.asdict(self), "created_at": self.created_at.isoformat()}


def _statement(
    status: str | None, agent: str | None, before: tuple[datetime, str] | None, limit: int
) -> tuple[str, list[Any]]:
    """The statement for these filters and its arguments: one statement per combination, so
    that each is planned for the index it can use (by status, by agent's route, newest first
    overall), the page's start included (an ``x IS NULL OR`` form could use none of them)."""
    where, args = ["kind = 'toren.run'"], []

    def arg(value: Any) -> str:
        args.append(value)
        return f"${len(args)}"

    if status is not None:
        where.append(f"run_status = {arg(status)}")
    if agent is not None:
        where.append(f"route = 'agent:' || {arg(agent)}")
    if before is not None:
        where.append(f"(created_at, actor_id) < ({arg(before[0])}::timestamptz, {arg(before[1])})")
    sql = (
        "SELECT actor_id, route, created_at, summary FROM toren.actors WHERE "
        + " AND ".join(where)
        + f" ORDER BY created_at DESC, actor_id DESC LIMIT {arg(limit)}"
    )
    return sql, args


async def list_runs(
    client: Client,
    *,
    status: str | None = None,
    agent: str | None = None,
    limit: int = 50,
    before: tuple[datetime, str] | None = None,
) -> list[RunRow]:
    """Runs, newest first; ``before`` is the ``(created_at, id)`` of the last run of the
    previous page. A run whose start is still queued shows as running, with no input yet.

    Raises:
        ValueError: ``status`` is not a run status.
    """
    if status is not None and status not in STATUSES:
        raise ValueError(f"status must be one of {', '.join(STATUSES)}, not {status!r}")
    sql, args = _statement(status, agent, before, limit)
    rows = await client.pool.fetch(sql, *args)
    out = []
    for r in rows:
        s = r["summary"] or {}
        out.append(
            RunRow(
                id=r["actor_id"],
                agent=s.get("agent") or (r["route"] or "").removeprefix("agent:"),
                status=s.get("status", "running"),
                input=s.get("input", ""),
                calls_made=s.get("calls_made", 0),
                usd_paid=s.get("usd_paid", "0"),
                error_class=s.get("error_class"),
                created_at=r["created_at"],
            )
        )
    return out
