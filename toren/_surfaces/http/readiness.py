"""``/readyz``: whether this server process should get traffic (``/healthz`` says it is alive).

Ready means: the database answers, its schema is at the version this code needs, and, when the
process runs a worker too (``toren up``), that worker's incarnation is registered in
``toren.workers`` and not draining. Anyone may ask (no token): orchestrators probe it. So probes
that arrive together share one database check (:class:`_Checks`): a flood of them holds one
pooled connection, never the ones the API needs.
"""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import Callable

import anyio
import asyncpg
import attrs
from aiohttp import web

from toren._core.migrate import schema_status
from toren._core.workers import worker_registered
from toren._surfaces.http.common import CLIENT, json
from toren._surfaces.http.models import Readiness, WorkerState

WorkerProbe = Callable[[], tuple[uuid.UUID | None, WorkerState]]
"""Reports this process's worker: its registered incarnation's id (``None`` while it has none)
and its state."""

WORKER: web.AppKey[WorkerProbe] = web.AppKey("worker_probe", object)  # type: ignore[arg-type]

Found = tuple[int, int, bool] | None
"""What the database said: schema version, the latest, whether the worker is registered;
``None`` when it did not answer."""


@attrs.define
class _Checks:
    """One database check at a time; a probe reuses a check that began after it arrived (as
    fresh as one of its own)."""

    lock: anyio.Lock = attrs.field(factory=anyio.Lock)
    began: float = -math.inf
    worker_id: uuid.UUID | None = None
    found: Found = None

    async def check(self, pool: asyncpg.Pool, worker_id: uuid.UUID | None) -> Found:
        arrived = time.monotonic()
        async with self.lock:
            if self.began >= arrived and self.worker_id == worker_id:
                return self.found
            began = time.monotonic()
            found = await _query(pool, worker_id)  # kept only once complete (not if cancelled)
            self.began, self.worker_id, self.found = began, worker_id, found
            return found


CHECKS: web.AppKey[_Checks] = web.AppKey("readiness_checks", _Checks)


def install(app: web.Application, worker: WorkerProbe | None) -> None:
    if worker is not None:
        app[WORKER] = worker
    app[CHECKS] = _Checks()
    app.router.add_get("/readyz", readyz)


async def readyz(request: web.Request) -> web.Response:
    """200 when ready; 503 with the reason otherwise."""
    pool = request.app[CLIENT].pool
    probe = request.app.get(WORKER)
    worker_id, state = probe() if probe is not None else (None, None)
    found = await request.app[CHECKS].check(pool, worker_id)
    if found is None:
        return _answer(False, "the database does not answer", 0, 0, state, database=False)
    current, latest, registered = found
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


async def _query(pool: asyncpg.Pool, worker_id: uuid.UUID | None) -> Found:
    try:
        with anyio.fail_after(3):
            current, latest = await schema_status(pool)
            registered = worker_id is not None and await worker_registered(pool, worker_id)
    except (OSError, TimeoutError, asyncpg.PostgresError, asyncpg.InterfaceError):
        return None
    return current, latest, registered


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
