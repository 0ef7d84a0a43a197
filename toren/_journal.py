"""Journals: the append-only event log of each actor, folded into its state.

Appends happen inside the fenced step statement (``toren._mailbox``); this module reads. State is
``initial_state()`` folded with ``apply`` over the events in ``seq`` order. A snapshot, when the
actor class asks for them, stores the fold at some ``seq`` so that a long journal need not be
replayed from the start; snapshots are derived data and may be deleted at any time.
"""

from __future__ import annotations

from typing import Any

import asyncpg
import attrs

from toren._actor import Actor
from toren._codec import converter, decode
from toren._errors import InternalError, TorenError

_BATCH = 5000


class ReplayFailed(TorenError):
    """Folding the journal raised (``apply`` failed, or an event type is unknown here)."""

    def __init__(self, actor_id: str, seq: int, cause: BaseException) -> None:
        self.actor_id = actor_id
        self.seq = seq
        self.cause = cause
        super().__init__(
            f"{actor_id}: replaying event {seq} failed: {type(cause).__name__}: {cause}"
        )


@attrs.frozen(kw_only=True)
class JournalEntry:
    """One stored event."""

    seq: int
    epoch: int
    type: str
    data: Any


async def read_journal(
    conn: asyncpg.Connection | asyncpg.Pool, actor_id: str, *, after: int = 0
) -> list[JournalEntry]:
    """Every event of ``actor_id`` with ``seq > after``, in order."""
    rows = await conn.fetch(
        "SELECT seq, epoch, type, data FROM toren.journal WHERE actor_id = $1 AND seq > $2 "
        "ORDER BY seq",
        actor_id,
        after,
    )
    return [
        JournalEntry(seq=r["seq"], epoch=r["epoch"], type=r["type"], data=r["data"]) for r in rows
    ]


async def rebuild(pool: asyncpg.Pool, actor: Actor[Any]) -> tuple[Any, int]:
    """The actor's state and last seq: its snapshot (if usable) plus the events after it.

    Raises:
        InternalError: the journal has a gap (a sequence number is missing).
        UnknownMessageType: an event names a type no loaded module registered.
    """
    cls = type(actor)
    state: Any = actor.initial_state()
    seq = 0
    if cls.snapshot_every and cls.state_type is not None:
        snap = await pool.fetchrow(
            "SELECT seq, version, state FROM toren.snapshots WHERE actor_id = $1", actor.actor_id
        )
        if snap is not None and snap["version"] == cls.snapshot_version:
            state = converter.structure(snap["state"], cls.state_type)
            seq = snap["seq"]
    async with pool.acquire() as conn, conn.transaction(readonly=True):
        cursor = conn.cursor(
            "SELECT seq, type, data FROM toren.journal WHERE actor_id = $1 AND seq > $2 "
            "ORDER BY seq",
            actor.actor_id,
            seq,
            prefetch=_BATCH,
        )
        async for row in cursor:
            if row["seq"] != seq + 1:
                raise InternalError(
                    f"journal of {actor.actor_id!r} jumps from seq {seq} to {row['seq']}"
                )
            try:
                state = actor.apply(state, decode(row["type"], row["data"]))
            except Exception as exc:
                # User code (or an unknown payload type): a failed start, whatever it raised.
                raise ReplayFailed(actor.actor_id, row["seq"], exc) from exc
            seq = row["seq"]
    return state, seq


async def save_snapshot(pool: asyncpg.Pool, actor: Actor[Any], state: Any, seq: int) -> None:
    """Store the fold at ``seq``; an older snapshot is replaced, a newer one kept."""
    await pool.execute(
        "INSERT INTO toren.snapshots (actor_id, seq, version, state) VALUES ($1, $2, $3, $4) "
        "ON CONFLICT (actor_id) DO UPDATE SET seq = EXCLUDED.seq, version = EXCLUDED.version, "
        "state = EXCLUDED.state, created_at = now() WHERE toren.snapshots.seq < EXCLUDED.seq",
        actor.actor_id,
        seq,
        type(actor).snapshot_version,
        converter.unstructure(state),
    )
