"""``/readyz``: whether this server process should get traffic (``/healthz`` says it is alive).

Ready means: the database answers, its schema is at the version this code needs, and, when the
process runs a worker too (``toren up``), that worker's incarnation is registered in
``toren.workers`` and not draining. Anyone may ask (no token): orchestrators probe it.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable

import anyio
import asyncpg
from aiohttp import web

from toren._http.common import CLIENT, json
from toren._http.models import Readiness, WorkerState
from toren._migrate import schema_status

WorkerProbe = Callable[[], tuple[uuid.UUID | None, WorkerState]]
"""Reports this process's worker: its registered incarnation's id (``None`` while it has none)
and its state."""

WORKER: web.AppKey[WorkerProbe] = web.AppKey("worker_probe", object)  # type: ignore[arg-type]


def install(app: web.Application, worker: WorkerProbe | None) -> None:
    if worker is not None:
        app[WORKER] = worker
    app.router.add_get("/readyz", readyz)


async def readyz(request: web.Request) -> web.Response:
    """200 when ready; 503 with the reason otherwise."""
    pool = request.app[CLIENT].pool
    probe = request.app.get(WORKER)
    worker_id, state = probe() if probe is not None else (None, None)
    try:
        with anyio.fail_after(3):
            current, latest = await schema_status(pool)
            registered = worker_id is not None and bool(
                await pool.fetchval(
                    "SELECT EXISTS (SELECT 1 FROM toren.workers WHERE worker_id = $1)", worker_id
                )
            )
    except (OSError, TimeoutError, asyncpg.PostgresError, asyncpg.InterfaceError):
        return _answer(False, "the database does not answer", 0, 0, state, database=False)
    reason = None
    if current < latest:
        reason = (
            f"migrations not applied: the schema is at version {current}, this code needs "
            f"{latest} (run `toren migrate`)"
        )
    elif state is not None and state != "running":
        reason = f"this process's worker is {state}"
    elif state is not None and not registered:
        reason = "this process's worker is not registered"
    return _answer(reason is None, reason, current, latest, state)


def _answer(
    ready: bool,
    reason: str | None,
    current: int,
    latest: int,
    state: WorkerState | None,
    *,
    database: bool = True,
) -> web.Response:
    body = Readiness(
        ready=ready,
        reason=reason,
        database=database,
        schema_version=current,
        schema_latest=latest,
        worker=state,
    )
    return json(body, status=200 if ready else 503)
