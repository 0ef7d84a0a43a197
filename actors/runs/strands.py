"""The service that moves ``next_turn`` runs stranded on a version no live worker serves.

A ``next_turn`` run that waits between turns (a conversation that answered, a run parked on a
timer) while its version is still the newest stays pinned to it; once every worker serving
that version is drained, nothing would claim its next message. Each worker running agents
whose policy is ``next_turn`` looks every few polls for such runs that have mail and moves
them to its version, if that is the newest (:func:`toren.runs.version_moves.move_stranded`:
one statement; two workers at once move a run once). The worker that takes a moved run records
``run.upgraded`` by value (:func:`toren.actors.runs.versions.check`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import anyio
import asyncpg

from toren.kernel import TRANSIENT_DB_ERRORS
from toren.runs import Agents
from toren.runs.version_moves import move_stranded

log = logging.getLogger("toren.runs")

POLLS = 5
"""How many of the worker's polls (``poll_seconds``) pass between two looks."""

_ERRORS: tuple[type[BaseException], ...] = (*TRANSIENT_DB_ERRORS, asyncpg.PostgresError)


def next_turn_versions(agents: Agents) -> dict[str, str]:
    """The worker's agents whose policy is ``next_turn``, with the version it serves."""
    versions = {}
    for agent in agents.registered():
        version = agents.version(agent.name)
        if version and agents.version_policy(agent) == "next_turn":
            versions[agent.name] = version
    return versions


async def run_mover(
    pool: asyncpg.Pool, agents: Agents, every: float, started: Callable[[], None]
) -> None:
    """Move stranded ``next_turn`` runs to this worker's version every ``every`` seconds,
    until cancelled. A failed look is logged and made again at the next: the mover never ends
    the worker."""
    started()
    while True:
        versions = next_turn_versions(agents)
        if versions:
            try:
                moved = await move_stranded(pool, versions)
            except _ERRORS as exc:
                log.warning("moving stranded next_turn runs failed (%s); again in %gs", exc, every)
            else:
                for run_id in moved:
                    log.info("%s: its version is served by no worker; moved to the newest", run_id)
        await anyio.sleep(every)
