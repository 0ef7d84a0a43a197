"""Declared schedules made so at a worker's start: each schedule of each agent the worker runs
(``Agent(schedules=...)``, ``[agents.NAME.schedules.SLOT]``) is declared to its actor, and a
declared schedule of one of those agents that is declared no more is deleted.

Declaring is idempotent (the same declaration is one message, and an actor that has it already
records nothing), so workers starting together declare each schedule once, and a slot never
fires twice for it. In a rolling deploy, the version that started last decides what is
declared.
"""

from __future__ import annotations

import logging

from toren._agent.principal import Principal
from toren._core.client import Client
from toren._core.rows import actors_of_kind
from toren.runs import Agents
from toren.schedules.client import declare, full_name
from toren.schedules.events import SCHEDULE_KIND, SCHEDULE_PREFIX, Delete, schedule_id

log = logging.getLogger("toren.schedules")


async def reconcile(client: Client, agents: Agents) -> None:
    """Declare the schedules of ``agents``; delete those of theirs declared no more."""
    by = Principal.os_user(via="worker")
    declared: set[str] = set()
    for agent in agents.registered():
        for schedule in getattr(agent, "schedules", ()):
            declared.add(await declare(client, agent.name, schedule, source="declared", by=by))
    served = {a.name for a in agents.registered()}
    rows = await actors_of_kind(client.pool, SCHEDULE_KIND, fields=("summary",), limit=100_000)
    for row in rows:
        s = row.summary_dict
        name = row.actor_id.removeprefix(SCHEDULE_PREFIX)
        if (
            s.get("source") == "declared"
            and s.get("agent") in served
            and not s.get("deleted")
            and name not in declared
        ):
            log.info("schedule %s is declared no more: deleting it", name)
            await client.send(schedule_id(name), Delete(by=by))
    if declared:
        log.info("schedules declared: %s", ", ".join(sorted(declared)))


__all__ = ["full_name", "reconcile"]
