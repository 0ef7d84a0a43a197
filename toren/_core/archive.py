"""Journal archives: a range of an actor's journal as one compressed, checksummed object.

STAND-IN (helper C, issue 32): the minimal implementation of helper B's contract that the
truncation of long conversations (:mod:`toren._core.truncation`) is built and tested against.
The signatures are B's (``ArchiveRef``, ``archive_journal``, ``read_archive``,
``CorruptArchive``, ``ARCHIVE_FORMAT``); on merge, B's module replaces this file whole.

The object: gzip JSON Lines, a header line (format, actor id, first and last seq, events),
then one line per event (seq, epoch, type, data, created_at).
"""

from __future__ import annotations

import gzip
import hashlib
from collections.abc import Mapping
from datetime import datetime
from typing import TYPE_CHECKING, Any

import attrs

from toren._core.errors import TorenError
from toren._core.journal import JournalEntry
from toren._core.json_text import dumps, loads

if TYPE_CHECKING:
    from toren._core.rows import Db
    from toren._core.stores import ObjectStore

ARCHIVE_FORMAT = 1


class CorruptArchive(TorenError):
    """An archive object is not the one its reference names, or cannot be read."""

    def __init__(self, location: str, detail: str) -> None:
        self.location = location
        self.detail = detail
        super().__init__(f"archive {location!r} cannot be used: {detail}")


@attrs.frozen(kw_only=True)
class ArchiveRef:
    """Where an archived range of a journal is, and what it must hash to."""

    location: str
    sha256: str
    first_seq: int
    last_seq: int
    events: int
    bytes: int
    format: int

    def to_json(self) -> dict[str, Any]:
        return attrs.asdict(self)

    @classmethod
    def from_json(cls, value: Mapping[str, Any]) -> ArchiveRef:
        return cls(**{f.name: value[f.name] for f in attrs.fields(cls)})


def _location(actor_id: str, first: int, last: int) -> str:
    kind, _, _ = actor_id.partition("/")
    name = hashlib.sha256(actor_id.encode("utf-8", "surrogatepass")).hexdigest()[:32]
    safe = "".join(c if c.isalnum() or c in "_-" else "_" for c in kind) or "_"
    return f"journals/{safe}/{name}/{first}-{last}.jsonl.gz"


async def archive_journal(
    db: Db, store: ObjectStore, actor_id: str, *, first_seq: int = 1, last_seq: int | None = None
) -> ArchiveRef:
    """Write events ``first_seq``..``last_seq`` of ``actor_id``'s journal as one object, read it
    back and check it; the reference to keep.

    Raises:
        CorruptArchive: the range is not all there, or the object read back differs.
        StoreError: the store failed.
    """
    rows = await db.fetch(
        "SELECT seq, epoch, type, data::text AS data, created_at FROM toren.journal "
        "WHERE actor_id = $1 AND seq >= $2 AND ($3::bigint IS NULL OR seq <= $3) ORDER BY seq",
        actor_id,
        first_seq,
        last_seq,
    )
    last = rows[-1]["seq"] if rows else first_seq - 1
    if not rows or rows[0]["seq"] != first_seq or len(rows) != last - first_seq + 1:
        raise CorruptArchive(_location(actor_id, first_seq, last), "the journal has a gap")
    header = {"format": ARCHIVE_FORMAT, "actor_id": actor_id, "first_seq": first_seq,
              "last_seq": last, "events": len(rows)}  # fmt: skip
    lines = [dumps(header)]
    for r in rows:
        at = r["created_at"].isoformat()
        lines.append(f'{{"seq":{r["seq"]},"epoch":{r["epoch"]},"type":{dumps(r["type"])},'
                     f'"data":{r["data"]},"created_at":{dumps(at)}}}')  # fmt: skip
    raw = gzip.compress("\n".join(lines).encode("utf-8", "surrogatepass"), mtime=0)
    ref = ArchiveRef(
        location=_location(actor_id, first_seq, last),
        sha256=hashlib.sha256(raw).hexdigest(),
        first_seq=first_seq,
        last_seq=last,
        events=len(rows),
        bytes=len(raw),
        format=ARCHIVE_FORMAT,
    )
    await store.put(ref.location, raw)
    await read_archive(store, ref, actor_id=actor_id)
    return ref


async def read_archive(
    store: ObjectStore, ref: ArchiveRef, *, actor_id: str | None = None
) -> list[JournalEntry]:
    """The events of an archived range, checked against ``ref``.

    Raises:
        CorruptArchive: checksum, compression, header or a line does not match.
        StoreError: the store failed (MissingObject: no such object).
    """
    raw = await store.get(ref.location)
    if hashlib.sha256(raw).hexdigest() != ref.sha256:
        raise CorruptArchive(ref.location, "its checksum differs from the one recorded")
    try:
        head, *lines = gzip.decompress(raw).decode("utf-8", "surrogatepass").split("\n")
        header = loads(head)
        events = [loads(line) for line in lines]
    except (OSError, EOFError, ValueError) as exc:
        raise CorruptArchive(ref.location, f"unreadable ({exc})") from exc
    expected = (ref.format, ref.first_seq, ref.last_seq, ref.events)
    found = (header.get("format"), header.get("first_seq"), header.get("last_seq"), len(events))
    if found != expected or (actor_id is not None and header.get("actor_id") != actor_id):
        raise CorruptArchive(ref.location, "its header does not match the reference")
    entries = [
        JournalEntry(
            seq=e["seq"],
            epoch=e["epoch"],
            type=e["type"],
            data=e["data"],
            at=datetime.fromisoformat(e["created_at"]),
        )
        for e in events
    ]
    if [e.seq for e in entries] != list(range(ref.first_seq, ref.last_seq + 1)):
        raise CorruptArchive(ref.location, "its events are not the range it names")
    return entries
