"""Journals: the append-only event log of each actor, folded into its state.

Appends happen inside the fenced step statement (``toren._core.mailbox``); this module reads. State
is ``initial_state()`` folded with ``apply`` over the events in ``seq`` order. A snapshot, when the
actor class asks for them, stores the fold at some ``seq`` so that a long journal need not be
replayed from the start (:mod:`toren._core.snapshots`); snapshots are derived data and may be
deleted at any time.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import datetime
from typing import Any

import anyio
import asyncpg
import attrs

from toren._core.actor import Actor
from toren._core.codec import decode
from toren._core.collector import paused as collector_paused
from toren._core.errors import InternalError, TorenError
from toren._core.killpoints import kill_point
from toren._core.snapshots import encode as encode_snapshot
from toren._core.snapshots import read as read_snapshot
from toren._core.snapshots import write as write_snapshot

_BATCH = 5000

log = logging.getLogger("toren.snapshots")


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
    at: datetime | None = None  # when it was appended, by the database's clock


async def read_journal(
    conn: asyncpg.Connection | asyncpg.Pool,
    actor_id: str,
    *,
    after: int = 0,
    limit: int | None = None,
) -> list[JournalEntry]:
    """The events of ``actor_id`` with ``seq > after``, in order: every one, or the first
    ``limit``."""
    rows = await conn.fetch(
        "SELECT seq, epoch, type, data, created_at FROM toren.journal "
        "WHERE actor_id = $1 AND seq > $2 ORDER BY seq LIMIT $3",
        actor_id,
        after,
        limit,
    )
    return [
        JournalEntry(
            seq=r["seq"], epoch=r["epoch"], type=r["type"], data=r["data"], at=r["created_at"]
        )
        for r in rows
    ]


@attrs.frozen(kw_only=True)
class Rebuilt:
    """An actor's state folded from its snapshot (if any) and its journal."""

    state: Any
    seq: int  # the last event folded
    snapshot_seq: int  # where the snapshot it started from ended (0: none)


async def replay(
    pool: asyncpg.Pool,
    actor_id: str,
    initial: Any,
    apply: Callable[[Any, Any], Any],
    *,
    snapshots: tuple[type, int] | None = None,
) -> Rebuilt:
    """``initial`` folded with ``apply`` over the journal of ``actor_id``, starting from its
    snapshot when ``snapshots`` (state type, version) says it keeps them.

    Raises:
        InternalError: the journal has a gap (a sequence number is missing).
        ReplayFailed: ``apply`` raised, or an event names a type no loaded module registered.
    """
    # The collector is paused while the state is built (see toren._core.collector): a long journal
    # would otherwise cost more than its length.
    async with (
        pool.acquire() as conn,
        conn.transaction(isolation="repeatable_read", readonly=True),
    ):
        with collector_paused():
            return await _fold(conn, actor_id, initial, apply, snapshots)


async def _fold(
    conn: Any,
    actor_id: str,
    initial: Any,
    apply: Callable[[Any, Any], Any],
    snapshots: tuple[type, int] | None,
) -> Rebuilt:
    state, seq = initial, 0
    if snapshots is not None:
        found = await read_snapshot(conn, actor_id, *snapshots)
        if found is not None and await _has_event(conn, actor_id, found[1]):
            state, seq = found
        elif found is not None:
            # Past the journal's end (journal rows deleted by hand): it is not this journal's.
            log.warning(
                "%s: the snapshot at seq %d is past the journal's end; folding the journal",
                actor_id,
                found[1],
            )
    snapshot_seq = seq
    cursor = conn.cursor(
        "SELECT seq, type, data FROM toren.journal WHERE actor_id = $1 AND seq > $2 ORDER BY seq",
        actor_id,
        seq,
        prefetch=_BATCH,
    )
    async for row in cursor:
        if row["seq"] != seq + 1:
            raise InternalError(f"journal of {actor_id!r} jumps from seq {seq} to {row['seq']}")
        try:
            state = apply(state, decode(row["type"], row["data"]))
        except Exception as exc:
            # User code (or an unknown payload type): a failed start, whatever it raised.
            raise ReplayFailed(actor_id, row["seq"], exc) from exc
        seq = row["seq"]
    return Rebuilt(state=state, seq=seq, snapshot_seq=snapshot_seq)


async def _has_event(conn: Any, actor_id: str, seq: int) -> bool:
    found: bool = await conn.fetchval(
        "SELECT EXISTS (SELECT 1 FROM toren.journal WHERE actor_id = $1 AND seq = $2)",
        actor_id,
        seq,
    )
    return found


def snapshot_spec(cls: type[Actor[Any]]) -> tuple[type, int] | None:
    """``(state type, version)`` if actors of ``cls`` keep snapshots."""
    if cls.snapshot_every and cls.state_type is not None:
        return cls.state_type, cls.snapshot_version
    return None


async def rebuild(pool: asyncpg.Pool, actor: Actor[Any]) -> Rebuilt:
    """The actor's state: its snapshot (if usable) plus the events after it."""
    return await replay(
        pool,
        actor.actor_id,
        actor.initial_state(),
        actor.apply,
        snapshots=snapshot_spec(type(actor)),
    )


async def save_snapshot(pool: asyncpg.Pool, actor: Actor[Any], state: Any, seq: int) -> Any:
    """Store the fold at ``seq`` (an older snapshot is replaced, a newer one kept); the state to
    go on with, which names the chunks now stored (equal to ``state``).

    The encoding runs in a thread: a long run's state takes a while to write, and the worker's
    event loop (its lease renewals) must not wait for it.
    """
    kill_point("snapshot.writing")
    snap = await anyio.to_thread.run_sync(encode_snapshot, state, seq)
    if await write_snapshot(pool, actor.actor_id, type(actor).snapshot_version, seq, snap):
        kill_point("snapshot.written")
        return snap.state
    return state
