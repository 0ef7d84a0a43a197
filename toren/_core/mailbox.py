"""Mailboxes: sending, claiming the next message, committing a step, failures and dead letters.

Every statement an owner issues is fenced: it checks ``owner = me AND epoch = mine`` on the
actor's row in the same statement, and the step commit takes a share lock on that row so a
concurrent claim (which raises the epoch) either waits for the step or fences it out. A step is
one statement, hence one transaction and one round trip: consume the message, append the events,
spawn children, insert the outgoing messages and timers, store the reply, notify recipients (and
followers of the journal, if the actor has any), and claim the actor's next message. That
statement and the claim are composed from named fragments in :mod:`toren._core.step_sql`.
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
    OverLimit,
    UnknownActor,
)
from toren._core.group_commit import GroupCommit
from toren._core.json_text import dumps, safe_text
from toren._core.step_sql import CLAIM, STEP, ClaimInputs, StepInputs, arguments

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
    try:
        row = await conn.fetchrow(
            _SEND, to, lane, sender, kind, dumps(body), dedupe_key, reply_to, float(delay)
        )
    except asyncpg.ForeignKeyViolationError:
        # Its row was deleted (a prune) while this insert waited for the deleting transaction.
        raise UnknownActor(to) from None
    if row is None or not row["found"]:
        raise UnknownActor(to)
    if row["status"] != "live":
        raise ActorNotLive(to, row["status"])
    if not row["ok"]:
        raise MailboxFull(to, row["depth"])
    msg_id: int | None = row["id"]
    return msg_id


_CLAIM_NEXT = CLAIM  # the statement; a chaos mutation may replace it (chaos/mutations.py)


async def claim_next(
    pool: asyncpg.Pool, actor_id: str, owner: uuid.UUID, epoch: int
) -> Envelope | None:
    """Claim the actor's next visible message (system lane first) and raise its delivery count.

    The raised count is committed before the message is handled, so a message that kills its
    worker is charged for it. An actor under limits has its user mail claimed only while it
    holds their permits (taken here if it lacks them); its system mail (a cancel) always.

    Raises:
        FencedOut: the actor is no longer ours.
        OverLimit: nothing was claimed and the actor waits in a limit's queue (let it go: the
            permit, when handed to it, wakes a worker).
    """
    inputs = ClaimInputs(actor_id=actor_id, owner=owner, epoch=epoch)
    row = await pool.fetchrow(_CLAIM_NEXT, *arguments(inputs))
    if row is None or not row["owned"]:
        raise FencedOut(actor_id, epoch)
    if row["id"] is None:
        if row["queued"]:
            raise OverLimit(actor_id)
        return None
    return _envelope(row)


_COMMIT = STEP  # the statement; a chaos mutation may replace it (chaos/mutations.py)


async def commit_step(
    pool: asyncpg.Pool | Connection,
    owner: uuid.UUID,
    envelope: Envelope,
    ctx: Context[Any],
    *,
    retry: bool = False,
    summary: Mapping[str, Any] | None = None,
    claim: bool = False,
    release: bool = False,
    via: GroupCommit | None = None,
) -> Envelope | None:
    """Commit one handled message: everything in ``ctx`` or nothing.

    With ``via``, the step may be committed in a batch with other actors' steps
    (:mod:`toren._core.group_commit`), still on its own: fenced alone, failing alone.

    With ``release`` (the actor no longer runs after this step, :meth:`~toren.Actor.runs`), an
    actor under limits gives its permits back in the same statement, each to the head of its
    limit's queue.

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
        BatchOutcomeUnknown: the batch holding the step may have committed (commit it again
            with ``retry``).
    """
    events = ctx.events
    out = ctx.outgoing
    reply = ctx.reply_body if envelope.reply_to is not None else None
    inputs = StepInputs(
        actor_id=ctx.actor_id,
        owner=owner,
        epoch=ctx.epoch,
        message_id=envelope.id,
        event_seqs=[e[0] for e in events],
        event_types=[e[1] for e in events],
        event_data=[e[2] for e in events],
        spawn_ids=[s.actor_id for s in ctx.spawns],
        spawn_kinds=[s.kind for s in ctx.spawns],
        spawn_args=[dict(s.args) for s in ctx.spawns],
        replaced_timers=ctx.cancelled_timers
        + [o.timer_key for o in out if o.timer_key is not None],
        out_recipients=[o.to for o in out],
        out_lanes=[o.lane for o in out],
        out_kinds=[o.kind for o in out],
        out_bodies=[o.body for o in out],
        out_dedupe_keys=[o.dedupe_key for o in out],
        out_timer_keys=[o.timer_key for o in out],
        out_delays=[o.delay for o in out],
        reply_to=envelope.reply_to if reply else None,
        reply_kind=reply[0] if reply else None,
        reply_body=reply[1] if reply else None,
        summary=dict(summary) if summary is not None else None,
        claim=claim,
        spawn_routes=[s.route for s in ctx.spawns],
        spawn_limits=[dumps(list(s.limits)) if s.limits else None for s in ctx.spawns],
        release=release,
        route=ctx.route,
    )
    try:
        if via is not None:
            row = await via.fetchrow(_COMMIT, arguments(inputs))
        else:
            row = await pool.fetchrow(_COMMIT, *arguments(inputs))
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
    release: bool = False,
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
        await commit_step(conn, owner, envelope, ctx, summary=summary, release=release)
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
