"""The run kind as a worker runs it: the run actor, the model providers its runs share, the
service that moves ``next_turn`` runs stranded on a version no live worker serves, and the one
that imports the agents' provider SDKs once the worker serves."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import anyio

from toren.actors.runs.actor import RunActor
from toren.actors.runs.models import Providers
from toren.actors.runs.rates import Rates
from toren.actors.runs.strands import POLLS, run_mover
from toren.kernel import Clock, Kind, Service, WorkerEnv
from toren.runs import Agents
from toren.runs.limits import set_agent_caps
from toren.runs.surfaces import SURFACES


async def _open(env: WorkerEnv) -> Providers:
    # The caps of the agents this worker runs are stored before it claims any run of them.
    agents = env.resources.find(Agents)
    if agents is not None:
        await set_agent_caps(env.pool, agents.registered())
    # Declared rate limits are taken through the worker's pool on its clock; none: no rates.
    limits = tuple(getattr(env.settings, "rate_limits", ()))
    clock = env.resources.find(Clock) or Clock()
    rates = Rates(limits=limits, pool=env.pool, clock=clock) if limits else None
    return Providers(rates)  # a provider's client is made at its first call


def _services(env: WorkerEnv, providers: Providers) -> Sequence[Service]:
    agents = env.resources.find(Agents)
    if agents is None:
        return ()

    async def move(started: Callable[[], None]) -> None:
        await run_mover(env.pool, agents, env.settings.poll_seconds * POLLS, started)

    async def preload(started: Callable[[], None]) -> None:
        # After the worker registered (services start in its incarnation): it serves first,
        # and imports what its agents' first calls need after.
        started()
        await providers.preload(agent.model for agent in agents.registered())
        await anyio.sleep_forever()

    return (Service(id="stranded_runs", run=move), Service(id="provider_sdks", run=preload))


KIND = Kind(name="run", actors=(RunActor,), open=_open, services=_services, surfaces=SURFACES)
