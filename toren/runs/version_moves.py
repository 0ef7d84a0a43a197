"""Where a run is moved when it moves to its agent's newest version: the parts of
:func:`toren.runs.upgrade_run` that :func:`toren.runs.retry` (``upgrade=True``) shares, in a
module that does not import the client's (which imports it); and the move of ``next_turn``
runs stranded on a version no live worker serves (:func:`move_stranded`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import attrs

from toren._agent.directory import card_version
from toren._agent.principal import Principal
from toren._agent.routes import agent_route, route_version, version_route
from toren._core.errors import TorenError, UnknownActor
from toren._core.rows import actor_row, set_route
from toren._core.workers import newest_card, reroute_unserved
from toren.runs.audit import unknown_run
from toren.runs.events import RUN_KIND
from toren.runs.version_events import Upgrade

if TYPE_CHECKING:
    from collections.abc import Mapping

    import asyncpg

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
    """The newest version of ``agent``: of the versions live workers serve, the one first seen
    latest (``None``: no live worker runs it). A worker of an older version that restarts does
    not make its version the newest again."""
    return card_version(await newest_card(client.pool, agent))


async def where(client: Client, run_id: str) -> tuple[str, str, str]:
    """The run's agent, its version (``""``: not recorded) and its status.

    Raises:
        UnknownActor: no such run (``RunPruned`` if it was pruned).
    """
    row = await actor_row(client.pool, run_id, kind=RUN_KIND, fields=("summary", "args"))
    if row is None:
        raise await unknown_run(client.pool, run_id)  # RunPruned, saying when, if it was
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
    # The database's clock, the same for every client: it orders two requests for one run.
    asked_at = float(await conn.fetchval("SELECT extract(epoch FROM clock_timestamp())"))
    upgrade = Upgrade(to_version=to, by=by, asked_at=asked_at)
    # On the row too: a worker that takes the run at mail queued before the Upgrade message
    # records who asked for the move all the same, and drops an Upgrade a later one superseded.
    asked = {"upgrade": {"to_version": to, "by": attrs.asdict(by), "asked_at": asked_at}}
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


# A run that waits between turns: a conversation that answered (completed) or one parked on a
# durable timer. A run parked on an approval or a child run waits inside its turn: never moved.
_BETWEEN_TURNS = ("completed", "parked")
_INSIDE_A_TURN = ("waiting_on", "children")  # summary keys: calls awaiting a decision, children
_UPGRADE = "run.upgrade"  # the message kind of Upgrade


async def move_stranded(pool: asyncpg.Pool, versions: Mapping[str, str]) -> list[str]:
    """Move the ``next_turn`` runs stranded on a version no live worker serves: for each agent
    named in ``versions`` (its ``next_turn`` agents, with the version the caller serves), its
    runs pinned to a version served by no live worker, held by none, that wait between turns
    (completed, or parked on a timer: not on an approval or a child run) and have mail (a human
    message, a timer), are re-routed to ``agent:NAME@VERSION`` in one statement, if that version
    is the newest (see :func:`newest_version`). The
    worker that takes such a run records ``run.upgraded`` (``how: value``, by nobody). A run
    without mail stays where it is until it has some.

    Returns:
        The ids of the runs moved.
    """
    return await reroute_unserved(
        pool,
        RUN_KIND,
        {agent_route(name): (name, version_route(name, v)) for name, v in versions.items()},
        run_statuses=_BETWEEN_TURNS,
        empty=_INSIDE_A_TURN,
        clear_args=("upgrade",),  # an earlier request of toren jobs upgrade: not this move's
        # An Upgrade on its way names where the run goes (its handler would hand it back).
        unless_mail=(_UPGRADE,),
    )
