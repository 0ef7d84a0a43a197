"""Moving a run to its agent's newest version: :func:`upgrade_run` (``toren jobs upgrade``) and
the move :func:`toren.runs.retry` makes with ``upgrade=True``.

A run pinned to a version (``pin``, ``next_turn``) is claimed only by workers serving it: its
actor's row is routed to ``agent:NAME@VERSION``. Upgrading re-routes the row to the version the
most recently started live worker running the agent publishes, and sends the run an
:class:`~toren.runs.Upgrade` message, in one transaction: a worker serving that version takes
the run and records ``run.upgraded`` (how its policy says: ``next_turn`` takes the history by
value, the others check it and re-pay from the first call that differs).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from toren._agent.principal import Principal
from toren._core.rows import queued
from toren.runs.client import RunNotInState, _caller
from toren.runs.events import ENDED
from toren.runs.version_moves import move, target, where

if TYPE_CHECKING:
    from toren._core.client import Client


async def upgrade_run(client: Client, run_id: str, *, by: Principal | None = None) -> str:
    """Move a run that has not ended to its agent's newest version (see the module's docs).

    Returns:
        The version it moves to.

    Raises:
        UnknownActor: no such run.
        RunNotInState: the run has ended (completed, failed or cancelled: a failed run is moved
            by ``retry(..., upgrade=True)``; a completed one with a human message waiting, a
            conversation going on, is moved), or it is already on the newest version.
        VersionNotServed: no live worker runs its agent.
    """
    agent, version, status = await where(client, run_id)
    # A completed conversation with a message waiting goes on: it is not over.
    going_on = status == "completed" and bool(await queued(client.pool, [run_id], "run.say"))
    if status in ENDED and not going_on:
        how = "failed: retry it with upgrade" if status == "failed" else status
        raise RunNotInState(run_id, f"has {how}; only a run that has not ended is upgraded")
    newest = await target(client, agent)
    if version == newest:
        raise RunNotInState(
            run_id, f"is already on version {newest}, the newest a live worker serves"
        )
    async with client.pool.acquire() as conn, conn.transaction():
        await move(client, conn, run_id, agent, newest, _caller(by))
    return newest
