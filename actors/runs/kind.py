"""The run kind as a worker runs it: the run actor, and the model providers its runs share."""

from __future__ import annotations

from toren.actors.runs.actor import RunActor
from toren.actors.runs.models import Providers
from toren.kernel import Kind, WorkerEnv
from toren.runs import Agents
from toren.runs.limits import set_agent_caps
from toren.runs.surfaces import SURFACES


async def _open(env: WorkerEnv) -> Providers:
    # The caps of the agents this worker runs are stored before it claims any run of them.
    agents = env.resources.find(Agents)
    if agents is not None:
        await set_agent_caps(env.pool, agents.registered())
    return Providers()  # a provider's client is made at its first call


KIND = Kind(name="run", actors=(RunActor,), open=_open, surfaces=SURFACES)
