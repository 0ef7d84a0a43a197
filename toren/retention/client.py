"""Pruners from outside: spawned at each worker's start, asked to prune now by ``toren jobs
prune``."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from toren._agent.principal import Principal
from toren._agent.routes import agent_route
from toren._core.errors import TorenError, UnknownActor
from toren.retention.messages import PRUNER_KIND, PruneNow, PruneTick, pruner_id

if TYPE_CHECKING:
    from toren._agent.registry import Agents
    from toren._core.client import Client

log = logging.getLogger("toren.retention")


async def ensure_pruners(client: Client, agents: Agents) -> list[str]:
    """Spawn the pruner of each agent ``agents`` serves whose retention policy prunes ended
    runs (``keep_for``, ``keep_failed_for`` or ``keep_last``: ``conversation_keep_for`` alone
    needs none, the run's host truncates its journal), as ``retention/<agent>``, routed to
    the agent's workers (only a worker that knows the policy runs it), if it is not there
    yet, and wake it. Idempotent: workers starting together make one pruner per agent (its
    lease makes it one in the cluster), and a wake more only runs a batch sooner. Returns the
    agents whose pruners were woken."""
    served = set(agents.served_routes())
    woken = []
    for agent in agents.registered():
        policy = agent.retention
        if policy is None or not policy.prunes_runs or agent_route(agent.name) not in served:
            continue
        actor_id = pruner_id(agent.name)
        await client.spawn(
            PRUNER_KIND, actor_id, {"agent": agent.name}, route=agent_route(agent.name)
        )
        await client.send(actor_id, PruneTick())
        woken.append(agent.name)
    if woken:
        log.info("pruners woken: %s", ", ".join(woken))
    return woken


class NoPruner(UnknownActor):
    """No worker with a retention policy for the agent has started: there is nothing to ask."""

    def __init__(self, agent: str) -> None:
        self.actor_id = pruner_id(agent)
        self.agent = agent
        TorenError.__init__(
            self,
            f"agent {agent!r} has no pruner: no worker running it with a retention policy has "
            "started (give it Agent(retention=...) or [agents.NAME.retention])",
        )


async def prune_now(client: Client, agent: str, *, by: Principal | None = None) -> None:
    """Ask ``agent``'s pruner to prune now, batch after batch (it answers nothing: what it did
    is in the prune log).

    Raises:
        NoPruner: it has none.
    """
    try:
        await client.send(pruner_id(agent), PruneNow(by=by), system=True)
    except UnknownActor:
        raise NoPruner(agent) from None
