"""The versions of each agent as the surfaces show them, and the runs stranded on a version
no live worker serves.

Read from two places, each in one statement: what live workers publish with each lease renewal
(their routes, ``agent:NAME`` and ``agent:NAME@VERSION``, and a card per agent with its
``version`` and ``version_policy``), and the routes of the runs that have not ended (a run is
pinned by its row's route, ``agent:NAME@VERSION``; one spawned and not started yet, or run
under the ``upgrade`` policy, is on ``agent:NAME``: unpinned).

A pinned run that has not ended and whose version no live worker serves is **parked**, with
the reason :func:`parked_reason` gives ("waiting for a worker serving version V"): no worker
will claim it until one serving that version starts, or until it is upgraded
(``toren jobs upgrade``). That is derived when it is read (:func:`stranded`), never stored.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from datetime import datetime
from typing import Any

import asyncpg
import attrs

from toren._agent.routes import route_version, version_route
from toren._core.client import Client
from toren._core.rows import count_by_route
from toren._core.workers import live_workers, newest_cards, unserved
from toren.runs.events import ENDED, RUN_KIND, STATUSES

SAY = "run.say"
"""The kind of a human's message to a run (what a completed conversation waits for)."""

UNFINISHED = tuple(s for s in STATUSES if s not in ENDED)


def parked_reason(version: str) -> str:
    """What a run pinned to ``version``, which no live worker serves, is shown waiting for."""
    return f"waiting for a worker serving version {version}"


def pinned_version(route: str | None) -> tuple[str, str | None]:
    """The agent and the version of a run's route (``agent:NAME@VERSION``); the version is
    ``None`` for an unpinned route (``agent:NAME``) and the agent empty for a route that is
    not an agent's."""
    if route is None or not route.startswith("agent:"):
        return "", None
    name, version = route_version(route)
    return name, version or None


@attrs.frozen(kw_only=True)
class ServingWorker:
    """A live worker serving a version, as the workers table records it."""

    worker_id: str
    name: str
    code_version: str  # Toren's version, with ``+LABEL`` when the worker has a deploy label
    deploy_label: str | None
    started_at: datetime

    def to_json(self) -> dict[str, Any]:
        return {**attrs.asdict(self), "started_at": self.started_at.isoformat()}


@attrs.frozen(kw_only=True)
class AgentVersion:
    """One version of an agent: who serves it, and how many runs that have not ended are
    pinned to it. ``workers`` empty: no live worker serves it, and its runs are stranded
    (parked until a worker serving it starts, or they are upgraded)."""

    version: str
    policy: str | None  # as its newest worker publishes it; None when no worker serves it
    newest: bool  # what an upgrade moves a run to: of those served, the one first seen latest
    workers: tuple[ServingWorker, ...]
    unfinished_runs: int

    @property
    def served(self) -> bool:
        return bool(self.workers)

    def to_json(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "policy": self.policy,
            "newest": self.newest,
            "served": self.served,
            "workers": [w.to_json() for w in self.workers],
            "unfinished_runs": self.unfinished_runs,
        }


@attrs.frozen(kw_only=True)
class AgentVersions:
    """An agent's versions, the newest first, then those no live worker serves (by name)."""

    agent: str
    newest: str | None
    versions: tuple[AgentVersion, ...]
    unpinned_runs: int  # unfinished runs on ``agent:NAME``: not started yet, or under upgrade

    @property
    def stranded_runs(self) -> int:
        """Runs pinned to a version no live worker serves."""
        return sum(v.unfinished_runs for v in self.versions if not v.served)

    def to_json(self) -> dict[str, Any]:
        return {
            "agent": self.agent,
            "newest": self.newest,
            "versions": [v.to_json() for v in self.versions],
            "unpinned_runs": self.unpinned_runs,
            "stranded_runs": self.stranded_runs,
        }


@attrs.define
class _Seen:
    workers: list[ServingWorker] = attrs.Factory(list)
    policy: str | None = None
    latest: datetime | None = None


async def agent_versions(
    db: asyncpg.Pool | asyncpg.Connection, *, agent: str | None = None
) -> list[AgentVersions]:
    """Each agent's versions (only ``agent``'s if named), by agent name: those live workers
    publish, with the workers serving each, and those runs that have not ended are pinned to,
    with their count; the newest first (of those served, the one first seen latest: see
    :data:`toren._core.workers.NEWEST_FIRST`), then the others served, the latest started
    worker's first. Three statements, whatever the number of runs."""
    workers = await live_workers(db)
    newest_of = await newest_cards(db)
    counts = await count_by_route(db, RUN_KIND, run_statuses=UNFINISHED)
    seen: dict[str, dict[str, _Seen]] = {}
    for w in workers:  # oldest first: a newer worker's policy replaces an older one's
        cards = (w["stats"] or {}).get("agents")
        for name, card in (cards or {}).items() if isinstance(cards, dict) else ():
            version = card.get("version") if isinstance(card, dict) else None
            if not isinstance(version, str) or not version or (agent and name != agent):
                continue  # a worker of a Toren without versions publishes none
            found = seen.setdefault(name, {}).setdefault(version, _Seen())
            found.workers.append(
                ServingWorker(
                    worker_id=str(w["worker_id"]),
                    name=w["name"],
                    code_version=w["version"],
                    deploy_label=w["deploy_label"],
                    started_at=w["started_at"],
                )
            )
            policy = card.get("version_policy")
            found.policy = policy if isinstance(policy, str) else found.policy
            found.latest = w["started_at"]
    unpinned: dict[str, int] = {}
    for route, n in counts.items():
        name, version = pinned_version(route)
        if not name or (agent and name != agent):
            continue
        if version is None:
            unpinned[name] = unpinned.get(name, 0) + n
        else:
            seen.setdefault(name, {}).setdefault(version, _Seen())
        seen.setdefault(name, {})
    out = []
    for name in sorted(seen):
        card = newest_of.get(name)
        newest = card.get("version") if isinstance(card, dict) else None
        served = sorted(
            ((v, s) for v, s in seen[name].items() if s.workers),
            key=lambda vs: (vs[0] == newest, vs[1].latest, vs[0]),
            reverse=True,
        )
        unserved = sorted((v, s) for v, s in seen[name].items() if not s.workers)
        if newest not in seen[name] or not seen[name][newest].workers:
            newest = served[0][0] if served else None  # the two reads disagree: one changed
        versions = tuple(
            AgentVersion(
                version=v,
                policy=s.policy,
                newest=v == newest,
                workers=tuple(s.workers),
                unfinished_runs=counts.get(version_route(name, v), 0),
            )
            for v, s in [*served, *unserved]
        )
        out.append(
            AgentVersions(
                agent=name, newest=newest, versions=versions, unpinned_runs=unpinned.get(name, 0)
            )
        )
    return out


def parked_on(
    route: str | None, served: Collection[str] | None, *, ended: bool, say_waiting: bool
) -> str | None:
    """The version a run is parked on, if it is: pinned by ``route`` to a version outside
    ``served`` (the routes live workers publish; ``None`` while one has not said yet: nothing
    is parked), and either not ended or a completed conversation with a human's message
    waiting (``say_waiting``). What :func:`stranded` finds, for one run whose mail and
    workers' routes the caller has read already."""
    version = pinned_version(route)[1]
    if version is None or served is None or route in served:
        return None
    return version if not ended or say_waiting else None


async def stranded(
    client: Client,
    routes: Mapping[str, str | None],
    *,
    completed: Mapping[str, str | None] | None = None,
) -> dict[str, str]:
    """Of the runs given (id to route; give only those that have not ended), those pinned to a
    version no live worker serves, with that version; also those of ``completed`` (completed
    runs, id to route) that are, with a human's message waiting: a conversation that goes on
    once a worker takes it, parked meanwhile. One statement (mailboxes included), none when no
    run given is pinned; none is stranded while a live worker has not said yet what it
    serves."""
    given = {**routes, **(completed or {})}
    pinned = {rid: route for rid, route in given.items() if route and pinned_version(route)[1]}
    if not pinned:
        return {}
    idle = [rid for rid in pinned if rid in (completed or {}) and rid not in routes]
    found = await unserved(client.pool, pinned, unless_idle=idle, mail_kind=SAY)
    if found is None:
        return {}
    return {rid: str(pinned_version(pinned[rid])[1]) for rid in found}
