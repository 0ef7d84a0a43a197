"""The agents' versions over HTTP: ``GET /agents/versions`` (each agent's versions, the
workers serving each and the runs pinned to each) and ``POST /runs/{run}/upgrade`` (move a run
to its agent's newest version; the ``operate`` scope for its agent)."""

from __future__ import annotations

import re
from typing import Any

from aiohttp import web

from toren._core.errors import UnknownActor
from toren._core.rows import actor_row
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
    ROUTE_ACCESS,
    ProblemError,
    json,
    principal,
    read_body,
    require,
    run_id,
)
from toren._surfaces.http.models import (
    AGENT_NAME,
    AgentVersionItem,
    AgentVersionList,
    AgentVersions,
    FieldError,
    UpgradeBody,
    Upgraded,
    VersionRuns,
    VersionWorker,
)
from toren.runs import RUN_KIND, RunNotInState, VersionNotServed, upgrade_run
from toren.runs.version_listing import AgentVersions as Found
from toren.runs.version_listing import agent_versions, pinned_version


def install(app: web.Application) -> None:
    """The versions' routes; upgrading asks for ``operate`` (for the run's agent)."""
    app[API_PARTS].append(version_part())
    app[ROUTE_ACCESS].ask({("POST", "/runs/{run}/upgrade"): "operate"})
    app.router.add_get("/agents/versions", versions)
    app.router.add_post("/runs/{run}/upgrade", upgrade)


def shown(found: Found) -> AgentVersions:
    return AgentVersions(
        agent=found.agent,
        newest=found.newest,
        versions=[
            AgentVersionItem(
                version=v.version,
                policy=v.policy,
                newest=v.newest,
                served=v.served,
                workers=[VersionWorker(**w.to_json()) for w in v.workers],
                unfinished_runs=v.unfinished_runs,
            )
            for v in found.versions
        ],
        unpinned_runs=found.unpinned_runs,
        stranded_runs=found.stranded_runs,
    )


def with_runs(found: list[Found]) -> list[VersionRuns]:
    """The versions that still have runs not ended (what ``/healthz`` shows)."""
    return [
        VersionRuns(
            agent=a.agent, version=v.version, unfinished_runs=v.unfinished_runs, served=v.served
        )
        for a in found
        for v in a.versions
        if v.unfinished_runs
    ]


async def versions(request: web.Request) -> web.Response:
    agent = request.query.get("agent")
    if agent is not None and (len(agent) > 100 or not re.fullmatch(AGENT_NAME, agent)):
        raise ProblemError(
            422,
            "Invalid request",
            "invalid query parameters",
            [FieldError(field="agent", message="an agent name: letters, digits, _ . -")],
        )
    found = await agent_versions(request.app[CLIENT].pool, agent=agent)
    return json(AgentVersionList(agents=[shown(a) for a in found]))


async def upgrade(request: web.Request) -> web.Response:
    """Move the run to the newest version of its agent: 202 once the move is committed (the
    run records ``run.upgraded`` when a worker serving that version takes it); 404 no such run;
    409 it has ended, is on the newest version already, or no live worker serves its agent."""
    rid = run_id(request)
    await read_body(request, UpgradeBody)
    client = request.app[CLIENT]
    row = await actor_row(client.pool, rid, kind=RUN_KIND, fields=("args.agent",))
    if row is None:
        raise ProblemError(404, "Not found", f"no run {rid}")
    require(request, "operate", str(row.args_dict.get("agent") or ""))
    try:
        to = await upgrade_run(client, rid, by=principal(request))
    except UnknownActor as exc:
        raise ProblemError(404, "Not found", f"no run {rid}") from exc
    except (RunNotInState, VersionNotServed) as exc:  # ended, newest already, no worker
        raise ProblemError(409, "Conflict", str(exc)) from exc
    was = pinned_version(row.route)[1]
    return json(Upgraded(run=rid, from_version=was, to_version=to), status=202)


def version_part() -> ApiPart:
    """The versions' routes in the OpenAPI document."""
    models = (AgentVersionList, UpgradeBody, Upgraded)
    return ApiPart(paths=_paths(), models=models)


def _paths() -> dict[str, Any]:
    return {
        "/agents/versions": {
            "get": {
                "summary": "Each agent's versions: the workers serving each and the runs pinned "
                "to each (a version no live worker serves has its runs parked)",
                "parameters": [
                    {
                        "name": "agent",
                        "in": "query",
                        "description": "Only this agent's versions.",
                        "schema": {"type": "string", "pattern": AGENT_NAME, "maxLength": 100},
                    }
                ],
                "responses": {
                    "200": {"description": "By agent name.", **json_content(AgentVersionList)},
                    **AUTH_FAIL,
                    "422": problem("`agent` is not an agent name."),
                },
            }
        },
        "/runs/{run}/upgrade": {
            "post": {
                "summary": "Move the run to the newest version of its agent",
                "description": "The newest version is, of the versions live workers serve, the "
                "one first seen latest. Under the agent's `next_turn` policy the "
                "run's recorded calls are taken as they are; otherwise they are checked again "
                "and invalidated from the first that differs. Recorded as `run.upgraded` (both "
                "versions, the caller's principal) when a worker serving the new version takes "
                "the run. Needs `operate` for the run's agent.",
                "parameters": [RUN_PARAM],
                "requestBody": {"required": False, **json_content(UpgradeBody)},
                "responses": {
                    "202": {"description": "Moved; the run goes on.", **json_content(Upgraded)},
                    **AUTH_FAIL,
                    "404": problem("No such run."),
                    **INVALID,
                    "409": problem(
                        "The run has ended, is on the newest version already, or no live "
                        "worker serves its agent."
                    ),
                },
            }
        },
    }
