"""The retention kind as a worker runs it: the pruner actor, and the pruners of the agents this
worker serves spawned and woken at each start of the worker's."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import anyio

from toren import Client
from toren.actors.retention.actor import Pruner
from toren.kernel import Kind, Service, WorkerEnv
from toren.retention import ensure_pruners
from toren.retention.runtime import Pruners
from toren.retention.surfaces import SURFACES
from toren.runs import Agents


async def _open(env: WorkerEnv) -> Pruners:
    settings = env.settings
    return Pruners(
        env.pool,
        env.resources.get(Agents),
        batch=getattr(settings, "prune_batch", 100),
        lock_timeout=getattr(settings, "prune_lock_timeout", 0.2),
        every=getattr(settings, "prune_every", 600.0),
        # the archive store's setting (issue 32's archive half); unset: runs are not archived,
        # and an agent whose policy archives is not pruned (the pruner says so)
        store_url=getattr(settings, "archive_store", None),
    )


def _services(env: WorkerEnv, pruners: Pruners) -> Sequence[Service]:
    async def wake(started: Callable[[], None]) -> None:
        started()
        await ensure_pruners(Client(env.pool, env.settings.database_url or ""), pruners.agents)
        await anyio.sleep_forever()

    return (Service(id="pruners", run=wake),)


KIND = Kind(name="retention", actors=(Pruner,), open=_open, services=_services, surfaces=SURFACES)
