"""The registry of live workers, as others read it: the ring of death watches, the workers'
published statistics and routes (what the agent directory and the surfaces read), and the
housekeeping that deletes what dead workers and old requests left behind.
"""

from __future__ import annotations

import logging
import uuid
from typing import Any

import asyncpg

from toren._core.db import connect
from toren._core.session import LIVE_WORKERS, LOCK_NAMESPACE

log = logging.getLogger("toren.leases")  # the name operators' log filters know


_SUCCESSOR = f"""
SELECT w.lock_key FROM toren.workers w
WHERE w.worker_id IN ({LIVE_WORKERS}) AND w.worker_id <> $1
ORDER BY w.lock_key <= $2, w.lock_key
LIMIT 1
"""


async def open_death_watch(url: str, *, recheck: float) -> asyncpg.Connection:
    """A dedicated connection for :func:`watch_successor`.

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


async def watch_successor(
    conn: asyncpg.Connection, worker_id: uuid.UUID, lock_key: int
) -> bool | None:
    """Wait until the next live worker in lock-key order (a ring) dies.

    Workers watch each other in a ring, so that each one has a watcher: the wait is a shared
    request on the peer's advisory lock, granted the instant Postgres drops the dead peer's
    session. That turns a worker's death into an event instead of something the next poll finds.

    Returns:
        True if the watched worker died (or stopped); False if the wait timed out (call again at
        once: the ring may have changed); None if there is no peer to watch.
    """
    peer: int | None = await conn.fetchval(_SUCCESSOR, worker_id, lock_key)
    if peer is None:
        return None
    try:
        await conn.execute("SELECT pg_advisory_lock_shared($1, $2)", LOCK_NAMESPACE, peer)
    except asyncpg.LockNotAvailableError:
        return False
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


async def newest_card(conn: asyncpg.Connection | asyncpg.Pool, name: str) -> Any | None:
    """What the most recently started live worker running agent ``name`` publishes about it
    (``None``: no live worker has published it)."""
    return await conn.fetchval(
        f"SELECT w.stats->'agents'->$1 FROM toren.workers w "
        f"WHERE w.worker_id IN ({LIVE_WORKERS}) AND w.stats->'agents' ? $1 "
        f"ORDER BY w.started_at DESC LIMIT 1",
        name,
    )


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
), rates AS (
    -- rate windows are minutes of a worker's clock: gone an hour after their last take
    DELETE FROM toren.rate_windows WHERE touched_at < now() - interval '1 hour' RETURNING 1
), blocks AS (
    DELETE FROM toren.rate_blocks WHERE noted_at < now() - interval '1 day' RETURNING 1
)
SELECT (SELECT count(*) FROM gone) AS workers, (SELECT count(*) FROM keys) AS keys,
       (SELECT count(*) FROM replies) AS replies, (SELECT count(*) FROM windows) AS windows,
       (SELECT count(*) FROM sessions) AS sessions, (SELECT count(*) FROM rates) AS rates,
       (SELECT count(*) FROM blocks) AS blocks
"""


async def housekeep(pool: asyncpg.Pool, *, dedupe_retention: float) -> dict[str, int]:
    """Delete what nobody will read again: registry rows of dead workers, dedupe keys past their
    retention (in batches), replies older than an hour (their ask() has long timed out),
    restart windows whose last restart is a day old, expired console sessions, rate
    windows untouched for an hour and 429 blocks noted a day ago.

    Returns:
        How many rows of each were deleted.
    """
    row = await pool.fetchrow(_HOUSEKEEP, float(dedupe_retention))
    return dict(row) if row is not None else {}
