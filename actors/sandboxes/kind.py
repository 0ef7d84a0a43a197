"""The sandbox kind as a worker runs it: the sandbox actor, the worker's Docker client and
workspace store (if Docker answers), the reaper of containers whose run has ended, and the
sweep of checkpoints no kept actor names."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from toren.actors.sandboxes import reaper, sweeper
from toren.actors.sandboxes.actor import SandboxActor
from toren.actors.sandboxes.runtime import Sandboxes, open_sandboxes
from toren.kernel import Kind, Service, WorkerEnv
from toren.runs import Agents
from toren.sandboxes.surfaces import SURFACES

log = logging.getLogger("toren.sandbox")


async def _open(env: WorkerEnv) -> Sandboxes:
    if not env.on:
        log.debug("no agent here has a sandbox: Docker is not asked")
        return Sandboxes(why="no agent of this worker has a sandbox")
    return await open_sandboxes(env.settings, env.pool, env.resources.get(Agents))


def _services(env: WorkerEnv, sandboxes: Sandboxes) -> Sequence[Service]:
    if not sandboxes.available:
        return ()
    docker, _ = sandboxes.current()

    async def reap(started: Callable[[], None]) -> None:
        every = env.settings.sandbox_reap_seconds
        await reaper.run_reaper(env.pool, docker, sandboxes.scope, every, started)

    async def sweep(started: Callable[[], None]) -> None:
        await sweeper.run_sweeper(env.pool, sandboxes, env.settings, started)

    return (Service(id="reaper", run=reap), Service(id="checkpoint_sweep", run=sweep))


KIND = Kind(
    name="sandbox", actors=(SandboxActor,), open=_open, services=_services, surfaces=SURFACES
)
