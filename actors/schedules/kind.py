"""The schedule kind as a worker runs it: the schedule actor, and the declared schedules
reconciled at each start of the worker's (the ``Agent(schedules=...)`` and
``[agents.NAME.schedules.SLOT]`` of the agents it runs)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import anyio

from toren import Client
from toren.actors.schedules.actor import ScheduleActor
from toren.actors.schedules.runtime import Schedules
from toren.kernel import Kind, Service, WorkerEnv
from toren.runs import Agents
from toren.schedules.reconcile import reconcile
from toren.schedules.surfaces import SURFACES


async def _open(env: WorkerEnv) -> Schedules:
    client = Client(env.pool, env.settings.database_url or "")
    return Schedules(client, env.resources.get(Agents))


def _services(env: WorkerEnv, schedules: Schedules) -> Sequence[Service]:
    async def declare(started: Callable[[], None]) -> None:
        started()
        await reconcile(schedules.client, schedules.agents)
        await anyio.sleep_forever()

    return (Service(id="schedules", run=declare),)


KIND = Kind(
    name="schedule", actors=(ScheduleActor,), open=_open, services=_services, surfaces=SURFACES
)
