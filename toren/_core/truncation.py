"""Journals that start after seq 1: the events behind a never-ending actor's snapshot, older
than its retention, archived and deleted, and its state rebuilt from the archives when needed.

An actor that never ends (a run chatting on Telegram for months) would otherwise keep every
event it ever recorded. :func:`truncate_journal` moves the oldest of them to the archive store:
it writes events ``first..last`` (from the journal's first row to the last event that is both
before the actor's snapshot and older than ``keep_for``: the snapshot's own event stays, so the
journal is never empty and a usable snapshot is found as before) as one archive object,
verified, with no transaction open; then, in one short transaction, records the range in
``toren.journal_archives`` and deletes those rows. So at every moment the archived ranges and
the journal's rows together hold seq 1 to the journal's end, without gap or overlap: a kill
between the two leaves an archive object no row names (written again, the same, if the next
truncation takes the same range; deleted by the one that records a longer range from the same
seq, as it does when the actor went on and snapshotted later).

Rebuilding (:func:`toren._core.journal.replay`) starts from the snapshot when it is usable and
not older than the journal's first row; otherwise it reads the archived ranges it needs from
the archive store (:class:`Archives`, which the worker lends its actors' hosts), outside any
transaction, and folds them before the journal's rows. Without an archive store, truncation is
refused (:class:`TruncationRefused`), and a rebuild that needs an archive fails its start
(:class:`ArchiveNeeded`), naming the setting to give.

Errors::

    TorenError
    ├── TruncationRefused   no archive store: the journal is kept whole
    └── ArchiveNeeded       a rebuild needs archived events and no store can give them
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import asyncpg
import attrs

from toren._core.archive import (
    ArchiveRef,
    archive_journal,
    drop_shorter,
    open_archive_store,
    read_archive,
)
from toren._core.errors import InternalError, TorenError
from toren._core.journal import ArchiveNeeded as ArchiveNeeded
from toren._core.journal import JournalEntry
from toren._core.killpoints import kill_point
from toren._core.pruning import lock_timeout_statement

if TYPE_CHECKING:
    from toren._core.config import WorkerSettings
    from toren._core.rows import Db
    from toren._core.stores import ObjectStore

log = logging.getLogger("toren.truncation")

LOCK_TIMEOUT_MS = 200  # the delete waits no longer on a lock (it takes none a step holds)
BATCH = 10_000  # events archived (one object) and deleted (one transaction) at most at once


class TruncationRefused(TorenError):
    """A journal was not truncated: there is no archive store to keep its events in."""

    def __init__(self, actor_id: str, reason: str) -> None:
        self.actor_id = actor_id
        self.reason = reason
        super().__init__(f"{actor_id}: its journal is kept whole: {reason}")


@attrs.frozen
class Archives:
    """The archive store a worker lends its actors' hosts (``Resources``); it reads archived
    ranges for :func:`toren._core.journal.replay`."""

    store: ObjectStore

    @classmethod
    def from_settings(cls, settings: WorkerSettings) -> Archives | None:
        """The store ``archive_store`` names; None when it is unset. Truncation needs a store
        every worker reads: the default (``HOME/archive``, where pruned runs are archived) is
        one machine's directory, and a conversation truncated there could not be rebuilt on
        another, so truncation is refused until a store is set.

        Raises:
            ConfigError: ``archive_store`` is not a directory or ``s3://`` URL.
        """
        if not settings.archive_store:
            return None
        return cls(open_archive_store(settings))

    async def read(self, ref: Any) -> list[JournalEntry]:
        """The events of an archived range, checked (``ref``: ``ArchiveRef.to_json()``).

        Raises:
            CorruptArchive, StoreError: see :func:`toren._core.archive.read_archive`.
        """
        return await read_archive(self.store, ArchiveRef.from_json(ref))


@attrs.frozen(kw_only=True)
class Truncated:
    """What one truncation archived and deleted."""

    ref: ArchiveRef
    deleted: int  # journal rows


async def archived(db: Db, actor_id: str) -> list[ArchiveRef]:
    """The archived ranges of ``actor_id``'s journal, in order (none for a journal kept whole)."""
    rows = await db.fetch(
        "SELECT ref FROM toren.journal_archives WHERE actor_id = $1 ORDER BY first_seq", actor_id
    )
    return [ArchiveRef.from_json(r["ref"]) for r in rows]


_PLAN = """
SELECT s.seq AS snapshot_seq,
       (SELECT coalesce(max(a.last_seq), 0) FROM toren.journal_archives a
        WHERE a.actor_id = $1) AS archived_to,
       (SELECT max(j.seq) FROM toren.journal j
        WHERE j.actor_id = $1 AND j.seq < s.seq
          AND j.created_at < now() - make_interval(secs => $2)) AS old_to
FROM toren.snapshots s WHERE s.actor_id = $1
"""

_RECORD = """
INSERT INTO toren.journal_archives (actor_id, first_seq, last_seq, ref)
SELECT $1::text, $2::bigint, $3::bigint, $4::jsonb
WHERE coalesce((SELECT max(last_seq) FROM toren.journal_archives WHERE actor_id = $1), 0)
      = $2::bigint - 1
ON CONFLICT DO NOTHING
RETURNING 1
"""


async def truncate_journal(
    pool: asyncpg.Pool,
    store: ObjectStore | None,
    actor_id: str,
    *,
    keep_for: float,
    lock_timeout_ms: int = LOCK_TIMEOUT_MS,
    batch: int = BATCH,
) -> Truncated | None:
    """Archive and delete the events of ``actor_id`` before its snapshot's that are older than
    ``keep_for`` seconds, the first ``batch`` of them; what was done, or None if nothing was
    due (no snapshot, nothing old enough, or another truncation of the same range won). Call
    it again while it does something to catch up a long journal.

    Safe beside the actor's steps (they append after the snapshot; this deletes before it)
    and against a kill at any point (see the module's docstring).

    Raises:
        TruncationRefused: ``store`` is None.
        StoreError, CorruptArchive: the archive could not be written and verified (nothing was
            deleted).
    """
    if store is None:
        raise TruncationRefused(
            actor_id,
            "no archive store is set (archive_store, TOREN_ARCHIVE_STORE: a store every "
            "worker reads, such as s3://bucket/prefix)",
        )
    plan = await pool.fetchrow(_PLAN, actor_id, float(keep_for))
    if plan is None or plan["old_to"] is None:
        return None
    first = plan["archived_to"] + 1
    last = min(plan["old_to"], first + batch - 1)
    if last < first:
        return None
    ref = await archive_journal(pool, store, actor_id, first_seq=first, last_seq=last)
    if (ref.first_seq, ref.last_seq, ref.events) != (first, last, last - first + 1):
        raise InternalError(
            f"{actor_id}: its journal from seq {first} to {last} has a gap "
            f"(archived {ref.events} events, {ref.first_seq}-{ref.last_seq})"
        )
    kill_point("truncation.archived")
    async with pool.acquire() as conn, conn.transaction():
        await conn.execute(lock_timeout_statement(lock_timeout_ms))
        if await conn.fetchval(_RECORD, actor_id, first, last, ref.to_json()) is None:
            return None  # another truncation recorded this range first
        deleted = await conn.execute(
            "DELETE FROM toren.journal WHERE actor_id = $1 AND seq BETWEEN $2 AND $3",
            actor_id,
            first,
            last,
        )
        count = int(deleted.split()[-1])
        if count != last - first + 1:
            raise InternalError(
                f"{actor_id}: truncating events {first}-{last} found {count} of them"
            )
    log.info("%s: events %d-%d archived to %s and deleted", actor_id, first, last, ref.location)
    await drop_shorter(store, ref)
    return Truncated(ref=ref, deleted=count)
