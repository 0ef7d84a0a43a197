"""Journal archives: an actor's events, or a range of them, as one compressed object in an
object store (:mod:`toren._core.stores`), written and verified before the rows may be deleted,
and read back, checked, as the journal gave them.

Format 1 (``ARCHIVE_FORMAT``), the object's content: gzip of JSON Lines (UTF-8, one JSON object
per line, each line ending in ``\\n``). The first line is the header::

    {"archive": "toren.journal", "format": 1, "kind": "toren.run", "actor_id": "run/...",
     "first_seq": 1, "last_seq": 42, "events": 42}

then one line per event, in ``seq`` order::

    {"seq": 1, "epoch": 1, "type": "run.started", "created_at": "2026-12-07T10:00:00.1+00:00",
     "data": {...}}

``data`` is the event's data as the journal's ``jsonb`` holds it: Toren's JSON text
(:mod:`toren._core.json_text`), where a string holding NUL or a lone surrogate, a huge integer
or a float jsonb would print as a whole number is *tagged*; :func:`read_archive` untags it, so
an archived event reads back equal to the journal's. ``created_at`` is ISO 8601 with its offset.
``first_seq``/``last_seq`` are the seqs of the first and last event in the object (of the range
asked for; an empty range is allowed: ``events`` 0, ``last_seq`` = ``first_seq`` - 1).

The object is stored under ``journals/<kind>/<actor id>/<first_seq>-<last_seq>.jsonl.gz`` (the
kind and actor id each one key segment: :func:`key_segment`). Its SHA-256 (of the compressed
bytes as stored) is what the caller keeps, in an :class:`ArchiveRef`, and what every read
checks first. The same range written twice gives the same bytes (gzip without a timestamp), so
the same key and checksum: archiving is idempotent.

Reading refuses, with :class:`CorruptArchive` naming what is wrong, an object whose checksum,
size, gzip stream, header (archive, format, kind, actor, seq range, event count) or any line
does not match; a missing object is :class:`MissingArchive`. ``tests/fixtures/archives/`` holds
an archive of each format version written so far, which every later Toren must keep reading.
"""

from __future__ import annotations

import hashlib
import logging
import re
import zlib
from collections.abc import Iterator, Mapping, Sequence
from datetime import datetime
from typing import TYPE_CHECKING, Any

import anyio
import attrs
import orjson

from toren._core.config import archive_store_url as archive_store_url  # (re-exported)
from toren._core.errors import InternalError, TorenError
from toren._core.journal import JournalEntry
from toren._core.json_text import dumps, loads
from toren._core.stores import MissingObject, ObjectStore, StoreError, store_from_url

if TYPE_CHECKING:
    from toren._core.config import WorkerSettings
    from toren._core.rows import Db

ARCHIVE_FORMAT = 1
FORMATS = frozenset({1})  # the versions read_archive reads (tests/fixtures/archives/)
PAGE = 1000  # journal rows read per statement while writing
_PIECE = 1 << 20  # compressed bytes decompressed at once while reading
_NAME = "toren.journal"
_GZIP = 31  # zlib's wbits for a gzip stream (header and trailer, mtime 0: deterministic)
_LEVEL = 6
_SAFE = re.compile(r"[A-Za-z0-9.-]")
_ESCAPED = re.compile(r"_([0-9A-F]{2})")
_EVENT_KEYS = frozenset({"seq", "epoch", "type", "created_at", "data"})

log = logging.getLogger("toren.archive")


@attrs.frozen(kw_only=True)
class ArchiveRef:
    """Where an archive is and what it holds: what a caller keeps to read it back."""

    location: str  # the store key
    sha256: str  # hex, of the compressed bytes as stored
    first_seq: int
    last_seq: int
    events: int
    bytes: int  # compressed size
    format: int

    def to_json(self) -> dict[str, Any]:
        """The reference as a JSON object (for a ``jsonb`` column)."""
        return {
            "location": self.location,
            "sha256": self.sha256,
            "first_seq": self.first_seq,
            "last_seq": self.last_seq,
            "events": self.events,
            "bytes": self.bytes,
            "format": self.format,
        }

    @classmethod
    def from_json(cls, value: Mapping[str, Any]) -> ArchiveRef:
        """The reference :meth:`to_json` wrote.

        Raises:
            CorruptArchive: ``value`` is not one (a field missing or of the wrong type).
        """
        where = str(value.get("location", "?")) if isinstance(value, Mapping) else "?"
        if not isinstance(value, Mapping):
            raise CorruptArchive(where, "its reference is not a JSON object")
        fields: dict[str, Any] = {}
        for name, kind in (("location", str), ("sha256", str)):
            if not isinstance(value.get(name), kind):
                raise CorruptArchive(where, f"its reference has no {name}")
            fields[name] = value[name]
        for name in ("first_seq", "last_seq", "events", "bytes", "format"):
            if not _is_int(value.get(name)):
                raise CorruptArchive(where, f"its reference has no integer {name}")
            fields[name] = value[name]
        return cls(**fields)


class CorruptArchive(TorenError):
    """An archive cannot be read back as it was written: its checksum, gzip stream, header or a
    line is wrong, or it is not the archive asked for. Nothing is read from it."""

    def __init__(self, location: str, detail: str) -> None:
        self.location = location
        self.detail = detail
        super().__init__(
            f"journal archive {location!r} is unusable: {detail}. It was not read: copy the "
            "object back from a backup of the archive store, or check that archive_store "
            "names the store it was written to"
        )


class MissingArchive(CorruptArchive):
    """No object under the archive's key in the store given."""

    def __init__(self, location: str, where: str) -> None:
        self.where = where
        super().__init__(location, f"there is no such object in the archive store {where}")


def open_archive_store(settings: WorkerSettings) -> ObjectStore:
    """The archive store the settings name (close it when done; nothing is opened until its
    first use).

    Raises:
        ConfigError: ``archive_store`` is not a directory or ``s3://`` URL (the message names
            the setting, never its value).
    """
    return store_from_url(archive_store_url(settings), setting="archive_store")


# -- keys ----------------------------------------------------------------------------------------


def key_segment(text: str) -> str:
    """``text`` as one segment of a store key: letters, digits, ``.`` and ``-`` as they are,
    every other character as ``_XX`` per UTF-8 byte (so ``run/1`` is ``run_2F1``; a leading
    ``.`` is escaped too). Reversible: :func:`segment_text`."""
    out = []
    for i, char in enumerate(text):
        if _SAFE.fullmatch(char) and not (i == 0 and char == "."):
            out.append(char)
        else:
            out.extend(f"_{b:02X}" for b in char.encode("utf-8", "surrogatepass"))
    return "".join(out) or "_"


def segment_text(segment: str) -> str:
    """The text :func:`key_segment` made ``segment`` from."""
    if segment == "_":
        return ""
    raw = bytearray()
    pos = 0
    for m in _ESCAPED.finditer(segment):
        raw += segment[pos : m.start()].encode()
        raw.append(int(m.group(1), 16))
        pos = m.end()
    raw += segment[pos:].encode()
    return raw.decode("utf-8", "surrogatepass")


def archive_key(kind: str, actor_id: str, first_seq: int, last_seq: int) -> str:
    """The store key of the archive of ``actor_id``'s events ``first_seq`` to ``last_seq``."""
    return f"journals/{key_segment(kind)}/{key_segment(actor_id)}/{first_seq}-{last_seq}.jsonl.gz"


# -- writing -------------------------------------------------------------------------------------

_RANGE = """
SELECT (SELECT kind FROM toren.actors WHERE actor_id = $1) AS kind,
       count(*) AS events, min(seq) AS first, max(seq) AS last
FROM toren.journal WHERE actor_id = $1 AND seq >= $2 AND seq <= $3
"""
_PAGE = """
SELECT seq, epoch, type, data::text AS data, created_at FROM toren.journal
WHERE actor_id = $1 AND seq > $2 AND seq <= $3 ORDER BY seq LIMIT $4
"""
_MAX_SEQ = 2**63 - 1


async def archive_journal(
    db: Db,
    store: ObjectStore,
    actor_id: str,
    *,
    first_seq: int = 1,
    last_seq: int | None = None,
) -> ArchiveRef:
    """Archive actor ``actor_id``'s events from ``first_seq`` to ``last_seq`` (to its last
    event if ``None``) as one object in ``store``, read it back, check it, and say where it is.

    The rows are read in pages of ``PAGE`` by their primary key, each page its own statement
    (no transaction is held while the object is uploaded), and compressed as they come: only
    the compressed object is held whole. The range's first and last seq are those of the events
    found in it. An object already under the key with the same checksum is kept (archiving the
    same range again writes nothing); one with other bytes but the same events is kept too; a
    damaged one is replaced by what the journal holds now; a whole archive of other events is
    never replaced (another database's: it raises).

    Raises:
        ValueError: the range is not one (``first_seq`` < 1, or ``last_seq`` < ``first_seq``
            - 1).
        CorruptArchive: the rows changed while they were read (an event of the range was
            deleted), the store gave back other bytes than were written, or the key holds an
            archive of other events.
        StoreError, ConfigError: the store's own (``StoreUnavailable`` is retryable).
    """
    if first_seq < 1 or (last_seq is not None and last_seq < first_seq - 1):
        raise ValueError(f"not a range of seqs: {first_seq} to {last_seq}")
    upto = _MAX_SEQ if last_seq is None else last_seq
    found = await db.fetchrow(_RANGE, actor_id, first_seq, upto)
    if found is None:
        raise InternalError("an aggregate of the journal gave no row")
    kind = found["kind"] or actor_id.partition("/")[0]
    count: int = found["events"]
    first = found["first"] if count else first_seq
    last = found["last"] if count else first_seq - 1
    key = archive_key(kind, actor_id, first, last)

    header = {
        "archive": _NAME,
        "format": ARCHIVE_FORMAT,
        "kind": kind,
        "actor_id": actor_id,
        "first_seq": first,
        "last_seq": last,
        "events": count,
    }
    packer = zlib.compressobj(_LEVEL, zlib.DEFLATED, _GZIP)
    chunks = [packer.compress(dumps(header).encode() + b"\n")]
    after, written = first - 1, 0
    while written < count:
        rows = await db.fetch(_PAGE, actor_id, after, last, PAGE)
        if not rows:
            break
        # Encoded and compressed in a thread: a page is about a megabyte of JSON, which would
        # hold the event loop (and the steps beside it) for milliseconds.
        chunks.append(await anyio.to_thread.run_sync(_packed, packer, rows))
        after, written = rows[-1]["seq"], written + len(rows)
    chunks.append(packer.flush())
    if written != count:
        raise CorruptArchive(
            key, f"{count} events were counted in the journal but {written} were read"
        )
    data = b"".join(chunks)
    del chunks
    ref = ArchiveRef(
        location=key,
        sha256=await _sha256(data),
        first_seq=first,
        last_seq=last,
        events=count,
        bytes=len(data),
        format=ARCHIVE_FORMAT,
    )
    if await store.exists(key):
        kept = await _existing(store, ref, data)
        if kept is not None:
            return kept
    await store.put(key, data)
    back = await store.get(key)
    if await _sha256(back) != ref.sha256:
        raise CorruptArchive(key, "the store gave back other bytes than were written")
    return ref


def _packed(packer: Any, rows: Sequence[Any]) -> bytes:
    """Journal rows as archive lines, through ``packer`` (what it gives out so far)."""
    lines = [
        orjson.dumps(
            {
                "seq": r["seq"],
                "epoch": r["epoch"],
                "type": r["type"],
                "created_at": r["created_at"].isoformat(),
                "data": orjson.Fragment(r["data"]),
            }
        )
        for r in rows
    ]
    out: bytes = packer.compress(b"\n".join(lines) + b"\n")
    return out


async def _sha256(data: bytes) -> str:
    """The hex SHA-256 of ``data``, hashed in a thread (hashlib lets go of the GIL)."""
    return await anyio.to_thread.run_sync(lambda: hashlib.sha256(data).hexdigest())


async def _existing(store: ObjectStore, ref: ArchiveRef, data: bytes) -> ArchiveRef | None:
    """The reference of the object already under ``ref``'s key if it holds what ``data``
    does (the same bytes, or the same events compressed otherwise); ``None`` if it must be
    written again."""
    try:
        there = await store.get(ref.location)
    except MissingObject:
        return None
    if there == data:
        return ref
    try:
        same = zlib.decompress(there, _GZIP) == zlib.decompress(data, _GZIP)
    except zlib.error:
        same = False
    theirs = attrs.evolve(ref, sha256=hashlib.sha256(there).hexdigest(), bytes=len(there))
    if same:
        return theirs
    try:
        parse_archive(there, theirs)
    except CorruptArchive:  # damaged: nothing can read it; what the journal holds replaces it
        log.warning("journal archive %s is damaged; it is written again", ref.location)
        return None
    # A whole archive of other events under this key: another database's run of the same id
    # (databases sharing a store give keyed runs the same ids), which its audit record names.
    raise CorruptArchive(
        ref.location,
        "it holds another journal of this actor and range (another database sharing this "
        "archive store?), which is not replaced; give each database its own archive_store "
        "(or prefix)",
    )


async def drop_shorter(store: ObjectStore, ref: ArchiveRef) -> int:
    """Delete the archives of ``ref``'s actor from the same first seq to an earlier last one,
    once ``ref`` is recorded: what a writer killed between its archive and its commit left (a
    prune batch at ``prune.read``, a truncation at ``truncation.archived``) when the actor went
    on before the next writer came, so that the range came out longer. No record names such
    an object and none ever will (the range from that seq is ``ref``'s now); an object ending
    later than ``ref`` is left alone. How many were deleted. Best effort: a store that fails
    is logged, and the object costs its bytes, nothing else."""
    folder, _, _ = ref.location.rpartition("/")
    start = f"{ref.first_seq}-"
    dropped = 0
    try:
        async for key in store.list_keys(f"{folder}/{start}"):
            name = key.rpartition("/")[2].removeprefix(start).removesuffix(".jsonl.gz")
            if name.isdigit() and int(name) < ref.last_seq and await store.delete(key):
                log.info("%s: an archive of a writer cut short, deleted", key)
                dropped += 1
    except (StoreError, OSError) as exc:  # the range is recorded: only bytes are at stake
        log.warning("leftovers of %s not deleted (%s: %s)", ref.location, type(exc).__name__, exc)
    return dropped


# -- reading -------------------------------------------------------------------------------------


async def read_archive(
    store: ObjectStore, ref: ArchiveRef, *, actor_id: str | None = None
) -> list[JournalEntry]:
    """The events of the archive ``ref`` names, in order, as the journal gave them: checked
    against its checksum and size, its gzip stream, its header (that it is an archive of a
    format this Toren reads, of the actor its key names, or ``actor_id`` when given, and of
    ``ref``'s range and count) and every line.

    Raises:
        MissingArchive: no object under its key.
        CorruptArchive: anything else does not match (its location is no object's key, say);
            the message says what.
        StoreError, ConfigError: the store's own.
    """
    try:
        data = await store.get(ref.location)
    except MissingObject as e:
        raise MissingArchive(ref.location, e.where) from None
    except (ValueError, IsADirectoryError, NotADirectoryError):
        # a reference edited by hand: a key the store refuses (``..``, empty) or a folder of it
        raise CorruptArchive(
            ref.location, "its reference's location is not the key of an archive object"
        ) from None
    return await anyio.to_thread.run_sync(parse_archive, data, ref, actor_id)


def parse_archive(data: bytes, ref: ArchiveRef, actor_id: str | None = None) -> list[JournalEntry]:
    """The events of an archive's bytes (:func:`read_archive` without the store)."""
    where = ref.location

    def bad(detail: str) -> CorruptArchive:
        return CorruptArchive(where, detail)

    digest = hashlib.sha256(data).hexdigest()
    if digest != ref.sha256:
        raise bad(
            f"its checksum is {digest[:16]}..., not {ref.sha256[:16]}... as recorded "
            f"({len(data)} bytes, {ref.bytes} recorded): it was changed or damaged after it "
            "was written"
        )
    if len(data) != ref.bytes:
        raise bad(f"it is {len(data)} bytes, not {ref.bytes} as recorded")
    if ref.format not in FORMATS:
        raise bad(
            f"its reference says format {ref.format}, which this Toren does not read "
            f"(it reads {', '.join(map(str, sorted(FORMATS)))}): upgrade Toren"
        )
    lines = _lines(data, bad)
    header = _header(next(lines, b""), ref, actor_id, bad)
    out: list[JournalEntry] = []
    previous = ref.first_seq - 1
    for number, line in enumerate(lines, start=2):
        if len(out) == header["events"]:
            raise bad(f"it holds more events than its header says ({header['events']})")
        entry = _event(line, number, bad)
        if entry.seq <= previous or entry.seq > ref.last_seq:
            raise bad(
                f"line {number} has seq {entry.seq}, out of order or outside "
                f"{ref.first_seq}-{ref.last_seq}"
            )
        previous = entry.seq
        out.append(entry)
    if len(out) != header["events"]:
        raise bad(f"it holds {len(out)} events, its header says {header['events']}")
    if out and (out[0].seq != ref.first_seq or out[-1].seq != ref.last_seq):
        raise bad(
            f"its events run from seq {out[0].seq} to {out[-1].seq}, not "
            f"{ref.first_seq}-{ref.last_seq} as recorded"
        )
    return out


def _lines(data: bytes, bad: Any) -> Iterator[bytes]:
    """The lines of the gzip stream ``data``, decompressed a piece at a time (the whole text
    is never held: only the events parsed from it), each without its newline.

    Raises:
        CorruptArchive: the stream is not gzip, is cut short, is followed by other bytes, or
            its last line has no newline (each seen when reached).
    """
    unpacker = zlib.decompressobj(_GZIP)
    view = memoryview(data)
    pending = b""
    for start in range(0, len(data), _PIECE):
        try:
            pending += unpacker.decompress(view[start : start + _PIECE])
        except zlib.error as e:
            raise bad(f"it is not a valid gzip stream ({e})") from None
        *complete, pending = pending.split(b"\n")
        yield from complete
        if unpacker.eof:
            break
    if not unpacker.eof:
        raise bad("its gzip stream is truncated")
    if unpacker.unused_data:
        raise bad(f"{len(unpacker.unused_data)} bytes follow its gzip stream")
    if pending:
        raise bad("its last line is cut short (no newline at the end)")


def _header(line: bytes, ref: ArchiveRef, actor_id: str | None, bad: Any) -> dict[str, Any]:
    try:
        header = loads(line)
    except orjson.JSONDecodeError as e:
        raise bad(f"its first line is not a JSON header ({e})") from None
    if not isinstance(header, dict) or header.get("archive") != _NAME:
        raise bad("its first line is not the header of a journal archive")
    if header.get("format") not in FORMATS:
        raise bad(
            f"it is in format {header.get('format')!r}, which this Toren does not read (it "
            f"reads {', '.join(map(str, sorted(FORMATS)))}): upgrade Toren to read it"
        )
    if header["format"] != ref.format:
        raise bad(f"its header says format {header['format']}, its reference {ref.format}")
    for name in ("kind", "actor_id"):
        if not isinstance(header.get(name), str):
            raise bad(f"its header has no {name}")
    for name in ("first_seq", "last_seq", "events"):
        if not _is_int(header.get(name)):
            raise bad(f"its header has no integer {name}")
    expected = actor_id if actor_id is not None else _actor_of(ref.location)
    if expected is not None and header["actor_id"] != expected:
        raise bad(f"it holds the events of actor {header['actor_id']!r}, not {expected!r}")
    recorded = (ref.first_seq, ref.last_seq, ref.events)
    held = (header["first_seq"], header["last_seq"], header["events"])
    if held != recorded:
        raise bad(
            "its header says seq {}-{} ({} events), its reference seq {}-{} ({} events)".format(
                *held, *recorded
            )
        )
    return header


def _actor_of(location: str) -> str | None:
    """The actor id an archive's key names (``None`` for a key not made by
    :func:`archive_key`)."""
    parts = location.split("/")
    if len(parts) != 4 or parts[0] != "journals":
        return None
    try:
        return segment_text(parts[2])
    except UnicodeDecodeError:
        return None


def _event(line: bytes, number: int, bad: Any) -> JournalEntry:
    try:
        value = loads(line)
    except orjson.JSONDecodeError as e:
        raise bad(f"line {number} is not JSON ({e})") from None
    if not isinstance(value, dict) or set(value) != _EVENT_KEYS:
        raise bad(f"line {number} is not an event (seq, epoch, type, created_at, data)")
    if not (_is_int(value["seq"]) and _is_int(value["epoch"]) and isinstance(value["type"], str)):
        raise bad(f"line {number} has a seq, epoch or type of the wrong type")
    try:
        at = datetime.fromisoformat(value["created_at"])
    except (TypeError, ValueError):
        raise bad(f"line {number} has no valid created_at") from None
    if at.tzinfo is None:
        raise bad(f"line {number} has a created_at without its offset")
    return JournalEntry(
        seq=value["seq"], epoch=value["epoch"], type=value["type"], data=value["data"], at=at
    )


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# -- writing back ---------------------------------------------------------------------------------

_RESTORE = """
INSERT INTO toren.journal (actor_id, seq, epoch, type, data, created_at)
SELECT $1, e.seq, e.epoch, e.type, e.data::jsonb, e.at
FROM unnest($2::bigint[], $3::bigint[], $4::text[], $5::text[], $6::timestamptz[])
    AS e(seq, epoch, type, data, at)
"""


async def restore_journal(
    conn: Db,
    actor_id: str,
    entries: Sequence[JournalEntry],
    *,
    summary: Any = None,
    created_at: datetime | None = None,
) -> None:
    """Write ``entries`` (read from an archive) back as actor ``actor_id``'s journal, with
    their seqs, epochs and times, and set its row's ``summary`` and ``created_at`` (when it
    was first made: lists order by it); in the caller's transaction,
    which made the actor's row (its journal must be empty: restoring twice is refused by the
    journal's primary key, ``asyncpg.UniqueViolationError``).

    Raises:
        InternalError: ``entries`` do not start at seq 1 (a journal starts there).
    """
    if entries and entries[0].seq != 1:
        raise InternalError(
            f"a journal restored for {actor_id} would start at seq {entries[0].seq}"
        )
    for start in range(0, len(entries), PAGE):
        page = entries[start : start + PAGE]
        await conn.execute(
            _RESTORE,
            actor_id,
            [e.seq for e in page],
            [e.epoch for e in page],
            [e.type for e in page],
            [dumps(e.data) for e in page],
            [e.at for e in page],
        )
    await conn.execute(
        "UPDATE toren.actors SET summary = coalesce($2, summary), "
        "created_at = coalesce($3, created_at) WHERE actor_id = $1",
        actor_id,
        summary,
        created_at,
    )
