"""The schedules' part of the API: what its routes accept and return (pydantic models, from which
the OpenAPI document's schemas are generated) and their paths in the document."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from toren._surfaces.http.api_doc import AUTH_FAIL, INVALID, ApiPart, json_content, problem
from toren._surfaces.http.models import AGENT_NAME, NO_NUL

Overlap = Literal["skip", "buffer_one", "buffer_all", "cancel_other", "allow_all"]
SLOT_NAME = r"^[a-z0-9][a-z0-9_-]{0,62}$"
Duration = float | str


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class ScheduleFields(_Strict):
    """A schedule's declaration: when it fires, what it starts, its policy."""

    cron: str | None = Field(
        default=None,
        description="A five-field cron expression (or `@daily`, `@hourly`, ...), read in "
        "`timezone`. Exactly one of `cron` and `every`.",
    )
    every: Duration | None = Field(
        default=None, description="An interval: seconds, or a duration such as `30m`, `1h30m`."
    )
    timezone: str = Field(default="UTC", description="An IANA time zone name.")
    jitter: Duration = Field(default=0.0, description="The most a slot's run is delayed.")
    start: str | None = Field(
        default=None, description="No slot before it: ISO-8601 with a UTC offset."
    )
    end: str | None = Field(default=None, description="No slot after it: ISO-8601 with an offset.")
    input: str = Field(
        default="{slot}",
        description="The runs' input, a template: `{slot}`, `{slot_utc}`, `{date}`, `{time}`, "
        "`{weekday}`, `{timezone}`, `{schedule}` (at most 64 KiB).",
    )
    concurrency_key: str | None = Field(
        default=None, description="The runs' concurrency key (at most 200 bytes, no NUL)."
    )
    overlap: Overlap = Field(
        default="skip", description="What a slot does while a run is in flight."
    )
    catch_up: Duration = Field(
        default=0.0, description="Slots missed while no worker ran are started up to this old."
    )
    pause_on_failure: bool = False


class CreateScheduleBody(ScheduleFields):
    agent: str = Field(min_length=1, max_length=100, pattern=AGENT_NAME)
    name: str = Field(
        min_length=1,
        max_length=63,
        pattern=SLOT_NAME,
        description="The schedule's own name among the agent's: it is `AGENT/NAME`.",
    )


class PauseBody(_Strict):
    reason: str = Field(default="", max_length=1000, pattern=NO_NUL)


class TriggerBody(_Strict):
    id: str | None = Field(
        default=None,
        pattern=r"^[A-Za-z0-9_.-]{1,64}$",
        description="Names the trigger: the same id again starts no second run.",
    )


class BackfillBody(_Strict):
    start: str = Field(description="From (excluded): ISO-8601 with a UTC offset.")
    end: str = Field(description="To (included, not in the future): ISO-8601 with an offset.")
    overlap: Overlap = "buffer_all"


class ScheduleDeclaration(BaseModel):
    """A schedule's declaration as stored (durations in seconds)."""

    name: str
    cron: str | None
    every: float | None
    timezone: str
    jitter: float
    start: str | None
    end: str | None
    input: str
    concurrency_key: str | None
    overlap: str
    catch_up: float
    pause_on_failure: bool


class ScheduleSlot(BaseModel):
    key: str = Field(description="The slot's instant in UTC (`manual-ID` for a trigger).")
    outcome: str = Field(description="`started`, `skipped` or `buffered`.")
    how: str = Field(description="`on_time`, `catch_up`, `buffered`, `manual` or `backfill`.")
    run: str | None
    run_status: str | None = Field(description="The run's status now (null: no run, or gone).")
    reason: str = Field(description="Why it started nothing.")


class Schedule(BaseModel):
    name: str = Field(description="`AGENT/SLOT`.")
    agent: str
    schedule: ScheduleDeclaration
    source: str = Field(description="`declared` (code or the settings file) or `api`.")
    paused: bool
    paused_reason: str
    next: list[str] = Field(
        description="The next fire times, ISO-8601 in the schedule's time zone (none while "
        "paused, or past its end)."
    )
    in_flight: list[str]
    buffered: int
    started: int
    skipped: int
    missed: int = Field(description="Slots missed while no worker ran (past the catch-up).")
    last_reason: str = Field(description="Why the last slot that started nothing did not.")
    recent: list[ScheduleSlot] = Field(description="The newest slots, oldest first.")


class ScheduleList(BaseModel):
    schedules: list[Schedule]


class ScheduleAccepted(BaseModel):
    schedule: str
    accepted: Literal[True] = True


class Triggered(BaseModel):
    schedule: str
    run: str = Field(description="The run's id (it starts at the schedule's next step).")


class Backfilled(BaseModel):
    schedule: str
    slots: int = Field(description="The slots in the range (those that ran already start none).")


_PARAMS = [
    {
        "name": "agent",
        "in": "path",
        "required": True,
        "schema": {"type": "string", "pattern": AGENT_NAME, "maxLength": 100},
    },
    {
        "name": "slot",
        "in": "path",
        "required": True,
        "description": "The schedule's own name.",
        "schema": {"type": "string", "pattern": SLOT_NAME},
    },
]
_NOT_FOUND = {"404": problem("No such schedule (or it was deleted).")}


def _change(summary: str, body: type[BaseModel] | None, ok: dict[str, Any]) -> dict[str, Any]:
    item: dict[str, Any] = {
        "summary": summary,
        "parameters": _PARAMS,
        "responses": {**ok, **AUTH_FAIL, **_NOT_FOUND, **INVALID},
    }
    if body is not None:
        item["requestBody"] = {"required": False, **json_content(body)}
    return item


def schedule_part() -> ApiPart:
    """The schedules' routes: list, create, read, delete, pause, resume, trigger, backfill."""
    accepted = {"202": {"description": "Sent to the schedule.", **json_content(ScheduleAccepted)}}
    paths = {
        "/schedules": {
            "get": {
                "summary": "List schedules (a token limited to agents sees theirs only)",
                "parameters": [
                    {
                        "name": "agent",
                        "in": "query",
                        "schema": {"type": "string", "pattern": AGENT_NAME, "maxLength": 100},
                    }
                ],
                "responses": {
                    "200": {"description": "By name.", **json_content(ScheduleList)},
                    **AUTH_FAIL,
                    "422": problem("`agent` is not an agent's name."),
                },
            },
            "post": {
                "summary": "Create a schedule (the same declaration again is a no-op)",
                "requestBody": {"required": True, **json_content(CreateScheduleBody)},
                "responses": {
                    "201": {"description": "The schedule, as declared.", **json_content(Schedule)},
                    **AUTH_FAIL,
                    **INVALID,
                    "409": problem("A schedule of that name exists with another declaration."),
                },
            },
        },
        "/schedules/{agent}/{slot}": {
            "get": {
                "summary": "A schedule: next fire times, recent slots and their runs",
                "parameters": _PARAMS,
                "responses": {
                    "200": {"description": "The schedule.", **json_content(Schedule)},
                    **AUTH_FAIL,
                    **_NOT_FOUND,
                },
            },
            "delete": _change("Delete the schedule (its runs in flight go on)", None, accepted),
        },
        "/schedules/{agent}/{slot}/pause": {
            "post": _change("Pause the schedule", PauseBody, accepted)
        },
        "/schedules/{agent}/{slot}/resume": {
            "post": _change("Resume the schedule from now", None, accepted)
        },
        "/schedules/{agent}/{slot}/trigger": {
            "post": _change(
                "Start a run now, whatever the slots",
                TriggerBody,
                {"202": {"description": "The run's id.", **json_content(Triggered)}},
            )
        },
        "/schedules/{agent}/{slot}/backfill": {
            "post": _change(
                "Start the slots of a past range",
                BackfillBody,
                {"202": {"description": "Sent to the schedule.", **json_content(Backfilled)}},
            )
        },
    }
    models = (CreateScheduleBody, PauseBody, TriggerBody, BackfillBody, ScheduleList, Schedule)
    return ApiPart(paths=paths, models=(*models, ScheduleAccepted, Triggered, Backfilled))
