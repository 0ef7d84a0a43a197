"""Concurrency limits shared by every worker, kept in Postgres.

A limit is a name and a cap (``toren.limits``). An actor lists the limits it must hold to run
(``toren.actors.limits``, in the order it takes them; an actor without limits pays nothing).
It runs its user mail only while it holds a permit of each (``toren.permits``); when a limit is
full it waits in that limit's queue (``toren.limit_queue``, first come first served), holding no
lease and no worker. Its due user mail waits with it out of every claim's sight (``visible_at``
``'infinity'``), so a thousand waiting actors cost a sweep nothing; it is shown again when a
permit is handed to it. Its system mail (a cancel) is claimed all the same: an actor that stops
running while it waits (a run cancelled in the queue) leaves the queue for good, and the mail it
waited with is never handled. A waiting actor that passivates keeps its place. Permits belong to
the actor, not to a worker: a worker that dies leaves them with the actor until another worker
takes it over.

Who writes what (each in the statement that already does the work):

- a start (:func:`impose`, in the start's transaction): the actor's limits; its permits, or its
  place in the queue in order of arrival;
- the claim of an actor's next message (the ``limits`` fragment of
  :data:`toren._core.step_sql.CLAIM_FRAGMENTS`): the permits it lacks, or its place in a queue;
- the step after which the actor no longer runs (the ``limits`` fragment of the step statement,
  when :meth:`toren.Actor.runs` says so), passivation and failure: its permits and queue places
  deleted, and each freed permit given to the head of its queue, who is notified
  (``toren_mail``) so that a worker claims it at once; no loop polls the queues;
- a step of an actor without limits, or one that runs on: nothing.

Locks: every statement that takes or hands on permits locks the ``toren.limits`` rows it
touches in the order of their names first, so two of them never wait on each other in a cycle.
Permits are taken in the actor's own order (narrowest first: a key's before its agent's), and
an actor waiting on one limit keeps those it took: with one order for all, holding and waiting
cannot deadlock.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING

import asyncpg
import attrs

if TYPE_CHECKING:
    from typing import TypeAlias

    from toren._core.client import Connection

    Db: TypeAlias = asyncpg.Pool | Connection


@attrs.frozen(kw_only=True)
class Wait:
    """Why an actor does not run: it waits for a permit of ``limit`` (of ``cap``), ``position``
    in its queue (1: next)."""

    limit: str
    position: int
    cap: int | None


@attrs.frozen(kw_only=True)
class Usage:
    """A limit as it stands: its cap, how many hold a permit, how many wait."""

    name: str
    cap: int
    held: int
    queued: int


_SET_CAPS = """
WITH wanted AS (
    SELECT * FROM unnest($1::text[], $2::int[]) AS w(name, cap)
), locked AS (
    SELECT l.name FROM toren.limits l JOIN wanted w USING (name) ORDER BY l.name FOR UPDATE OF l
), upserted AS (
    INSERT INTO toren.limits (name, cap)
    SELECT w.name, w.cap FROM wanted w WHERE (SELECT count(*) FROM locked) >= 0
    ORDER BY w.name
    ON CONFLICT (name) DO UPDATE SET cap = excluded.cap WHERE toren.limits.cap <> excluded.cap
    RETURNING name
)
SELECT count(*) FROM upserted
"""

_HAND_ON = "SELECT coalesce(sum(toren.hand_on(name)), 0) FROM unnest($1::text[]) AS n(name)"


async def set_caps(db: Db, caps: Mapping[str, int]) -> None:
    """Create or change limits (a worker at boot, for the agents it serves); a raised cap
    hands its new room to the heads of the queue at once.

    Raises:
        asyncpg.CheckViolationError: a cap below 1 (callers check first).
    """
    if not caps:
        return
    names = sorted(caps)
    async with _transaction(db) as conn:
        await conn.execute(_SET_CAPS, names, [caps[n] for n in names])
        await conn.fetchval(_HAND_ON, names)


async def impose_limit(conn: Connection, name: str, cap: int) -> None:
    """Create limit ``name`` with ``cap`` if it does not exist (an existing one keeps its cap),
    in ``conn``'s transaction."""
    await conn.execute(
        "INSERT INTO toren.limits (name, cap) VALUES ($1, $2) ON CONFLICT (name) DO NOTHING",
        name,
        cap,
    )


_SET_FAMILY = """
WITH changed AS (
    UPDATE toren.limits SET cap = $2
    WHERE starts_with(name, $1) AND cap <> $2
    RETURNING name
)
SELECT coalesce(array_agg(name ORDER BY name), '{}') FROM changed
"""


async def set_family_cap(db: Db, prefix: str, cap: int) -> None:
    """Set the cap of every existing limit whose name starts with ``prefix`` (the per-key
    limits of an agent, when its per-key cap changes), handing on new room."""
    async with _transaction(db) as conn:
        changed = await conn.fetchval(_SET_FAMILY, prefix, cap)
        if changed:
            await conn.fetchval(_HAND_ON, changed)


_IMPOSE = """
WITH wanted AS (
    SELECT * FROM unnest($2::text[], $3::int[]) WITH ORDINALITY AS w(name, cap, ord)
), created AS (
    -- A limit named with a cap is created with it if it does not exist yet (a key's).
    INSERT INTO toren.limits (name, cap)
    SELECT name, cap FROM wanted WHERE cap IS NOT NULL ORDER BY name
    ON CONFLICT (name) DO NOTHING
    RETURNING name
), kept AS (
    -- A limit named without one counts only if it exists (an agent's, once a worker set it).
    SELECT w.name, w.ord FROM wanted w
    WHERE w.cap IS NOT NULL OR EXISTS (SELECT 1 FROM toren.limits l WHERE l.name = w.name)
)
UPDATE toren.actors SET limits = ARRAY(SELECT name FROM kept ORDER BY ord)
WHERE actor_id = $1 AND EXISTS (SELECT 1 FROM kept) AND (SELECT count(*) FROM created) >= 0
RETURNING limits
"""


async def impose(conn: Connection, actor_id: str, limits: Sequence[tuple[str, int | None]]) -> bool:
    """Put a new actor under ``limits`` (``(name, cap)``, in the order it takes them) in
    ``conn``'s transaction, and take its permits or its place in the queues now, so that actors
    started one after another run in that order.

    A limit given a cap is created with it if it does not exist (an existing one keeps its
    cap); one given ``None`` applies only if it exists.

    Returns:
        True if it holds every permit (or is under no limit), False if it waits.
    """
    if not limits:
        return True
    set_ = await conn.fetchval(_IMPOSE, actor_id, [n for n, _ in limits], [c for _, c in limits])
    if not set_:
        return True
    took: bool = await conn.fetchval("SELECT toren.take_permits($1)", actor_id)
    return took


_WAITS = """
SELECT q.actor_id, q.name, l.cap,
       (SELECT count(*) FROM toren.limit_queue h WHERE h.name = q.name AND h.seq <= q.seq)
           AS position
FROM toren.limit_queue q LEFT JOIN toren.limits l ON l.name = q.name
WHERE q.actor_id = ANY($1::text[])
ORDER BY q.seq
"""


async def waits(db: Db, actor_ids: Iterable[str]) -> dict[str, Wait]:
    """Which actors of ``actor_ids`` wait for a permit, and on what (the limit they waited on
    longest, if several)."""
    ids = list(actor_ids)
    if not ids:
        return {}
    out: dict[str, Wait] = {}
    for r in await db.fetch(_WAITS, ids):
        out.setdefault(
            r["actor_id"], Wait(limit=r["name"], position=int(r["position"]), cap=r["cap"])
        )
    return out


_USAGE = """
SELECT l.name, l.cap,
       (SELECT count(*) FROM toren.permits h WHERE h.name = l.name) AS held,
       (SELECT count(*) FROM toren.limit_queue q WHERE q.name = l.name) AS queued
FROM toren.limits l
WHERE ($1::text[] IS NULL AND $2::text IS NULL) OR l.name = ANY($1::text[])
   OR starts_with(l.name, $2::text)
ORDER BY l.name
"""


async def usage(
    db: Db, names: Sequence[str] | None = None, *, prefix: str | None = None
) -> list[Usage]:
    """Limits (those named, those whose names start with ``prefix``, or all) with how many hold
    a permit of each and how many wait."""
    rows = await db.fetch(_USAGE, list(names) if names is not None else None, prefix)
    return [
        Usage(name=r["name"], cap=r["cap"], held=int(r["held"]), queued=int(r["queued"]))
        for r in rows
    ]


async def permits_of(db: Db, actor_id: str) -> list[str]:
    """The limits ``actor_id`` holds a permit of."""
    rows = await db.fetch(
        "SELECT name FROM toren.permits WHERE actor_id = $1 ORDER BY name", actor_id
    )
    return [r["name"] for r in rows]


@contextlib.asynccontextmanager
async def _transaction(db: Db) -> AsyncIterator[Connection]:
    """A transaction on a connection of ``db`` (a pool), or on ``db`` itself (joined)."""
    if isinstance(db, asyncpg.Pool):
        async with db.acquire() as conn, conn.transaction():
            yield conn
    else:
        async with db.transaction():
            yield db
