"""``POST /runs/{run}/fork``: a new run from a step of another (as ``toren jobs fork``)."""

from __future__ import annotations

import json as stdjson
from typing import Any, NoReturn

import orjson
from aiohttp import web

from toren._core.errors import UnknownActor
from toren._surfaces.http.api_doc import (
    API_PARTS,
    AUTH_FAIL,
    INVALID,
    RUN_PARAM,
    ApiPart,
    json_content,
    problem,
)
from toren._surfaces.http.common import (
    CLIENT,
    OPTIONS,
    ROUTE_ACCESS,
    ProblemError,
    json,
    principal,
    read_body,
    require,
    run_id,
)
from toren._surfaces.http.models import FieldError, ForkBody, Forked, ForkedFrom
from toren.runs import read_run, run_agent
from toren.runs.audit import RunPruned
from toren.runs.fork import InvalidFork, fork_run
from toren.runs.forked import forked_from

PATH = "/runs/{run}/fork"


def install(app: web.Application) -> None:
    """The fork route, asking for the ``operate`` scope (for the source run's agent)."""
    app[ROUTE_ACCESS].ask({("POST", PATH): "operate"})
    app.router.add_post(PATH, fork)
    app[API_PARTS].append(fork_part())


async def fork(request: web.Request) -> web.Response:
    """Fork the run at ``at``: 201 with the new run's id and where it came from; 404 if there
    is no such run; 422 if the fork is refused (nothing is stored)."""
    rid = run_id(request)
    body = await _body(request)
    client = request.app[CLIENT]
    try:
        agent = await run_agent(client, rid)
    except RunPruned as exc:
        raise _pruned(exc) from exc
    except UnknownActor as exc:
        raise ProblemError(404, "Not found", f"no run {rid}") from exc
    require(request, "operate", agent)
    if body.message is not None and body.input is not None:
        _refuse(
            "give `message` or `input`, not both",
            [FieldError(field=f, message="not with the other") for f in ("message", "input")],
        )
    try:
        new = await fork_run(
            client,
            rid,
            at=body.at,
            upgrade=body.upgrade,
            message=body.message,
            input=body.input,
            by=principal(request),
            cap=request.app[OPTIONS].message_cap,
        )
    except RunPruned as exc:  # pruned since it was looked up
        raise _pruned(exc) from exc
    except UnknownActor as exc:  # gone since it was looked up
        raise ProblemError(404, "Not found", f"no run {rid}") from exc
    except InvalidFork as exc:
        _refuse(str(exc), [FieldError(field=exc.field, message=exc.detail)])
    origin = forked_from(await read_run(client, new))
    if origin is None:  # fork_run wrote run.forked in the transaction that made the run
        raise ProblemError(500, "Internal error", f"{new} does not say where it was forked from")
    shown = ForkedFrom(**origin.to_json())
    return json(Forked(id=new, forked_from=shown), status=201)


def _pruned(exc: RunPruned) -> ProblemError:
    """A fork of a pruned run: 409 (as every write to it), saying to restore it first."""
    detail = (
        f"{exc}; to fork it, restore it first (toren jobs restore {exc.actor_id} --into-journal)"
    )
    return ProblemError(409, "Conflict", detail)


def _refuse(detail: str, errors: list[FieldError]) -> NoReturn:
    raise ProblemError(422, "Invalid request", detail, errors)


async def _body(request: web.Request) -> ForkBody:
    """The body as :class:`ForkBody`. Text with a lone surrogate (``"\\ud800"``, which the
    strict JSON reader refuses as not JSON) is read too, so that the fork refuses it as text
    (422) like any text it cannot take, rather than as a body that is not JSON."""
    raw = await request.read()
    try:
        orjson.loads(raw)
    except orjson.JSONDecodeError:
        try:
            data: Any = stdjson.loads(raw, parse_constant=_no_constant)
        except (ValueError, UnicodeDecodeError, RecursionError):  # (nested past any sense)
            return await read_body(request, ForkBody)  # not JSON: answered as every route does
        if isinstance(data, dict):
            return ForkBody.model_validate(data)
    return await read_body(request, ForkBody)


def _no_constant(name: str) -> NoReturn:
    raise ValueError(f"{name} is not JSON")


def fork_part() -> ApiPart:
    """The fork route's part of the OpenAPI document."""
    return ApiPart(
        paths={
            PATH: {
                "post": {
                    "summary": "Fork the run from a step: a new run replaying what came before",
                    "description": "The new run copies the run's journal up to model call `at` "
                    "and replays it by value (those calls are not paid again); from `at` on it "
                    "runs live, on the run's version or, with `upgrade`, on the agent's "
                    "current one, with the last human message or the input replaced if "
                    "given. Tool calls after the step run again and ask their approvals "
                    "again. The run forked is not changed; ended and running runs can be "
                    "forked (a running one as far as it has committed).",
                    "parameters": [RUN_PARAM],
                    "requestBody": {"required": True, **json_content(ForkBody)},
                    "responses": {
                        "201": {"description": "The new run.", **json_content(Forked)},
                        **AUTH_FAIL,
                        "404": problem("No such run."),
                        "409": problem(
                            "The run was pruned (its journal is gone): restore it first "
                            "(`toren jobs restore RUN --into-journal`)."
                        ),
                        **INVALID,
                        "422": problem(
                            "The fork is refused, nothing stored: `at` is not a step of the "
                            "run, both `message` and `input` are given, the run has no human "
                            "message to replace, or the text has NUL, a lone surrogate or is "
                            "over the cap; or the body does not fit the schema."
                        ),
                    },
                }
            }
        },
        models=(ForkBody, Forked),
    )
