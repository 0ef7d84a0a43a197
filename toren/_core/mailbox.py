"""Mailboxes: sending, claiming the next message, committing a step, failures and dead letters.

Every statement an owner issues is fenced: it checks ``owner = me AND epoch = mine`` on the
actor's row in the same statement, and the step commit takes a share lock on that row so a
concurrent claim (which raises the epoch) either waits for the step or fences it out. A step is
one statement, hence one transaction and one round trip: consume the message, append the events,
spawn children, insert the outgoing messages and timers, store the reply, notify recipients (and
followers of the journal, if the actor has any), and claim the actor's next message.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import asyncpg

if TYPE_CHECKING:
    from toren._core.client import Connection

from toren._core.actor import SYSTEM_LANE, USER_LANE, Context, Envelope, PoisonMessage
from toren._core.codec import decode, encode
from toren._core.errors import (
    ActorAlreadyExists,
    ActorNotLive,
    FencedOut,
    MailboxFull,
    UnknownActor,
)
from toren._core.json_text import dumps, safe_text

_SEND = """
WITH target AS (
    SELECT actor_id, max_depth, status FROM toren.actors WHERE actor_id = $1
), depth AS (
    SELECT count(*) AS n FROM (
        SELECT 1 FROM toren.mailbox WHERE actor_id = $1 AND lane = 1
        LIMIT (SELECT max_depth FROM target)) s
), ok AS (
    SELECT 1 FROM target, depth
    WHERE target.status = 'live' AND ($2 = 0 OR depth.n < target.max_depth)
), dd AS (
    INSERT INTO toren.dedupe (actor_id, key) SELECT $1, $6 FROM ok WHERE $6::text IS NOT NULL
    ON CONFLICT DO NOTHING RETURNING 1
), ins AS (
    INSERT INTO toren.mailbox (actor_id, lane, sender, kind, body, dedupe_key, reply_to, visible_at)
    SELECT $1, $2, $3, $4, $5::text::jsonb, $6, $7, now() + make_interval(secs => $8) FROM ok
    WHERE $6::text IS NULL OR EXISTS (SELECT 1 FROM dd)
    RETURNING id
), woken AS (
    SELECT pg_notify('toren_mail', $1) FROM ins WHERE $8 = 0
)
SELECT (SELECT count(*) FROM target) AS found, (SELECT status FROM target) AS status,
       (SELECT n FROM depth) AS depth,
       (SELECT count(*) FROM ok) AS ok, (SELECT id FROM ins) AS id,
       (SELECT count(*) FROM woken) AS woken
"""


async def send(
    conn: asyncpg.Connection | asyncpg.Pool | Connection,
    to: str,
    msg: Any,
    *,
    sender: str | None = None,
    system: bool = False,
    dedupe_key: str | None = None,
    delay: float = 0.0,
    reply_to: uuid.UUID | None = None,
) -> int | None:
    """Persist a message for ``to``; joins the caller's transaction when given a connection in one.

    Returns:
        The message id, or ``None`` when ``dedupe_key`` was used before for this recipient.

    Raises:
        UnknownActor: no actor ``to`` exists.
        ActorNotLive: ``to`` was marked failed (or stopped); nobody would handle the message.
        MailboxFull: ``to`` already holds its ``max_depth`` pending user messages.
    """
    kind, body = encode(msg)
    lane = SYSTEM_LANE if system else USER_LANE
    # The body travels as JSON text, so a plain asyncpg connection (the caller's own, inside its
    # transaction) works without Toren's jsonb codec.
    row = await conn.fetchrow(
        _SEND,
        to,
        lane,
        sender,
        kind,
        dumps(body),
        dedupe_key,
        reply_to,
        float(delay),
    )
    if row is None or not row["found"]:
        raise UnknownActor(to)
    if row["status"] != "live":
        raise ActorNotLive(to, row["status"])
    if not row["ok"]:
        raise MailboxFull(to, row["depth"])
    msg_id: int | None = row["id"]
    return msg_id


_CLAIM_NEXT = """
WITH fence AS (
    SELECT 1 FROM toren.actors
    WHERE actor_id = $1 AND owner = $2 AND epoch = $3 AND status = 'live'
    FOR SHARE
), next AS (
    SELECT id FROM toren.mailbox
    WHERE actor_id = $1 AND visible_at <= now() AND EXISTS (SELECT 1 FROM fence)
    ORDER BY lane, id LIMIT 1
), claimed AS (
    UPDATE toren.mailbox m SET deliveries = m.deliveries + 1
    FROM next WHERE m.id = next.id
    RETURNING m.id, m.lane, m.sender, m.kind, m.body, m.reply_to, m.deliveries, m.attempts,
              m.timer_name IS NOT NULL AS is_timer
)
SELECT (SELECT count(*) FROM fence) AS owned, c.*
FROM (SELECT 1) AS one LEFT JOIN claimed AS c ON true
"""


async def claim_next(
    pool: asyncpg.Pool, actor_id: str, owner: uuid.UUID, epoch: int
) -> Envelope | None:
    """Claim the actor's next visible message (system lane first) and raise its delivery count.

    The raised count is committed before the message is handled, so a message that kills its
    worker is charged for it.

    Raises:
        FencedOut: the actor is no longer ours.
    """
    row = await pool.fetchrow(_CLAIM_NEXT, actor_id, owner, epoch)
    if row is None or not row["owned"]:
        raise FencedOut(actor_id, epoch)
    if row["id"] is None:
        return None
    return _envelope(row)


_COMMIT = """
WITH fence AS (
    -- The row locked is its latest version: a watch set while this statement waited for the
    -- lock is seen here (see toren._core.client.JournalWatch).
    SELECT actor_id, watched_until FROM toren.actors
    WHERE actor_id = $1 AND owner = $2 AND epoch = $3 AND status = 'live'
    FOR SHARE
), clash AS (
    -- A spawn of an id that another kind holds fails the whole step.
    SELECT s.id, s.kind, a.kind AS existing
    FROM unnest($8::text[], $9::text[]) AS s(id, kind)
    JOIN toren.actors a ON a.actor_id = s.id AND a.kind <> s.kind
), consumed AS (
    DELETE FROM toren.mailbox m USING fence
    WHERE m.id = $4 AND m.actor_id = fence.actor_id AND NOT EXISTS (SELECT 1 FROM clash)
    RETURNING m.id
), nxt AS (
    -- With $23, the step claims the actor's next message in the same statement (the host then
    -- needs no claim of its own): the first visible one already queued (system lane first), not
    -- a timer this step replaces; else the first due message the step sends itself (in sent).
    SELECT m.id FROM toren.mailbox m
    WHERE $23 AND m.actor_id = $1 AND m.visible_at <= now() AND m.id <> $4
      AND (m.timer_name IS NULL OR m.timer_name <> ALL($11::text[]))
      AND EXISTS (SELECT 1 FROM consumed)
    ORDER BY m.lane, m.id LIMIT 1
), claimed AS (
    UPDATE toren.mailbox m SET deliveries = m.deliveries + 1
    FROM nxt WHERE m.id = nxt.id
    RETURNING m.id, m.lane, m.sender, m.kind, m.body, m.reply_to, m.deliveries, m.attempts,
              m.timer_name IS NOT NULL AS is_timer
), ev AS (
    INSERT INTO toren.journal (actor_id, seq, epoch, type, data)
    SELECT $1, e.seq, $3, e.type, e.data::jsonb
    FROM unnest($5::bigint[], $6::text[], $7::text[]) AS e(seq, type, data), consumed
    RETURNING 1
), sp AS (
    INSERT INTO toren.actors (actor_id, kind, args, parent, route)
    SELECT s.id, s.kind, s.args, $1, s.route
    FROM unnest($8::text[], $9::text[], $10::jsonb[], $24::text[]) AS s(id, kind, args, route),
         consumed
    ON CONFLICT (actor_id) DO NOTHING
    RETURNING 1
), cancelled AS (
    -- Setting or cancelling a timer replaces whatever is pending under its name (also a timer
    -- being retried), except the message this step consumes.
    DELETE FROM toren.mailbox m USING consumed
    WHERE m.actor_id = $1 AND m.timer_name = ANY($11::text[]) AND m.id <> $4
    RETURNING 1
), o AS (
    SELECT * FROM unnest($12::text[], $13::int[], $14::text[], $15::text[], $16::text[],
                         $17::text[], $18::float8[]) WITH ORDINALITY
        AS o(recipient, lane, kind, body, dedupe_key, timer_key, delay, ord)
    WHERE EXISTS (SELECT 1 FROM consumed)
), own AS (
    -- Nothing queued to claim: the first due message sent to itself is inserted claimed.
    SELECT o.ord FROM o
    WHERE $23 AND o.recipient = $1 AND o.delay <= 0 AND o.dedupe_key IS NULL
      AND NOT EXISTS (SELECT 1 FROM nxt)
    ORDER BY o.lane, o.ord LIMIT 1
), dd AS (
    INSERT INTO toren.dedupe (actor_id, key)
    SELECT o.recipient, o.dedupe_key FROM o WHERE o.dedupe_key IS NOT NULL
    ON CONFLICT DO NOTHING
    RETURNING actor_id, key
), sent AS (
    INSERT INTO toren.mailbox
        (actor_id, lane, sender, kind, body, dedupe_key, timer_name, visible_at, deliveries)
    SELECT o.recipient, o.lane, $1, o.kind, o.body::jsonb, o.dedupe_key, o.timer_key,
           now() + make_interval(secs => o.delay),
           CASE WHEN o.ord = (SELECT ord FROM own) THEN 1 ELSE 0 END
    FROM o
    WHERE o.dedupe_key IS NULL
       OR EXISTS (SELECT 1 FROM dd WHERE dd.actor_id = o.recipient AND dd.key = o.dedupe_key)
    RETURNING actor_id, visible_at <= now() AS due, id, lane, sender, kind, body, reply_to,
              deliveries, attempts, timer_name IS NOT NULL AS is_timer
), rep AS (
    INSERT INTO toren.replies (correlation_id, kind, body)
    SELECT $19, $20, $21::text::jsonb FROM consumed WHERE $19::uuid IS NOT NULL
    ON CONFLICT DO NOTHING
    RETURNING correlation_id
), summed AS (
    UPDATE toren.actors a SET summary = $22::jsonb
    FROM consumed WHERE a.actor_id = $1 AND $22::jsonb IS NOT NULL
    RETURNING 1
), woken AS (
    SELECT pg_notify('toren_mail', r.actor_id)
    FROM (SELECT DISTINCT actor_id FROM sent WHERE due AND actor_id <> $1) AS r
    UNION ALL
    SELECT pg_notify('toren_reply', r.correlation_id::text) FROM rep AS r
    UNION ALL
    -- Only an actor someone follows is notified of: a commit that notifies is serialized
    -- with every other one that does, WAL flush included.
    SELECT pg_notify('toren_journal', $1) FROM fence
    WHERE fence.watched_until > now() AND EXISTS (SELECT 1 FROM ev)
), next AS (
    SELECT * FROM claimed
    UNION ALL
    SELECT id, lane, sender, kind, body, reply_to, deliveries, attempts, is_timer
    FROM sent WHERE deliveries = 1
)
SELECT (SELECT count(*) FROM fence) AS owned, (SELECT count(*) FROM consumed) AS consumed,
       (SELECT array[id, kind, existing] FROM clash LIMIT 1) AS clash,
       (SELECT count(*) FROM ev) AS events,
       (SELECT count(*) FROM sp) AS spawned, (SELECT count(*) FROM cancelled) AS cancelled,
       (SELECT count(*) FROM sent) AS sent_count, (SELECT count(*) FROM woken) AS woken,
       (SELECT count(*) FROM summed) AS summed, n.*
FROM (SELECT 1) AS one LEFT JOIN (SELECT * FROM next LIMIT 1) AS n ON true
"""


async def commit_step(
    pool: asyncpg.Pool | Connection,
    owner: uuid.UUID,
    envelope: Envelope,
    ctx: Context[Any],
    *,
    retry: bool = False,
    summary: Mapping[str, Any] | None = None,
    claim: bool = False,
) -> Envelope | None:
    """Commit one handled message: everything in ``ctx`` or nothing.

    With ``retry`` (an earlier attempt's answer was lost), a message already consumed while the
    actor is still ours means that attempt landed: nothing more is done.

    With ``claim``, the same statement claims the actor's next message as :func:`claim_next`
    would (its delivery count raised in this commit, before it is handled) and returns it, so a
    busy actor costs one round trip per step. ``None``: nothing was claimed (claim again to be
    sure; a message can arrive meanwhile).

    Raises:
        FencedOut: the actor is no longer ours (epoch raised, or a newer owner wrote the seq).
        UnknownActor: the handler sent a message to an actor that does not exist.
        ActorAlreadyExists: the handler spawned an id that an actor of another kind holds.
    """
    events = ctx.events
    out = ctx.outgoing
    reply = ctx.reply_body if envelope.reply_to is not None else None
    try:
        row = await pool.fetchrow(
            _COMMIT,
            ctx.actor_id,
            owner,
            ctx.epoch,
            envelope.id,
            [e[0] for e in events],
            [e[1] for e in events],
            [e[2] for e in events],
            [s.actor_id for s in ctx.spawns],
            [s.kind for s in ctx.spawns],
            [dict(s.args) for s in ctx.spawns],
            ctx.cancelled_timers + [o.timer_key for o in out if o.timer_key is not None],
            [o.to for o in out],
            [o.lane for o in out],
            [o.kind for o in out],
            [o.body for o in out],
            [o.dedupe_key for o in out],
            [o.timer_key for o in out],
            [o.delay for o in out],
            envelope.reply_to if reply else None,
            reply[0] if reply else None,
            reply[1] if reply else None,
            dict(summary) if summary is not None else None,
            claim,
            [s.route for s in ctx.spawns],
        )
    except asyncpg.UniqueViolationError as exc:
        # Another owner appended this seq: (actor_id, seq) is the second guard of fencing.
        raise FencedOut(ctx.actor_id, ctx.epoch) from exc
    except asyncpg.ForeignKeyViolationError as exc:
        raise UnknownActor(_recipient_named_in(exc, [o.to for o in out])) from exc
    if row is not None and row["owned"] and row["clash"]:
        raise ActorAlreadyExists(*row["clash"])
    if row is not None and row["owned"] and not row["consumed"] and retry:
        return None
    if row is None or not row["consumed"]:
        raise FencedOut(ctx.actor_id, ctx.epoch)
    return _envelope(row) if row["id"] is not None else None


def _envelope(row: asyncpg.Record) -> Envelope:
    return Envelope(
        id=row["id"],
        lane=row["lane"],
        sender=row["sender"],
        kind=row["kind"],
        body=row["body"],
        payload=None,
        reply_to=row["reply_to"],
        deliveries=row["deliveries"],
        attempts=row["attempts"],
        is_timer=row["is_timer"],
    )


def _recipient_named_in(exc: asyncpg.ForeignKeyViolationError, recipients: list[str]) -> str:
    detail = str(getattr(exc, "detail", "") or "")
    for to in recipients:
        if f"({to})" in detail:
            return to
    return recipients[0] if recipients else "?"


_RECORD_FAILURE = """
WITH fence AS (
    SELECT 1 FROM toren.actors
    WHERE actor_id = $1 AND owner = $2 AND epoch = $3 AND status = 'live'
    FOR SHARE
), charged AS (
    UPDATE toren.mailbox m SET attempts = m.attempts + 1, last_error = $5
    WHERE m.id = $4 AND EXISTS (SELECT 1 FROM fence)
    RETURNING m.attempts
)
SELECT (SELECT count(*) FROM fence) AS owned, (SELECT attempts FROM charged) AS attempts
"""


async def record_failure(
    pool: asyncpg.Pool, actor_id: str, owner: uuid.UUID, epoch: int, msg_id: int, error: str
) -> int:
    """Charge a handler failure to the message.

    Returns:
        The message's attempts so far, this one included; 0 if the message is gone (it was
        consumed after all: a commit whose answer was lost).

    Raises:
        FencedOut: the actor is no longer ours.
    """
    row = await pool.fetchrow(_RECORD_FAILURE, actor_id, owner, epoch, msg_id, safe_text(error))
    if row is None or not row["owned"]:
        raise FencedOut(actor_id, epoch)
    return int(row["attempts"] or 0)


_DEAD_LETTER = """
WITH fence AS (
    SELECT 1 FROM toren.actors
    WHERE actor_id = $1 AND owner = $2 AND epoch = $3 AND status = 'live'
    FOR SHARE
), dl AS (
    -- Copied: the step that follows in the same transaction consumes it, with what the actor
    -- records and sends about it (Actor.on_dead_letter).
    INSERT INTO toren.deadletters (id, actor_id, lane, sender, kind, body, dedupe_key, reply_to,
                                   deliveries, attempts, error, created_at)
    SELECT id, actor_id, lane, sender, kind, body, dedupe_key, reply_to, deliveries, attempts, $5,
           created_at
    FROM toren.mailbox m
    WHERE m.id = $4 AND m.actor_id = $1 AND EXISTS (SELECT 1 FROM fence)
    RETURNING id, sender, reply_to, kind
), told AS (
    INSERT INTO toren.mailbox (actor_id, lane, sender, kind, body)
    SELECT dl.sender, 0, $1, 'toren.poison', $6
    FROM dl JOIN toren.actors s ON s.actor_id = dl.sender
    -- No notice to itself, none about a notice: a poison chain must not feed itself.
    WHERE dl.sender <> $1 AND dl.kind NOT LIKE 'toren.%' AND s.status = 'live'
    RETURNING actor_id
), rep AS (
    INSERT INTO toren.replies (correlation_id, kind, body)
    SELECT dl.reply_to, 'toren.ask_failed', $7 FROM dl WHERE dl.reply_to IS NOT NULL
    ON CONFLICT DO NOTHING
    RETURNING correlation_id
), woken AS (
    SELECT pg_notify('toren_mail', actor_id) FROM told
    UNION ALL
    SELECT pg_notify('toren_reply', correlation_id::text) FROM rep
    UNION ALL
    -- Any actor's: a dead letter is rare, and its events are what a follower must see.
    SELECT pg_notify('toren_journal', $1) WHERE $8 AND EXISTS (SELECT 1 FROM dl)
)
SELECT (SELECT count(*) FROM dl) AS moved, (SELECT count(*) FROM woken) AS woken
"""


async def dead_letter(
    pool: asyncpg.Pool,
    owner: uuid.UUID,
    envelope: Envelope,
    ctx: Context[Any],
    error: str,
    *,
    summary: Mapping[str, Any] | None = None,
) -> list[str]:
    """Move a message to ``toren.deadletters``, tell its sender, fail a waiting ask(), and
    commit what ``ctx`` holds (the events the actor records about it, the messages it sends,
    its timers and spawns), all in one transaction.

    Messages ``ctx`` sends to actors that do not exist are left out (a dead letter is often
    about such an actor): the others, and the events, are committed.

    Returns:
        The recipients whose messages were left out.

    Raises:
        FencedOut: the actor is no longer ours.
        UnknownActor: a recipient went away while this ran.
        ActorAlreadyExists: ``ctx`` spawns an id that an actor of another kind holds.
    """
    poison = PoisonMessage(
        actor_id=ctx.actor_id,
        message_id=envelope.id,
        kind=envelope.kind,
        error=error,
        attempts=envelope.attempts,
        deliveries=envelope.deliveries,
    )
    _, poison_body = encode(poison)
    ask_failed = {"actor_id": ctx.actor_id, "error": error}
    async with pool.acquire() as conn, conn.transaction():
        moved = await conn.fetchval(
            _DEAD_LETTER,
            ctx.actor_id,
            owner,
            ctx.epoch,
            envelope.id,
            safe_text(error),
            poison_body,
            ask_failed,
            bool(ctx.events),
        )
        if not moved:
            raise FencedOut(ctx.actor_id, ctx.epoch)
        spawned = {s.actor_id for s in ctx.spawns}
        recipients = sorted({o.to for o in ctx.outgoing} - spawned)
        found = await conn.fetch(
            "SELECT actor_id FROM toren.actors WHERE actor_id = ANY($1::text[])", recipients
        )
        missing = sorted(set(recipients) - {r["actor_id"] for r in found})
        ctx.outgoing[:] = [o for o in ctx.outgoing if o.to not in missing]
        await commit_step(conn, owner, envelope, ctx, summary=summary)
    return missing


def open_envelope(envelope: Envelope) -> Envelope:
    """The envelope with its payload decoded (raises UnknownMessageType)."""
    return Envelope(
        id=envelope.id,
        lane=envelope.lane,
        sender=envelope.sender,
        kind=envelope.kind,
        body=envelope.body,
        payload=decode(envelope.kind, envelope.body),
        reply_to=envelope.reply_to,
        deliveries=envelope.deliveries,
        attempts=envelope.attempts,
        is_timer=envelope.is_timer,
    )
