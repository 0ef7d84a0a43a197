"""The schedule endpoints: list, create, read, delete, pause, resume, trigger, backfill.

Reading asks for the ``read`` scope, every change for ``operate``; a token limited to some
agents reads and manages only those agents' schedules (the listing leaves out the others; a
schedule of another agent is ``403``). Bad input is ``422`` naming the field and stores
nothing; an unknown schedule ``404``; a name taken by another declaration ``409``.
"""

from __future__ import annotations

import re

from aiohttp import web

from toren._core.clock import Clock
from toren._surfaces.http import schedule_api as api
from toren._surfaces.http.common import (
    CLIENT,
    ROUTE_ACCESS,
    ProblemError,
    access,
    json,
    principal,
    read_body,
    require,
)
from toren._surfaces.http.models import AGENT_NAME, FieldError
from toren._surfaces.http.openapi import API_PARTS
from toren.runs import AgentNotServed
from toren.schedules import ScheduleError
from toren.schedules.client import (
    ScheduleExists,
    ScheduleNotFound,
    ScheduleView,
    backfill,
    create,
    delete,
    full_name,
    list_schedules,
    local_time,
    next_fires,
    pause,
    resume,
    schedule_of,
    show,
    split_name,
    trigger,
)
from toren.schedules.spec import aware

_ONE = "/schedules/{agent}/{slot}"
_VERBS = ("pause", "resume", "trigger", "backfill")


def install(app: web.Application) -> None:
    """The schedule kind's routes; every change asks for ``operate``."""
    app[API_PARTS].append(api.schedule_part())
    app[ROUTE_ACCESS].ask(
        {
            ("POST", "/schedules"): "operate",
            ("DELETE", _ONE): "operate",
            **{("POST", f"{_ONE}/{verb}"): "operate" for verb in _VERBS},
        }
    )
    app.router.add_get("/schedules", listing)
    app.router.add_post("/schedules", create_schedule)
    app.router.add_get(_ONE, show_schedule)
    app.router.add_delete(_ONE, delete_schedule)
    app.router.add_post(f"{_ONE}/pause", pause_schedule)
    app.router.add_post(f"{_ONE}/resume", resume_schedule)
    app.router.add_post(f"{_ONE}/trigger", trigger_schedule)
    app.router.add_post(f"{_ONE}/backfill", backfill_schedule)


def _invalid(exc: ScheduleError) -> ProblemError:
    error = FieldError(field=exc.field, message=exc.detail)
    return ProblemError(422, "Invalid request", str(exc), [error])


def _named(request: web.Request, scope: str) -> str:
    """The schedule the path names, once the caller may ``scope`` its agent's schedules.

    Raises:
        ProblemError: 404 a name no schedule can have; 403 (see :func:`require`).
    """
    agent, slot = request.match_info["agent"], request.match_info["slot"]
    name = full_name(agent, slot)
    try:
        split_name(name)
    except ScheduleError as exc:
        raise ProblemError(404, "Not found", f"no schedule {name[:200]!r}") from exc
    require(request, scope, agent)
    return name


def view(v: ScheduleView) -> api.Schedule:
    """A schedule as the API shows it: its next fire times in its own time zone."""
    zone = str(v.schedule.get("timezone") or "UTC")
    return api.Schedule(
        name=v.name,
        agent=v.agent,
        schedule=api.ScheduleDeclaration.model_validate(v.schedule),
        source=v.source,
        paused=v.paused,
        paused_reason=v.paused_reason,
        next=[local_time(t, zone).isoformat() for t in v.next],
        in_flight=v.in_flight,
        buffered=v.buffered,
        started=v.started,
        skipped=v.skipped,
        missed=v.missed,
        last_reason=v.last_reason,
        recent=[api.ScheduleSlot.model_validate(s, from_attributes=True) for s in v.recent],
    )


async def listing(request: web.Request) -> web.Response:
    agent = request.query.get("agent")
    if agent is not None and (len(agent) > 100 or not re.fullmatch(AGENT_NAME, agent)):
        error = FieldError(field="agent", message="an agent name: letters, digits, _ . -")
        raise ProblemError(422, "Invalid request", "invalid query parameters", [error])
    caller = access(request)
    views = await list_schedules(request.app[CLIENT], agent=agent)
    shown = [view(v) for v in views if caller.may_write(v.agent)]
    return json(api.ScheduleList(schedules=shown))


async def create_schedule(request: web.Request) -> web.Response:
    body = await read_body(request, api.CreateScheduleBody)
    require(request, "operate", body.agent)
    fields = body.model_dump(exclude={"agent", "name"}, exclude_unset=True)
    client = request.app[CLIENT]
    try:
        schedule = schedule_of(body.name, fields)
        name = await create(client, body.agent, schedule, by=principal(request))
    except ScheduleError as exc:
        raise _invalid(exc) from exc
    except AgentNotServed as exc:
        error = FieldError(field="agent", message="no live worker runs this agent")
        raise ProblemError(422, "Unknown agent", str(exc), [error]) from exc
    except ScheduleExists as exc:
        raise ProblemError(409, "Conflict", str(exc)) from exc
    try:
        return json(view(await show(client, name)), status=201)
    except ScheduleNotFound:
        pass  # not taken by a worker yet: shown as declared
    declared = ScheduleView(
        name=name,
        agent=body.agent,
        schedule=schedule.to_json(),
        source="api",
        paused=False,
        paused_reason="",
        next=next_fires(schedule, Clock().now()),
        in_flight=[],
        buffered=0,
        started=0,
        skipped=0,
        missed=0,
        last_reason="",
        recent=[],
    )
    return json(view(declared), status=201)


async def show_schedule(request: web.Request) -> web.Response:
    name = _named(request, "read")
    try:
        found = await show(request.app[CLIENT], name)
    except ScheduleNotFound as exc:
        raise ProblemError(404, "Not found", str(exc)) from exc
    return json(view(found))


async def delete_schedule(request: web.Request) -> web.Response:
    name = _named(request, "operate")
    try:
        await delete(request.app[CLIENT], name, by=principal(request))
    except ScheduleNotFound as exc:
        raise ProblemError(404, "Not found", str(exc)) from exc
    return json(api.ScheduleAccepted(schedule=name), status=202)


async def pause_schedule(request: web.Request) -> web.Response:
    name = _named(request, "operate")
    body = await read_body(request, api.PauseBody)
    try:
        await pause(request.app[CLIENT], name, by=principal(request), reason=body.reason)
    except ScheduleError as exc:
        raise _invalid(exc) from exc
    except ScheduleNotFound as exc:
        raise ProblemError(404, "Not found", str(exc)) from exc
    return json(api.ScheduleAccepted(schedule=name), status=202)


async def resume_schedule(request: web.Request) -> web.Response:
    name = _named(request, "operate")
    try:
        await resume(request.app[CLIENT], name, by=principal(request))
    except ScheduleNotFound as exc:
        raise ProblemError(404, "Not found", str(exc)) from exc
    return json(api.ScheduleAccepted(schedule=name), status=202)


async def trigger_schedule(request: web.Request) -> web.Response:
    name = _named(request, "operate")
    body = await read_body(request, api.TriggerBody)
    try:
        run = await trigger(request.app[CLIENT], name, by=principal(request), id=body.id)
    except ScheduleError as exc:
        raise _invalid(exc) from exc
    except ScheduleNotFound as exc:
        raise ProblemError(404, "Not found", str(exc)) from exc
    return json(api.Triggered(schedule=name, run=run), status=202)


async def backfill_schedule(request: web.Request) -> web.Response:
    name = _named(request, "operate")
    body = await read_body(request, api.BackfillBody)
    try:
        start, end = aware("start", body.start), aware("end", body.end)
        count = await backfill(
            request.app[CLIENT],
            name,
            start.timestamp(),
            end.timestamp(),
            overlap=body.overlap,
            by=principal(request),
        )
    except ScheduleError as exc:
        raise _invalid(exc) from exc
    except ScheduleNotFound as exc:
        raise ProblemError(404, "Not found", str(exc)) from exc
    return json(api.Backfilled(schedule=name, slots=count), status=202)
