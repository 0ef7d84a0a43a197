"""Journals: the append-only event log of each actor, folded into its state.

Appends happen inside the fenced step statement (``toren._core.mailbox``); this module reads. State
is ``initial_state()`` folded with ``apply`` over the events in ``seq`` order. A snapshot, when the
actor class asks for them, stores the fold at some ``seq`` so that a long journal need not be
replayed from the start (:mod:`toren._core.snapshots`); snapshots are derived data and may be
deleted at any time. A journal may start after seq 1, its first events archived
(:mod:`toren._core.truncation`): a state the snapshot does not cover is then folded from the
archives and the journal's rows.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import datetime
from typing import Any, Protocol

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


class ArchiveNeeded(TorenError):
    """Rebuilding an actor's state needs archived events, and no archive store is open."""

    def __init__(self, actor_id: str, first_seq: int, last_seq: int) -> None:
        self.actor_id = actor_id
        self.first_seq = first_seq
        self.last_seq = last_seq
        super().__init__(
            f"{actor_id}: events {first_seq}-{last_seq} of its journal are archived and its "
            "snapshot does not cover them; this process has no archive store to read them "
            "from: set archive_store (TOREN_ARCHIVE_STORE) to the store they were written to"
        )


class ArchiveReader(Protocol):
    """Reads an archived range of a journal (:class:`toren._core.truncation.Archives`)."""

    async def read(self, ref: Any) -> list[JournalEntry]:
        """The events of the range ``ref`` (as ``toren.journal_archives.ref`` holds it)."""
        ...


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
    archived: int = 0  # events folded from archives (the snapshot did not cover them)


async def replay(
    pool: asyncpg.Pool,
    actor_id: str,
    initial: Any,
    apply: Callable[[Any, Any], Any],
    *,
    snapshots: tuple[type, int] | None = None,
    archives: ArchiveReader | None = None,
) -> Rebuilt:
    """``initial`` folded with ``apply`` over the journal of ``actor_id``, starting from its
    snapshot when ``snapshots`` (state type, version) says it keeps them.

    A journal that starts after seq 1 (its first events archived: see
    :mod:`toren._core.truncation`) is folded from its snapshot when that is usable; otherwise
    the archived events the fold needs are read from ``archives`` (outside any transaction:
    archive objects never change) and folded before the journal's rows.

    Raises:
        InternalError: the journal has a gap (a sequence number is missing, and no archived
            range holds it).
        ReplayFailed: ``apply`` raised, or an event names a type no loaded module registered.
        ArchiveNeeded: archived events are needed and ``archives`` is None.
        CorruptArchive, StoreError: an archive could not be read.
    """
    fetched: dict[int, list[JournalEntry]] = {}  # archived ranges read, by first seq
    for _ in range(_ARCHIVE_TRIES):
        # The collector is paused while the state is built (see toren._core.collector): a long
        # journal would otherwise cost more than its length.
        async with (
            pool.acquire() as conn,
            conn.transaction(isolation="repeatable_read", readonly=True),
        ):
            with collector_paused():
                folded = await _fold(conn, actor_id, initial, apply, snapshots, fetched)
        if isinstance(folded, Rebuilt):
            return folded
        await _read_archives(archives, actor_id, folded, fetched)
    raise InternalError(f"{actor_id}: its archived ranges changed on every read")


_ARCHIVE_TRIES = 3


async def _read_archives(
    archives: ArchiveReader | None,
    actor_id: str,
    wanted: list[tuple[int, int, Any]],
    fetched: dict[int, list[JournalEntry]],
) -> None:
    if archives is None:
        raise ArchiveNeeded(actor_id, wanted[0][0], wanted[-1][1])
    for first, _, ref in wanted:
        fetched[first] = await archives.read(ref)


async def _fold(
    conn: Any,
    actor_id: str,
    initial: Any,
    apply: Callable[[Any, Any], Any],
    snapshots: tuple[type, int] | None,
    fetched: dict[int, list[JournalEntry]],
) -> Rebuilt | list[tuple[int, int, Any]]:
    """The state; or, when archived events are needed and not in ``fetched``, the archived
    ranges to read, ``(first seq, last seq, ref)`` (then nothing is folded)."""
    state, seq = initial, 0
    if snapshots is not None:
        found = await read_snapshot(conn, actor_id, *snapshots)
        if found is not None and (
            await _has_event(conn, actor_id, found[1]) or await _archived(conn, actor_id, found[1])
        ):
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
    first, archived = True, 0
    async for row in cursor:
        if first and row["seq"] != seq + 1:
            # The journal starts later: its earlier events may be archived.
            refs = await _ranges(conn, actor_id, seq)
            missing = [r for r in refs if r[0] not in fetched]
            if missing:
                return missing
            for ref_first, _, _ in refs:
                for entry in fetched[ref_first]:
                    if entry.seq > seq:
                        state, seq = _apply(actor_id, apply, state, seq, entry.seq, entry.type,
                                            entry.data)  # fmt: skip
                        archived += 1
        first = False
        state, seq = _apply(actor_id, apply, state, seq, row["seq"], row["type"], row["data"])
    return Rebuilt(state=state, seq=seq, snapshot_seq=snapshot_seq, archived=archived)


def _apply(
    actor_id: str,
    apply: Callable[[Any, Any], Any],
    state: Any,
    seq: int,
    at: int,
    kind: str,
    data: Any,
) -> tuple[Any, int]:
    if at != seq + 1:
        raise InternalError(f"journal of {actor_id!r} jumps from seq {seq} to {at}")
    try:
        return apply(state, decode(kind, data)), at
    except Exception as exc:
        # User code (or an unknown payload type): a failed start, whatever it raised.
        raise ReplayFailed(actor_id, at, exc) from exc


async def _has_event(conn: Any, actor_id: str, seq: int) -> bool:
    found: bool = await conn.fetchval(
        "SELECT EXISTS (SELECT 1 FROM toren.journal WHERE actor_id = $1 AND seq = $2)",
        actor_id,
        seq,
    )
    return found


async def _archived(conn: Any, actor_id: str, seq: int) -> bool:
    """Whether event ``seq`` of ``actor_id`` is in an archived range."""
    found: bool = await conn.fetchval(
        "SELECT EXISTS (SELECT 1 FROM toren.journal_archives WHERE actor_id = $1 "
        "AND first_seq <= $2 AND last_seq >= $2)",
        actor_id,
        seq,
    )
    return found


async def _ranges(conn: Any, actor_id: str, after: int) -> list[tuple[int, int, Any]]:
    """The archived ranges of ``actor_id`` that hold events after ``after``, in order:
    ``(first seq, last seq, ref)``."""
    rows = await conn.fetch(
        "SELECT first_seq, last_seq, ref FROM toren.journal_archives "
        "WHERE actor_id = $1 AND last_seq > $2 ORDER BY first_seq",
        actor_id,
        after,
    )
    return [(r["first_seq"], r["last_seq"], r["ref"]) for r in rows]


def snapshot_spec(cls: type[Actor[Any]]) -> tuple[type, int] | None:
    """``(state type, version)`` if actors of ``cls`` keep snapshots."""
    if cls.snapshot_every and cls.state_type is not None:
        return cls.state_type, cls.snapshot_version
    return None


async def rebuild(
    pool: asyncpg.Pool, actor: Actor[Any], *, archives: ArchiveReader | None = None
) -> Rebuilt:
    """The actor's state: its snapshot (if usable) plus the events after it (and the archived
    events before them its snapshot does not cover, read from ``archives``)."""
    return await replay(
        pool,
        actor.actor_id,
        actor.initial_state(),
        actor.apply,
        snapshots=snapshot_spec(type(actor)),
        archives=archives,
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
