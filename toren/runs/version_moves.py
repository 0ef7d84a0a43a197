"""Where a run is moved when it moves to its agent's newest version: the parts of
:func:`toren.runs.upgrade_run` that :func:`toren.runs.retry` (``upgrade=True``) shares, in a
module that does not import the client's (which imports it)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import attrs

from toren._agent.directory import card_version
from toren._agent.principal import Principal
from toren._agent.routes import route_version, version_route
from toren._core.errors import TorenError, UnknownActor
from toren._core.rows import actor_row, set_route
from toren._core.workers import newest_card
from toren.runs.events import RUN_KIND
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


async def where(client: Client, run_id: str) -> tuple[str, str, str]:
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


async def target(client: Client, agent: str) -> str:
    """The newest version of ``agent``.

    Raises:
        VersionNotServed: no live worker runs it.
    """
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


async def retry_target(client: Client, run_id: str) -> tuple[str, str] | None:
    """For a retry with ``upgrade``: the run's agent and the newest version, or ``None`` if
    the run is on it already.

    Raises:
        UnknownActor: no such run.
        VersionNotServed: no live worker runs its agent.
    """
    agent, version, _ = await where(client, run_id)
    newest = await target(client, agent)
    return None if newest == version else (agent, newest)
