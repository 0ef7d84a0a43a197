"""Listing runs from their summaries (kept on each run's actor row), without folding journals."""

from __future__ import annotations

from datetime import datetime
from typing import Any

import attrs

from toren._agent.routes import agent_route
from toren._core.client import Client
from toren._core.rows import actors_of_kind
from toren.runs.events import ENDED, RUN_KIND, STATUSES
from toren.runs.limits import QUEUED, queued
from toren.runs.version_listing import parked_reason, pinned_version, stranded


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
    queued_for: str | None = None  # status queued: the concurrency limit it waits for
    queue_position: int | None = None  # ... and where in its queue (1: next)
    version: str | None = None  # the agent version it is pinned to (None: not pinned)
    waiting_for: str | None = None  # parked on a version no live worker serves: the reason

    def to_json(self) -> dict[str, Any]:
        return {**attrs.asdict(self), "created_at": self.created_at.isoformat()}


async def list_runs(
    client: Client,
    *,
    status: str | None = None,
    agent: str | None = None,
    limit: int = 50,
    before: tuple[datetime, str] | None = None,
) -> list[RunRow]:
    """Runs, newest first; ``before`` is the ``(created_at, id)`` of the last run of the
    previous page. A run whose start is still queued shows as running, with no input yet; one
    that waits for a slot of a concurrency limit shows as ``queued``, with the limit and its
    place in line (one more query, for the page's runs that have not ended). One pinned to an
    agent version no live worker serves shows as ``parked``, with the reason (one more query,
    when the page holds such runs; a ``status`` filter reads the status the runs recorded).
    Each combination of filters is its own statement, planned for the index it can use (by
    status, by agent's route, newest first overall), the page's start included.

    Raises:
        ValueError: ``status`` is not a run status.
    """
    if status is not None and status not in STATUSES:
        raise ValueError(f"status must be one of {', '.join(STATUSES)}, not {status!r}")
    rows = await actors_of_kind(
        client.pool,
        RUN_KIND,
        fields=("summary",),
        run_status=status,
        route=None if agent is None else agent_route(agent),  # its pinned runs' routes too
        before=before,
        limit=limit,
    )
    out = []
    live = [r.actor_id for r in rows if r.summary_dict.get("status", "running") not in ENDED]
    waits = await queued(client, live)
    routes = {r.actor_id: r.route for r in rows}
    done = [r.actor_id for r in rows if r.summary_dict.get("status") == "completed"]
    stuck = await stranded(
        client,
        {rid: routes[rid] for rid in live},
        completed={rid: routes[rid] for rid in done},  # parked if a message waits
    )
    for r in rows:
        s = r.summary_dict
        wait = waits.get(r.actor_id)
        version = stuck.get(r.actor_id)
        status = s.get("status", "running")
        if wait is not None:
            status = QUEUED
        elif version is not None:
            status = "parked"
        out.append(
            RunRow(
                id=r.actor_id,
                agent=s.get("agent") or pinned_version(r.route)[0],
                status=status,
                input=s.get("input", ""),
                calls_made=s.get("calls_made", 0),
                usd_paid=s.get("usd_paid", "0"),
                error_class=s.get("error_class"),
                created_at=r.created_at,
                queued_for=wait.limit if wait is not None else None,
                queue_position=wait.position if wait is not None else None,
                version=pinned_version(r.route)[1],
                waiting_for=parked_reason(version) if version is not None else None,
            )
        )
    return out
