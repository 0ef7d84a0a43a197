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

import attrs

from toren._agent.directory import card_version
from toren._agent.principal import Principal
from toren._agent.routes import route_version, version_route
from toren._core.errors import TorenError, UnknownActor
from toren._core.rows import actor_row, set_route
from toren._core.workers import newest_card
from toren.runs.client import RunNotInState, _caller
from toren.runs.events import ENDED, RUN_KIND
from toren.runs.version_events import Upgrade

if TYPE_CHECKING:
    from toren._core.client import Client, Connection


class VersionNotServed(TorenError):
    """No live worker runs the agent (with a version): a run cannot be moved to a version
    nobody serves; nothing was changed."""

    def __init__(self, agent: str) -> None:
        self.agent = agent
        super().__init__(
            f"no live worker runs agent {agent!r} (with a version); start a worker of the app "
            "that defines it, then upgrade again"
        )


async def newest_version(client: Client, agent: str) -> str | None:
    """The version of ``agent`` that the most recently started live worker running it
    publishes (``None``: no live worker runs it)."""
    return card_version(await newest_card(client.pool, agent))


async def _where(client: Client, run_id: str) -> tuple[str, str, str]:
    """The run's agent, its version (``""``: not recorded) and its status.

    Raises:
        UnknownActor: no such run.
    """
    row = await actor_row(client.pool, run_id, kind=RUN_KIND, fields=("summary", "args"))
    if row is None:
        raise UnknownActor(run_id)
    summary = row.summary_dict
    agent = str(summary.get("agent") or row.args_dict.get("agent") or "")
    version = str(summary.get("version") or "")
    if row.route and row.route.startswith("agent:"):
        version = route_version(row.route)[1] or version
    return agent, version, str(summary.get("status") or "running")


async def _target(client: Client, run_id: str, agent: str) -> str:
    newest = await newest_version(client, agent)
    if newest is None:
        raise VersionNotServed(agent)
    return newest


async def move(
    client: Client, conn: Connection, run_id: str, agent: str, to: str, by: Principal
) -> None:
    """Re-route run ``run_id`` of ``agent`` to version ``to`` and send it :class:`Upgrade`,
    in ``conn``'s transaction (the request is also kept in the run's args, ``upgrade``).

    Raises:
        UnknownActor: the run is gone.
    """
    upgrade = Upgrade(to_version=to, by=by)
    # On the row too: a worker that takes the run at mail queued before the Upgrade message
    # records who asked for the move all the same.
    asked = {"upgrade": {"to_version": to, "by": attrs.asdict(by)}}
    if not await set_route(conn, run_id, version_route(agent, to), args=asked):
        raise UnknownActor(run_id)
    await client.send(run_id, upgrade, system=True, conn=conn)


async def upgrade_run(client: Client, run_id: str, *, by: Principal | None = None) -> str:
    """Move a run that has not ended to its agent's newest version (see the module's docs).

    Returns:
        The version it moves to.

    Raises:
        UnknownActor: no such run.
        RunNotInState: the run has ended (completed, failed or cancelled: a failed run is moved
            by ``retry(..., upgrade=True)``), or it is already on the newest version.
        VersionNotServed: no live worker runs its agent.
    """
    agent, version, status = await _where(client, run_id)
    if status in ENDED:
        how = "failed: retry it with upgrade" if status == "failed" else status
        raise RunNotInState(run_id, f"has {how}; only a run that has not ended is upgraded")
    newest = await _target(client, run_id, agent)
    if version == newest:
        raise RunNotInState(
            run_id, f"is already on version {newest}, the newest a live worker serves"
        )
    async with client.pool.acquire() as conn, conn.transaction():
        await move(client, conn, run_id, agent, newest, _caller(by))
    return newest


async def retry_target(client: Client, run_id: str) -> tuple[str, str] | None:
    """For a retry with ``upgrade``: the run's agent and the newest version, or ``None`` if
    the run is on it already.

    Raises:
        UnknownActor: no such run.
        VersionNotServed: no live worker runs its agent.
    """
    agent, version, _ = await _where(client, run_id)
    newest = await _target(client, run_id, agent)
    return None if newest == version else (agent, newest)
