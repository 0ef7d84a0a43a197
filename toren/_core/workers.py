"""The registry of live workers, as others read it: the ring of death watches, the workers'
published statistics and routes (what the agent directory and the surfaces read), the move of
actors stranded on a route no live worker serves, and the housekeeping that deletes what dead
workers and old requests left behind.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Collection, Mapping
from typing import TYPE_CHECKING, Any

import anyio
import asyncpg

from toren._core.db import connect
from toren._core.session import LIVE_WORKERS, LOCK_NAMESPACE

if TYPE_CHECKING:
    from toren._core.rows import Db

log = logging.getLogger("toren.leases")  # the name operators' log filters know


_SUCCESSOR = f"""
SELECT w.lock_key FROM toren.workers w
WHERE w.worker_id IN ({LIVE_WORKERS}) AND w.worker_id <> $1
ORDER BY w.lock_key <= $2, w.lock_key
LIMIT 1
"""


async def open_death_watch(url: str, *, recheck: float) -> asyncpg.Connection:
    """A dedicated connection for :func:`wait_for_death`.

    Its lock waits give up after ``recheck`` seconds, so that the peer watched is re-chosen as
    workers come and go.
    """
    conn = await connect(url, name="toren-worker-watch")
    try:
        await conn.execute(f"SET lock_timeout = '{int(recheck * 1000)}ms'")
    except BaseException:
        conn.terminate()  # cancelled (a worker stopping as it starts) or failed: not leaked
        raise
    return conn


def ring_position(lock_key: int, me: int) -> tuple[bool, int]:
    """Where ``lock_key`` comes in the ring as seen from the worker whose key is ``me``: the
    keys above ``me`` in order, then (wrapping round) the others. :func:`successor` picks the
    live worker first in this order; a registered newcomer that comes before the peer watched
    is the successor now (:class:`toren.supervisors.worker.death_watch.DeathWatch`)."""
    return (lock_key <= me, lock_key)


async def successor(conn: asyncpg.Connection, worker_id: uuid.UUID, lock_key: int) -> int | None:
    """The lock key of the next live worker after this one (``lock_key``) in lock-key order,
    round a ring, so that each worker has a watcher; ``None`` if there is no other."""
    peer: int | None = await conn.fetchval(_SUCCESSOR, worker_id, lock_key)
    return peer


async def wait_for_death(conn: asyncpg.Connection, peer: int) -> bool:
    """Wait until the worker holding lock key ``peer`` dies (or stops).

    The wait is a shared request on the peer's advisory lock, granted the instant Postgres
    drops the dead peer's session. That turns a worker's death into an event instead of
    something the next poll finds. A wait cancelled before the grant leaves ``conn``
    mid-request: terminate it. Once granted, the rest is shielded: a death is never lost.

    Returns:
        True if the peer died; False if the wait timed out (the connection's ``lock_timeout``,
        :func:`open_death_watch`: choose the peer again, the ring may have changed).
    """
    try:
        await conn.execute("SELECT pg_advisory_lock_shared($1, $2)", LOCK_NAMESPACE, peer)
    except asyncpg.LockNotAvailableError:
        return False
    with anyio.CancelScope(shield=True):  # granted: the death is certain, and is reported
        await conn.execute("SELECT pg_advisory_unlock_shared($1, $2)", LOCK_NAMESPACE, peer)
    log.info("watched worker (lock key %d) is gone; claiming its actors now", peer)
    return True


async def live_workers(conn: asyncpg.Connection | asyncpg.Pool) -> list[asyncpg.Record]:
    """Registered workers whose advisory lock is held, with their statistics."""
    rows: list[asyncpg.Record] = await conn.fetch(
        f"""
        SELECT w.*, (SELECT count(*) FROM toren.actors a WHERE a.owner = w.worker_id) AS leases
        FROM toren.workers w WHERE w.worker_id IN ({LIVE_WORKERS})
        ORDER BY w.started_at
        """
    )
    return rows


async def live_worker_count(conn: asyncpg.Connection | asyncpg.Pool) -> int:
    """How many registered workers hold their advisory lock (without :func:`live_workers`'s
    count of each one's leases)."""
    count: int = await conn.fetchval(f"SELECT count(*) FROM ({LIVE_WORKERS}) AS live")
    return count


async def worker_registered(conn: asyncpg.Connection | asyncpg.Pool, worker_id: uuid.UUID) -> bool:
    """Whether worker ``worker_id`` is in the registry (live, or dead and not yet removed)."""
    found: bool = await conn.fetchval(
        "SELECT EXISTS (SELECT 1 FROM toren.workers WHERE worker_id = $1)", worker_id
    )
    return found


async def served_agents(conn: asyncpg.Connection | asyncpg.Pool) -> set[str] | None:
    """The agents live workers run, from the routes they publish with each renewal; ``None``
    while no live worker has published yet (none is up, or one has only just started)."""
    published = [
        w["stats"]["routes"] for w in await live_workers(conn) if "routes" in (w["stats"] or {})
    ]
    if not published:
        return None
    # An agent's pinned runs' routes (agent:NAME@VERSION) name the same agent.
    return {
        r.removeprefix("agent:").partition("@")[0]
        for routes in published
        for r in routes
        if r[:6] == "agent:"
    }


async def published_routes(conn: asyncpg.Connection | asyncpg.Pool) -> set[str] | None:
    """Every route some live worker publishes; ``None`` while a live worker has not published
    its routes yet (one that has only just started: what it serves is not known)."""
    rows = await conn.fetch(
        f"SELECT w.stats->'routes' AS routes FROM toren.workers w "
        f"WHERE w.worker_id IN ({LIVE_WORKERS})"
    )
    routes: set[str] = set()
    for r in rows:
        if not isinstance(r["routes"], list):
            return None
        routes.update(route for route in r["routes"] if isinstance(route, str))
    return routes


_UNSERVED = f"""
WITH live AS (
    SELECT w.stats->'routes' AS routes FROM toren.workers w
    WHERE w.worker_id IN ({LIVE_WORKERS})
)
SELECT EXISTS (SELECT 1 FROM live WHERE jsonb_typeof(live.routes) IS DISTINCT FROM 'array')
           AS unknown,
       ARRAY(SELECT r.id FROM unnest($1::text[], $2::text[]) AS r(id, route)
             WHERE NOT EXISTS (SELECT 1 FROM live WHERE jsonb_typeof(live.routes) = 'array'
                                                   AND live.routes ? r.route)
               AND (r.id <> ALL($3::text[])
                    OR EXISTS (SELECT 1 FROM toren.mailbox m
                               WHERE m.actor_id = r.id AND m.kind = $4))) AS ids
"""


async def unserved(
    conn: asyncpg.Connection | asyncpg.Pool,
    routes: Mapping[str, str],
    *,
    unless_idle: Collection[str] = (),
    mail_kind: str = "",
) -> set[str] | None:
    """Of the actors given (id to route), those whose route no live worker publishes, in one
    statement; those of ``unless_idle`` only if a message of ``mail_kind`` waits for them.
    ``None`` while a live worker has not published its routes yet (what it serves is not
    known)."""
    found = await conn.fetchrow(
        _UNSERVED, list(routes), list(routes.values()), list(unless_idle), mail_kind
    )
    if found is None or found["unknown"]:
        return None
    return set(found["ids"])


async def route_served(conn: asyncpg.Connection | asyncpg.Pool, route: str) -> bool:
    """Whether a live worker publishes ``route`` (``sandbox``: it has Docker)."""
    return any(route in ((w["stats"] or {}).get("routes") or ()) for w in await live_workers(conn))


async def published_cards(conn: asyncpg.Connection | asyncpg.Pool, name: str) -> list[Any]:
    """What each live worker publishes about agent ``name`` (see :mod:`toren._agent.directory`)."""
    rows = await conn.fetch(
        f"SELECT w.stats->'agents'->$1 AS card FROM toren.workers w "
        f"WHERE w.worker_id IN ({LIVE_WORKERS}) AND w.stats->'agents' ? $1",
        name,
    )
    return [r["card"] for r in rows]


LIVE_CARDS = f"""
    SELECT c.agent, c.card, w.stats->'routes' AS routes, v.first_seen, w.started_at
    FROM toren.workers w
    CROSS JOIN LATERAL jsonb_each(CASE jsonb_typeof(w.stats->'agents')
                                  WHEN 'object' THEN w.stats->'agents' ELSE '{{}}'::jsonb END)
        AS c(agent, card)
    LEFT JOIN toren.agent_versions v ON v.agent = c.agent AND v.version = c.card->>'version'
    WHERE w.worker_id IN ({LIVE_WORKERS})
"""
"""What each live worker publishes about each agent it runs: ``agent``, ``card``, the worker's
``routes`` and ``started_at``, and when the card's version was first seen (``first_seen``,
from ``toren.agent_versions``, noted as workers register)."""

NEWEST_FIRST = "c.first_seen DESC NULLS LAST, c.started_at DESC"
"""The order of :data:`LIVE_CARDS` (as ``c``) that puts an agent's newest version first: the
one definition of an agent's newest version. It is, among the versions live workers serve, the
one first seen latest, so that a restarted worker of an older version does not make that
version the newest again (it keeps the time it was first seen). A version no worker noted (one
published by a worker of a release before the table) comes after; among workers of one
version, the card of the latest started."""


async def newest_card(conn: Db, name: str) -> Any | None:
    """What a live worker running agent ``name`` publishes about its newest version (see
    :data:`NEWEST_FIRST`; ``None``: no live worker has published it)."""
    return await conn.fetchval(
        f"SELECT c.card FROM ({LIVE_CARDS}) AS c WHERE c.agent = $1 "
        f"ORDER BY {NEWEST_FIRST} LIMIT 1",
        name,
    )


async def newest_cards(conn: Db) -> dict[str, Any]:
    """The card of each agent's newest version (see :data:`NEWEST_FIRST`), by agent, in one
    statement."""
    rows = await conn.fetch(
        f"SELECT DISTINCT ON (c.agent) c.agent, c.card FROM ({LIVE_CARDS}) AS c "
        f"ORDER BY c.agent, {NEWEST_FIRST}"
    )
    return {r["agent"]: r["card"] for r in rows}


_REROUTE_UNSERVED = f"""
WITH live AS (
    SELECT w.worker_id, w.stats->'routes' AS routes FROM toren.workers w
    WHERE w.worker_id IN ({LIVE_WORKERS})
), moves AS (
    -- Only to a route that a live worker publishing the agent's newest version serves.
    SELECT m.base, m.target
    FROM unnest($2::text[], $3::text[], $8::text[]) AS m(base, target, agent)
    WHERE (SELECT c.routes ? m.target FROM ({LIVE_CARDS}) AS c
           WHERE c.agent = m.agent AND jsonb_typeof(c.routes) = 'array' AND c.routes ? m.base
           ORDER BY {NEWEST_FIRST} LIMIT 1)
), moved AS (
    UPDATE toren.actors a SET route = m.target, args = a.args - $6::text[]
    FROM moves m
    WHERE a.actor_id IN (SELECT mb.actor_id FROM toren.mailbox mb)
      AND NOT EXISTS (SELECT 1 FROM toren.mailbox mb
                      WHERE mb.actor_id = a.actor_id AND mb.kind = ANY($7::text[]))
      AND a.kind = $1 AND a.status = 'live'
      AND split_part(a.route, '@', 1) = m.base AND a.route <> m.base AND a.route <> m.target
      AND a.run_status = ANY($4::text[])
      AND NOT EXISTS (SELECT 1 FROM unnest($5::text[]) AS k(key)
                      WHERE coalesce(a.summary->k.key, '[]'::jsonb) <> '[]'::jsonb)
      -- Its route served by no live worker, and held by none, as this statement sees them;
      -- nothing moves while a live worker has not said what it serves (one just started).
      AND NOT EXISTS (SELECT 1 FROM live l WHERE l.routes ? a.route)
      AND NOT EXISTS (SELECT 1 FROM live l WHERE jsonb_typeof(l.routes) IS DISTINCT FROM 'array')
      AND (a.owner IS NULL OR a.owner NOT IN (SELECT l.worker_id FROM live l))
    RETURNING a.actor_id
)
SELECT array_agg(actor_id ORDER BY actor_id) AS moved,
       count(pg_notify('toren_mail', actor_id)) AS told
FROM moved
"""


async def reroute_unserved(
    db: asyncpg.Connection | asyncpg.Pool,
    kind: str,
    moves: Mapping[str, tuple[str, str]],
    *,
    run_statuses: Collection[str],
    empty: Collection[str] = (),
    clear_args: Collection[str] = (),
    unless_mail: Collection[str] = (),
) -> list[str]:
    """Re-route the actors stranded on a variant of a route (``BASE@VARIANT``) that no live
    worker serves to another variant, in one statement; they are told of their mail at once.

    ``moves`` maps an agent's base route to the agent and the route its stranded actors go
    to; a move is made only if a live worker publishing the agent's newest version
    (:data:`NEWEST_FIRST`) serves the base and that route. An actor moves
    only if it is of ``kind``, live, has mail, its run status is one of ``run_statuses``, each
    key of ``empty`` in its summary is an empty list (or absent), and no live worker serves its
    route or holds it, all as the statement sees them (two callers at once move it once: the
    second finds it on a served route). Nothing moves while a live worker has not published its
    routes yet. An actor with a message of a kind in ``unless_mail`` waiting is left where it
    is; ``clear_args`` are removed from the moved actors' arguments.

    Returns:
        The ids of the actors moved.
    """
    if not moves:
        return []
    bases = sorted(moves)
    moved: list[str] | None = await db.fetchval(
        _REROUTE_UNSERVED,
        kind,
        bases,
        [moves[b][1] for b in bases],
        list(run_statuses),
        list(empty),
        list(clear_args),
        list(unless_mail),
        [moves[b][0] for b in bases],
    )
    return moved or []


_HOUSEKEEP = f"""
WITH gone AS (
    DELETE FROM toren.workers WHERE worker_id NOT IN ({LIVE_WORKERS}) RETURNING 1
), keys AS (
    DELETE FROM toren.dedupe WHERE ctid = ANY(ARRAY(
        SELECT ctid FROM toren.dedupe
        WHERE created_at < now() - make_interval(secs => $1) LIMIT 10000))
    RETURNING 1
), replies AS (
    DELETE FROM toren.replies WHERE created_at < now() - interval '1 hour' RETURNING 1
), windows AS (
    DELETE FROM toren.restart_windows
    WHERE restarts[cardinality(restarts)] < now() - interval '1 day' RETURNING 1
), sessions AS (
    DELETE FROM toren.sessions WHERE expires_at < now() RETURNING 1
), tokens AS (
    -- dead (revoked or expired, whichever came first) for longer than $2; a live token, however
    -- old, never matches (least() skips NULLs; both NULL is NULL); its sessions go by cascade
    DELETE FROM toren.tokens
    WHERE least(revoked_at, expires_at) < now() - make_interval(secs => $2) RETURNING 1
), rates AS (
    -- rate windows are minutes of a worker's clock: gone an hour after their last take
    DELETE FROM toren.rate_windows WHERE touched_at < now() - interval '1 hour' RETURNING 1
), blocks AS (
    DELETE FROM toren.rate_blocks WHERE noted_at < now() - interval '1 day' RETURNING 1
)
SELECT (SELECT count(*) FROM gone) AS workers, (SELECT count(*) FROM keys) AS keys,
       (SELECT count(*) FROM replies) AS replies, (SELECT count(*) FROM windows) AS windows,
       (SELECT count(*) FROM sessions) AS sessions, (SELECT count(*) FROM tokens) AS tokens,
       (SELECT count(*) FROM rates) AS rates,
       (SELECT count(*) FROM blocks) AS blocks
"""


async def housekeep(
    pool: asyncpg.Pool, *, dedupe_retention: float, token_keep_for: float = 30 * 86400.0
) -> dict[str, int]:
    """Delete what nobody will read again: registry rows of dead workers, dedupe keys past their
    retention (in batches), replies older than an hour (their ask() has long timed out),
    restart windows whose last restart is a day old, expired console sessions, API tokens
    revoked or expired more than ``token_keep_for`` seconds ago (with their sessions), rate
    windows untouched for an hour and 429 blocks noted a day ago.

    Returns:
        How many rows of each were deleted.
    """
    row = await pool.fetchrow(_HOUSEKEEP, float(dedupe_retention), float(token_keep_for))
    return dict(row) if row is not None else {}
