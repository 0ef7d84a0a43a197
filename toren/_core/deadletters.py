"""Old dead letters, archived with their messages and then deleted.

A dead letter (``toren.deadletters``: a message past its delivery limit, with the error that
killed it) is kept for ``deadletter_keep_for`` (30 days by default) for ``toren deadletters`` to
show and requeue. Then housekeeping writes them, a batch at a time, to the archive store
(``archive_store``) and deletes them; nothing is deleted before its archive was read back and
checked.

One object per batch, gzip-compressed JSON Lines::

    deadletters/<day it died>/<first id>-<last id>-<sha256>.jsonl.gz

a header line (``format``, ``what``, ``first_id``, ``last_id``, ``count``), then one line per
dead letter with every column of its row: ``id`` (its message's), ``actor_id``, ``lane``,
``sender``, ``kind``, ``body`` (the message, as the journal writes JSON: lossless for NUL and
lone surrogates, :mod:`toren._core.json_text`), ``dedupe_key``, ``reply_to``, ``deliveries``,
``attempts``, ``error``, ``created_at`` and ``dead_at`` (ISO 8601). The ``sha256`` in the key is
that of the object's bytes, so an archive is checked against its own name
(:func:`read_deadletter_archive`); the same batch written again (a worker killed between the
write and the delete) gives the same bytes under the same key.

A letter requeued while its batch was being written is in the archive and back in its mailbox;
only letters still dead are deleted.
"""

from __future__ import annotations

import gzip
import hashlib
import logging
import re
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import asyncpg
import attrs

from toren._core.archive import open_archive_store
from toren._core.config import WorkerSettings
from toren._core.errors import TorenError
from toren._core.json_text import dumps, loads
from toren._core.killpoints import kill_point
from toren._core.singletons import singleton
from toren._core.stores import MissingObject, ObjectStore

if TYPE_CHECKING:
    from toren._core.rows import Db

log = logging.getLogger("toren.housekeeping")

DEADLETTER_FORMAT = 1
"""The version of the archive's layout (its header's ``format``); readers refuse others."""

BATCH = 1000
"""Dead letters per archive object (and per delete statement)."""

_COLUMNS = (
    "id, actor_id, lane, sender, kind, body, dedupe_key, reply_to, deliveries, attempts, "
    "error, created_at, dead_at"
)
_OLD = f"""
SELECT {_COLUMNS} FROM toren.deadletters
WHERE dead_at < now() - make_interval(secs => $1) AND id > $2
ORDER BY id LIMIT $3
"""
_ANY_OLD = """
SELECT EXISTS (SELECT FROM toren.deadletters WHERE dead_at < now() - make_interval(secs => $1))
"""
_DELETE = """
WITH gone AS (
    DELETE FROM toren.deadletters
    WHERE id = ANY($1::bigint[]) AND dead_at < now() - make_interval(secs => $2) RETURNING 1
)
SELECT count(*) FROM gone
"""
_KEY = re.compile(r"deadletters/\d{4}-\d\d-\d\d/(\d+)-(\d+)-([0-9a-f]{64})\.jsonl\.gz")


class CorruptDeadLetters(TorenError):
    """A dead letters' archive is not what its name says: nothing is read from it."""

    def __init__(self, key: str, detail: str) -> None:
        self.key = key
        self.detail = detail
        super().__init__(
            f"dead letters' archive {key!r} is unusable: {detail}. Copy the object back from a "
            "backup of the archive store, or check that archive_store names the store it was "
            "written to"
        )


@attrs.frozen(kw_only=True)
class ArchivedDeadLetters:
    """What one round archived and deleted."""

    keys: tuple[str, ...]  # the archive objects written (one per batch)
    archived: int  # dead letters written to them
    deleted: int  # of those, deleted (not requeued meanwhile)
    bytes: int  # compressed, in all


def _line(row: asyncpg.Record) -> dict[str, Any]:
    item = dict(row)
    for name in ("created_at", "dead_at"):
        item[name] = item[name].isoformat()
    item["reply_to"] = str(item["reply_to"]) if item["reply_to"] is not None else None
    return item


def _encode(rows: list[asyncpg.Record]) -> bytes:
    header = {
        "format": DEADLETTER_FORMAT,
        "what": "toren.deadletters",
        "first_id": rows[0]["id"],
        "last_id": rows[-1]["id"],
        "count": len(rows),
    }
    text = "\n".join(dumps(x, sort_keys=True) for x in (header, *map(_line, rows))) + "\n"
    # mtime=0: the same batch compresses to the same bytes, hence the same key
    return gzip.compress(text.encode(), compresslevel=6, mtime=0)


def _key(rows: list[asyncpg.Record], data: bytes) -> str:
    day = rows[0]["dead_at"].astimezone(UTC).date().isoformat()
    sha = hashlib.sha256(data).hexdigest()
    return f"deadletters/{day}/{rows[0]['id']}-{rows[-1]['id']}-{sha}.jsonl.gz"


def parse_deadletter_archive(key: str, data: bytes) -> list[dict[str, Any]]:
    """The dead letters an archive's bytes hold, checked against its key (checksum, ids),
    its header (format, count) and every line.

    Raises:
        CorruptDeadLetters: anything is off.
    """
    match = _KEY.fullmatch(key)
    if match is None:
        raise CorruptDeadLetters(key, "its name is not a dead letters' archive's")
    first, last, sha = int(match[1]), int(match[2]), match[3]
    actual = hashlib.sha256(data).hexdigest()
    if actual != sha:
        raise CorruptDeadLetters(key, f"its content hashes to {actual}, not to its name's")
    try:
        lines = gzip.decompress(data).decode().splitlines()
        header, *items = (loads(line) for line in lines)
    except (OSError, EOFError, UnicodeDecodeError, ValueError) as exc:
        raise CorruptDeadLetters(key, f"not gzip JSON Lines ({exc})") from None
    if not isinstance(header, dict) or header.get("format") != DEADLETTER_FORMAT:
        raise CorruptDeadLetters(
            key, f"its header is not a format-{DEADLETTER_FORMAT} dead letters' header"
        )
    if header.get("count") != len(items) or (header.get("first_id"), header.get("last_id")) != (
        first,
        last,
    ):
        raise CorruptDeadLetters(key, "its header does not match its name or its lines")
    if not all(isinstance(i, dict) and isinstance(i.get("id"), int) for i in items) or (
        items and (items[0]["id"], items[-1]["id"]) != (first, last)
    ):
        raise CorruptDeadLetters(key, "a line is not a dead letter of the range it names")
    for item in items:
        for name in ("created_at", "dead_at"):
            item[name] = datetime.fromisoformat(item[name])
    return items


async def read_deadletter_archive(store: ObjectStore, key: str) -> list[dict[str, Any]]:
    """The dead letters archived under ``key`` (each a dict of its row's columns, times as
    datetimes), checked as :func:`parse_deadletter_archive` says.

    Raises:
        CorruptDeadLetters: no such object, or it is not what its name says.
        StoreError: the store failed.
    """
    try:
        data = await store.get(key)
    except MissingObject:
        raise CorruptDeadLetters(key, "there is no such object in the archive store") from None
    return parse_deadletter_archive(key, data)


async def archive_deadletters(
    db: Db, store: ObjectStore, *, keep_for: float, batch: int = BATCH
) -> ArchivedDeadLetters:
    """Archive every dead letter that died more than ``keep_for`` seconds ago, ``batch`` at a
    time, and delete each batch once its archive is written and read back whole. No
    transaction is open across the store's calls; each delete is one statement. ``db``: a
    pool, or a connection (the one holding the round's lock).

    Raises:
        StoreError: the store failed (what was archived and checked before is deleted; the
            batch at hand stays in the table, and is archived again next time).
        CorruptDeadLetters: the archive read back is not what was written (nothing of that
            batch is deleted).
        asyncpg.PostgresError: the database failed.
    """
    keys: list[str] = []
    archived = deleted = size = 0
    after = 0
    while True:
        rows = await db.fetch(_OLD, float(keep_for), after, batch)
        if not rows:
            break
        data = _encode(rows)
        key = _key(rows, data)
        await store.put(key, data)
        parse_deadletter_archive(key, await store.get(key))  # read back: whole, as written
        kill_point("deadletters.archived")
        ids = [r["id"] for r in rows]
        deleted += await db.fetchval(_DELETE, ids, float(keep_for))
        keys.append(key)
        archived += len(rows)
        size += len(data)
        after = ids[-1]
        if len(rows) < batch:
            break
    return ArchivedDeadLetters(keys=tuple(keys), archived=archived, deleted=deleted, bytes=size)


async def archive_old_deadletters(pool: asyncpg.Pool, settings: WorkerSettings) -> int:
    """One round of the workers' housekeeping: if no other worker is doing it now, archive and
    delete the dead letters older than ``deadletter_keep_for`` to ``archive_store``. Returns
    how many were deleted (0 also when another worker holds the round).

    Raises:
        ConfigError: ``archive_store`` is not a store URL.
        StoreError, CorruptDeadLetters, asyncpg.PostgresError: as :func:`archive_deadletters`.
    """
    async with singleton(pool, "deadletters") as conn:
        if conn is None or not await conn.fetchval(_ANY_OLD, float(settings.deadletter_keep_for)):
            return 0
        store = open_archive_store(settings)
        try:
            done = await archive_deadletters(conn, store, keep_for=settings.deadletter_keep_for)
        finally:
            await store.close()
    if done.deleted:
        log.info(
            "archived and deleted %d dead letters older than %gs in %d objects (%d bytes)",
            done.deleted,
            settings.deadletter_keep_for,
            len(done.keys),
            done.bytes,
        )
    return done.deleted
