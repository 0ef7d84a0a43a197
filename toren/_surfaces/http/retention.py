"""The retention kind's routes: ``GET /costs`` (what runs cost, pruned or not), and a pruned
run as ``GET /runs/{id}`` shows it (from its audit record: :func:`pruned_run`)."""

from __future__ import annotations

from datetime import UTC, date, datetime
from typing import TYPE_CHECKING, Any

from aiohttp import web
from pydantic import BaseModel, Field

from toren._surfaces.http.api_doc import API_PARTS, AUTH_FAIL, ApiPart, json_content, problem
from toren._surfaces.http.common import CLIENT, ProblemError, json
from toren._surfaces.http.models import FieldError, Pruned, Receipt, Run, ScheduledBy
from toren.runs.audit import audit_record
from toren.runs.costs import InvalidCosts, costs, groups

if TYPE_CHECKING:
    import asyncpg

BY = ("agent", "day", "agent,day", "day,agent", "")
"""What ``by`` may be (empty: one row of totals)."""


class Cost(BaseModel):
    agent: str | None = Field(description="The agent (null when not grouped by agent).")
    day: str | None = Field(description="The UTC day, YYYY-MM-DD (null when not by day).")
    runs: int = Field(description="Runs started, live and pruned.")
    pruned: int = Field(description="Of which pruned (counted from their audit records).")
    calls_made: int
    input_tokens: int
    output_tokens: int
    usd_paid: str = Field(description="Dollars paid, exact (a decimal).")


class CostList(BaseModel):
    costs: list[Cost]


def install(app: web.Application) -> None:
    """``GET /costs`` (the ``read`` scope, as every read)."""
    app[API_PARTS].append(cost_part())
    app.router.add_get("/costs", show_costs)


def _moment(request: web.Request, name: str) -> datetime | None:
    """``since``/``until``: a date (``YYYY-MM-DD``), midnight UTC."""
    text = request.query.get(name)
    if text is None:
        return None
    try:
        day = date.fromisoformat(text)
    except ValueError:
        error = FieldError(field=name, message="a date, YYYY-MM-DD (UTC)")
        raise ProblemError(422, "Invalid request", f"{name} is not a date", [error]) from None
    return datetime(day.year, day.month, day.day, tzinfo=UTC)


async def show_costs(request: web.Request) -> web.Response:
    """Runs started in ``[since, until)`` and what they cost, ``by`` agent and/or day."""
    try:
        by = groups(request.query.get("by", "agent"))
    except InvalidCosts as exc:
        error = FieldError(field="by", message=str(exc))
        raise ProblemError(422, "Invalid request", str(exc), [error]) from None
    since, until = _moment(request, "since"), _moment(request, "until")
    rows = await costs(request.app[CLIENT].pool, by, since=since, until=until)
    return json(CostList(costs=[Cost(**r.to_json()) for r in rows]))


async def pruned_run(pool: asyncpg.Pool, rid: str) -> Run | None:
    """Run ``rid`` as its audit record shows it (``None``: it was not pruned)."""
    record = await audit_record(pool, rid)
    if record is None:
        return None
    args = record.args
    schedule, slot = args.get("schedule"), args.get("slot")
    kept: dict[str, Any] = dict(record.receipt)
    fields = set(Receipt.model_fields)
    return Run(
        id=rid,
        agent=record.agent,
        status=record.status,  # type: ignore[arg-type]
        input="",
        output=None,
        error_class=record.error_class,
        error=record.error,
        created_at=record.created_at.isoformat(),
        waiting_on=[],
        receipt=Receipt(**{k: v for k, v in kept.items() if k in fields}),
        parent=record.parent,
        schedule=ScheduledBy(name=schedule, slot=slot)
        if isinstance(schedule, str) and isinstance(slot, str)
        else None,
        concurrency_key=args.get("concurrency_key"),
        version=record.version or None,
        pruned=Pruned(
            pruned_at=record.pruned_at.isoformat() if record.pruned_at else "",
            events=record.events,
            archive=record.archive_json(),
            started_by=dict(record.started_by) if record.started_by else None,
            decisions=[dict(d) for d in record.decisions],
        ),
    )


def pruned_problem(exc: Exception) -> ProblemError:
    """A write to a pruned run: 409, saying when it was pruned."""
    return ProblemError(409, "Conflict", str(exc))


def cost_part() -> ApiPart:
    """``GET /costs`` in the OpenAPI document."""
    params = [
        {
            "name": "by",
            "in": "query",
            "description": "`agent`, `day`, `agent,day` (default `agent`), or empty for totals.",
            "schema": {"type": "string", "enum": list(BY)},
        },
        *(
            {
                "name": name,
                "in": "query",
                "description": f"Runs started {how} this day (UTC).",
                "schema": {"type": "string", "format": "date"},
            }
            for name, how in (("since", "on or after"), ("until", "before"))
        ),
    ]
    paths = {
        "/costs": {
            "get": {
                "summary": "What runs cost, by agent and/or day: live and pruned runs alike",
                "parameters": params,
                "responses": {
                    "200": {"description": "One row per group.", **json_content(CostList)},
                    **AUTH_FAIL,
                    "422": problem("`by` names other than agent and day, or a date is not one."),
                },
            }
        }
    }
    return ApiPart(paths=paths, models=(Cost, CostList))
