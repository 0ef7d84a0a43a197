"""Leases and fencing: who runs which actor, claimed, renewed and given up.

Ownership of an actor is its row: ``owner`` (a worker incarnation id), ``epoch`` (raised by every
claim) and ``lease_expires_at``. A worker may claim an actor that has visible mail and is either
unowned, past its lease, or owned by a worker that is not alive (it no longer holds its
session's advisory lock, :mod:`toren._core.session`): a dead worker's actors move on at once.
Lease expiry still bounds the case of a host that vanished with its sockets open.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import Any

import asyncpg
import attrs

from toren._core.actor import ActorFailed, ChildFailed
from toren._core.codec import encode
from toren._core.errors import FencedOut, LeaseExpired
from toren._core.json_text import safe_text
from toren._core.killpoints import kill_point
from toren._core.session import LIVE_WORKERS


@attrs.frozen(kw_only=True)
class Claim:
    """An actor this worker now owns at ``epoch``; ``sent_at`` is when (by this process's
    monotonic clock) the claim was sent, the earliest its lease can have started."""

    actor_id: str
    kind: str
    args: dict[str, Any]
    epoch: int
    sent_at: float = 0.0


class LeaseClock:
    """How long this worker's lease on one claimed actor certainly holds, by its own clock.

    A lease runs from when the statement that took or renewed it was *sent* (never later than
    Postgres started it), so the clock errs towards expiry. :meth:`ensure` is what a host checks
    before an effect (a model call, a tool run): with less than ``margin`` seconds left it
    raises, and the actor stops without the effect. A paused process (GC, a stopped VM) wakes
    to an expired clock even if no renewal has told it yet that another worker took over.
    """

    def __init__(
        self,
        actor_id: str,
        *,
        lease: float,
        margin: float,
        sent_at: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.actor_id = actor_id
        self.lease = lease
        self.margin = margin
        self._clock = clock
        self.expires_at = sent_at + lease

    def renewed(self, sent_at: float) -> None:
        """A renewal sent at ``sent_at`` came back holding the claim (no effect once lost)."""
        if self.expires_at != float("-inf"):
            self.expires_at = max(self.expires_at, sent_at + self.lease)

    def lost(self) -> None:
        """The claim is gone (taken over, or the worker's lock was lost); for good."""
        self.expires_at = float("-inf")

    def remaining(self) -> float:
        """Seconds until the lease may lapse (negative once it may have)."""
        return self.expires_at - self._clock()

    def ensure(self) -> None:
        """Raise unless the lease holds for at least ``margin`` seconds more.

        Raises:
            LeaseExpired: it may not.
        """
        left = self.remaining()
        if left < self.margin:
            raise LeaseExpired(self.actor_id, self.margin - left)


# Actors with mail are found in two ways, so that a sweep costs per actor that can run now, not
# per actor with any mail nor per message:
# - mail sent to be handled at once (``visible_at <= created_at``) by skipping through the
#   partial index ``mailbox_immediate`` one distinct actor at a time (a loose index scan): a
#   backlog of many messages for a few busy actors stays cheap;
# - mail sent for later (durable timers, delayed sends, retry backoffs) through the partial index
#   ``mailbox_delayed`` on its due time: only what is due now is read, so runs asleep on timers
#   far in the future cost nothing.
_CLAIMABLE = f"""
WITH RECURSIVE immediate(actor_id) AS (
    (SELECT actor_id FROM toren.mailbox
     WHERE visible_at <= created_at AND ($3::text[] IS NULL OR actor_id = ANY($3::text[]))
     ORDER BY actor_id LIMIT 1)
    UNION ALL
    SELECT (SELECT m.actor_id FROM toren.mailbox m
            WHERE m.visible_at <= m.created_at AND m.actor_id > w.actor_id
              AND ($3::text[] IS NULL OR m.actor_id = ANY($3::text[]))
            ORDER BY m.actor_id LIMIT 1)
    FROM immediate w WHERE w.actor_id IS NOT NULL
), with_mail(actor_id) AS (
    SELECT actor_id FROM immediate WHERE actor_id IS NOT NULL
    UNION
    SELECT actor_id FROM toren.mailbox
    WHERE visible_at > created_at AND visible_at <= now()
      AND ($3::text[] IS NULL OR actor_id = ANY($3::text[]))
), live AS ({LIVE_WORKERS}
), cand AS (
    -- An array, not a join: the planner then looks each actor up by its key, however many
    -- rows it guesses the mailbox scans will find.
    SELECT a.actor_id FROM toren.actors a
    WHERE a.actor_id = ANY(ARRAY(SELECT actor_id FROM with_mail))
      AND a.status = 'live'
      AND a.kind = ANY($4::text[])
      AND (a.route IS NULL OR a.route = ANY($6::text[]))
      -- Never an actor this worker hosts now (its renewal extends that lease), but one it owns
      -- and lost track of (a release that failed, a claim whose answer was lost) is fair game.
      AND NOT (a.actor_id = ANY($5::text[]))
      AND (a.owner IS NULL OR a.owner = $1 OR a.lease_expires_at < now()
           OR a.owner NOT IN (SELECT worker_id FROM live))
      AND EXISTS (SELECT 1 FROM toren.mailbox m
                  WHERE m.actor_id = a.actor_id AND m.visible_at <= now())
      -- An actor waiting in a limit's queue is not claimed (the permit handed to it wakes a
      -- worker), except for its system mail: a cancel ends it and takes it out of the queue.
      AND (a.limits IS NULL
           OR NOT EXISTS (SELECT 1 FROM toren.limit_queue q WHERE q.actor_id = a.actor_id)
           OR EXISTS (SELECT 1 FROM toren.mailbox m
                      WHERE m.actor_id = a.actor_id AND m.lane = 0 AND m.visible_at <= now()))
      AND $1 IN (SELECT worker_id FROM live)
    LIMIT $2
    FOR NO KEY UPDATE OF a SKIP LOCKED
)"""

_CLAIM = f"""{_CLAIMABLE}
UPDATE toren.actors a
SET owner = $1, epoch = a.epoch + 1, lease_expires_at = now() + make_interval(secs => $7)
FROM cand WHERE a.actor_id = cand.actor_id
RETURNING a.actor_id, a.kind, a.args, a.epoch
"""


async def waiting(
    pool: asyncpg.Pool,
    worker_id: uuid.UUID,
    *,
    limit: int,
    kinds: list[str],
    hosted: list[str],
    only: list[str] | None = None,
    routes: list[str] | None = None,
) -> int:
    """How many actors (up to ``limit``) this worker could claim now: demand for a full worker."""
    count: int = await pool.fetchval(
        f"{_CLAIMABLE} SELECT count(*) FROM cand",
        worker_id,
        limit,
        only,
        kinds,
        hosted,
        routes or [],
    )
    return count


async def claim(
    pool: asyncpg.Pool,
    worker_id: uuid.UUID,
    *,
    limit: int,
    lease: float,
    kinds: list[str],
    hosted: list[str],
    only: list[str] | None = None,
    routes: list[str] | None = None,
) -> list[Claim]:
    """Claim up to ``limit`` runnable actors of ``kinds`` (``only`` those named, if given).

    A claim raises the actor's epoch, which fences out every earlier owner. A worker claims only
    kinds it has classes for (workers may run different apps on one database), never an actor
    it ``hosted`` now (its own renewal extends that lease; an actor it owns but does not host
    is claimed again, so nothing stays stranded), and nothing once its own lock is gone. An
    actor spawned with a ``route`` is claimed only by workers that serve it (``routes``): a run
    of an agent goes only to workers whose app defines that agent.
    """
    if limit <= 0 or not kinds:
        return []
    kill_point("actor.claiming")
    sent_at = time.monotonic()
    rows = await pool.fetch(
        _CLAIM, worker_id, limit, only, kinds, hosted, routes or [], float(lease)
    )
    if rows:
        kill_point("actor.claimed")
    return [
        Claim(
            actor_id=r["actor_id"],
            kind=r["kind"],
            args=r["args"],
            epoch=r["epoch"],
            sent_at=sent_at,
        )
        for r in rows
    ]


# The rows are locked in actor id order, as a group commit's batch locks its members' rows
# (toren._core.group_commit): in any other order, a renewal and a batch can each hold a row
# the other waits for.
_RENEW = """
WITH mine AS (
    SELECT * FROM unnest($4::text[], $5::bigint[]) AS m(actor_id, epoch)
), locked AS (
    SELECT a.actor_id FROM toren.actors a JOIN mine ON a.actor_id = mine.actor_id
    WHERE a.owner = $1 AND a.epoch = mine.epoch
    ORDER BY a.actor_id
    FOR NO KEY UPDATE OF a
), renewed AS (
    UPDATE toren.actors a SET lease_expires_at = now() + make_interval(secs => $2)
    FROM locked WHERE a.actor_id = locked.actor_id
    RETURNING a.actor_id, a.epoch
), beat AS (
    UPDATE toren.workers SET heartbeat_at = now(), stats = $3
    WHERE worker_id = $1 RETURNING 1
)
SELECT (SELECT count(*) FROM beat) AS registered,
       (SELECT coalesce(array_agg(actor_id || '@' || epoch), '{}') FROM renewed) AS held
"""


async def renew(
    pool: asyncpg.Pool,
    worker_id: uuid.UUID,
    claims: list[tuple[str, int]],
    *,
    lease: float,
    stats: dict[str, Any],
) -> set[tuple[str, int]] | None:
    """Renew the leases of ``claims`` (``(actor_id, epoch)`` pairs) in one statement, and
    publish the worker's statistics.

    Only the claims named are renewed and judged: a claim taken while this statement ran is
    neither (its lease is fresh), so a renewal never mistakes a new claim for a lost one.

    Returns:
        The pairs still held (owner and epoch unchanged), or ``None`` if the worker's registry
        row is gone (another worker judged it dead).
    """
    row = await pool.fetchrow(
        _RENEW,
        worker_id,
        float(lease),
        stats,
        [c[0] for c in claims],
        [c[1] for c in claims],
    )
    if row is None or not row["registered"]:
        return None
    held: set[tuple[str, int]] = set()
    for item in row["held"]:
        actor_id, _, epoch = item.rpartition("@")
        held.add((actor_id, int(epoch)))
    return held


_RELEASE_IF_IDLE = """
WITH mine AS (
    SELECT 1 FROM toren.actors WHERE actor_id = $1 AND owner = $2 AND epoch = $3
), pending AS (
    SELECT 1 FROM toren.mailbox WHERE actor_id = $1 AND visible_at <= now() LIMIT 1
), released AS (
    UPDATE toren.actors SET owner = NULL, lease_expires_at = NULL
    WHERE actor_id = $1 AND owner = $2 AND epoch = $3 AND NOT EXISTS (SELECT 1 FROM pending)
    RETURNING limits
), freed AS (
    -- Passivated, it no longer runs: permits it still holds go to the heads of their queues.
    -- Not an actor that waits in a queue (it was hosted for its system mail): it keeps its
    -- place, and the permits it took before it (a key's, while it waits for its agent's).
    SELECT toren.release_permits($1) FROM released
    WHERE released.limits IS NOT NULL
      AND NOT EXISTS (SELECT 1 FROM toren.limit_queue q WHERE q.actor_id = $1)
)
SELECT (SELECT count(*) FROM mine) AS mine, (SELECT count(*) FROM released) AS released,
       (SELECT count(*) FROM freed) AS freed
"""


async def release_if_idle(pool: asyncpg.Pool, actor_id: str, owner: uuid.UUID, epoch: int) -> bool:
    """Give up the lease if no message is waiting (passivation).

    Returns:
        True if released; False if mail arrived meanwhile (keep handling).

    Raises:
        FencedOut: the actor is no longer ours.
    """
    row = await pool.fetchrow(_RELEASE_IF_IDLE, actor_id, owner, epoch)
    if row is None or not row["mine"]:
        raise FencedOut(actor_id, epoch)
    return bool(row["released"])


_RELEASE_CLAIM = """
WITH released AS (
    UPDATE toren.actors SET owner = NULL, lease_expires_at = NULL
    WHERE actor_id = $1 AND owner = $2 AND epoch = $3
    RETURNING actor_id
)
SELECT count(pg_notify('toren_mail', actor_id)) FROM released
"""


async def release_claim(pool: asyncpg.Pool, actor_id: str, owner: uuid.UUID, epoch: int) -> bool:
    """Give up one claim, if it is still ours at that epoch, and wake workers to claim it.

    Returns:
        True if released; False if the claim had already moved on (nothing to do).
    """
    count: int = await pool.fetchval(_RELEASE_CLAIM, actor_id, owner, epoch)
    return count > 0


_RELEASE = """
WITH released AS (
    UPDATE toren.actors SET owner = NULL, lease_expires_at = NULL
    WHERE owner = $1
    RETURNING actor_id
)
SELECT count(pg_notify('toren_mail', actor_id)) FROM released
"""


async def release(pool: asyncpg.Pool | asyncpg.Connection, worker_id: uuid.UUID) -> int:
    """Release every lease of this worker incarnation and wake other workers to claim them.

    Returns:
        How many leases were released.
    """
    count: int = await pool.fetchval(_RELEASE, worker_id)
    return count


_FAIL = """
WITH failed AS (
    UPDATE toren.actors SET status = 'failed', failure = $4, owner = NULL, lease_expires_at = NULL,
        summary = CASE WHEN summary IS NULL THEN NULL
                       ELSE summary || jsonb_build_object('status', 'failed',
                                                          'error_class', $9::text) END
    WHERE actor_id = $1 AND owner = $2 AND epoch = $3
    RETURNING actor_id, kind, parent, limits
), freed AS (
    -- A failed actor no longer runs: its permits and places in queues go to the others.
    SELECT toren.release_permits(f.actor_id) FROM failed f WHERE f.limits IS NOT NULL
), recorded AS (
    -- The journal says so too, so that the actor's own fold (and every reader of it) agrees.
    INSERT INTO toren.journal (actor_id, seq, epoch, type, data)
    SELECT f.actor_id,
           coalesce((SELECT max(seq) FROM toren.journal WHERE actor_id = f.actor_id), 0) + 1,
           $3, $7, $8
    FROM failed f
    RETURNING actor_id
), told AS (
    INSERT INTO toren.mailbox (actor_id, lane, sender, kind, body)
    SELECT f.parent, 0, f.actor_id, $5, $6
    FROM failed f JOIN toren.actors p ON p.actor_id = f.parent
    RETURNING actor_id
)
SELECT (SELECT count(*) FROM failed) AS failed,
       (SELECT count(*) FROM recorded) AS recorded,
       (SELECT count(pg_notify('toren_mail', actor_id)) FROM told) AS told,
       -- Followers of its journal (event streams) see the failure at once; a failure is rare.
       (SELECT count(pg_notify('toren_journal', actor_id)) FROM recorded) AS followers,
       (SELECT count(*) FROM freed) AS freed
"""


async def mark_failed(
    pool: asyncpg.Pool, actor_id: str, kind: str, owner: uuid.UUID, epoch: int, error: str
) -> bool:
    """Mark an actor failed (escalation): append :class:`ActorFailed` to its journal, set its
    summary's status, and tell its parent with :class:`ChildFailed`, in one statement.

    Returns:
        False if the actor was no longer ours (the next owner decides its fate).
    """
    error = safe_text(error)
    name, body = encode(ChildFailed(actor_id=actor_id, kind=kind, error=error))
    failed = ActorFailed(error=error)
    event, data = encode(failed)
    row = await pool.fetchrow(
        _FAIL, actor_id, owner, epoch, error, name, body, event, data, failed.error_class
    )
    return bool(row and row["failed"])
