"""Snapshots: an actor's state at some ``seq``, so that activating it reads that and a tail.

A snapshot is derived data: the fold of the journal up to ``seq``, written after the step that
reached it committed, by whichever worker hosts the actor (every owner folds the same journal to
the same state, so no fencing is needed). It may be deleted at any time; an actor whose snapshot
is missing, of another ``snapshot_version``, or unreadable is folded from its journal instead.

In a state that is an attrs class, the fields typed :class:`~toren._core.history.History` are
stored in chunks (``toren.snapshot_chunks``), each written once: a snapshot writes the items
added since the previous one as a new chunk and names the chunks it keeps, so it costs what was
added, and reading one costs the chunks' bytes (decoded when something reads into them). A
History whose first items were released (:meth:`~toren._core.history.History.release`) names
only the chunks it keeps, and its row says how many items come before them. Every
other field goes into the snapshot's row (``toren.snapshots.state``) as JSON; so does a whole
state of any other type (a list, a dict), as the cattrs converter writes it.

Writers race safely: the row of a newer snapshot is never replaced by an older one, a writer
that loses inserts nothing (its transaction rolls back), and the winner deletes the chunks its
snapshot does not name. Readers read the row and its chunks in one repeatable-read transaction.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import secrets
from collections.abc import Callable, Mapping, Sequence
from typing import Any, get_args, get_origin

import asyncpg
import attrs
from pyrsistent import pmap

from toren._core.codec import converter
from toren._core.collector import paused as collector_paused
from toren._core.history import Chunk, History, Ledger
from toren._core.json_text import dumps, loads

log = logging.getLogger("toren.snapshots")


KEEP = 8  # items of a History kept in the snapshot's row rather than in a chunk


class _Lost(Exception):
    """A newer snapshot is stored: this one is not written."""


@functools.cache
def _fields(state_type: Any) -> tuple[tuple[str, str, Any, Any, str], ...]:
    """``(name, argument, type, item type, shape)`` for each field of ``state_type``
    (``argument``: its name as ``__init__`` takes it, a private field's without underscore;
    ``shape``: ``history`` or ``ledger`` for the fields stored in chunks, else empty)."""
    attrs.resolve_types(state_type)
    found = []
    for f in attrs.fields(state_type):
        item, shape = None, ""
        for kind, name in ((History, "history"), (Ledger, "ledger")):
            if get_origin(f.type) is kind or f.type is kind:
                (item,), shape = get_args(f.type) or (Any,), name
        found.append((f.name, f.alias or f.name, f.type, item, shape))
    return tuple(found)


def _decoder(item: Any) -> Callable[[bytes], Sequence[Any]]:
    hook = converter.get_structure_hook(item)

    def decode(raw: bytes) -> list[Any]:
        return [hook(x, item) for x in loads(raw)]

    return decode


def _checksum(raw: bytes, count: int) -> str:
    """What a snapshot records for a chunk of ``count`` items stored as ``raw``: the count is
    covered too, so a row that names a chunk with another count is refused when it is read,
    not when the chunk is first decoded (a state of the wrong length meanwhile)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(b"%d\n" % count)
    h.update(raw)
    return h.hexdigest()


def _encode(items: Sequence[Any], item: Any) -> bytes:
    return dumps([converter.unstructure(x, item) for x in items]).encode()


@attrs.frozen
class Encoded:
    """A snapshot ready to be written, and the state that names its chunks once it is."""

    row: Any  # the snapshot's row (``toren.snapshots.state``)
    chunks: list[tuple[str, bytes]]  # new chunks: (key, data)
    keys: list[str]  # every chunk the snapshot names
    state: Any


def encode(state: Any, seq: int) -> Encoded:
    """The snapshot of ``state`` at ``seq`` (pure: may run in a thread).

    Raises:
        Exception: whatever the converter raises for a state it cannot write.
    """
    if not attrs.has(type(state)):
        # Not an attrs class (a list, a dict...): stored whole, as the converter writes it.
        return Encoded(row=converter.unstructure(state), chunks=[], keys=[], state=state)
    row: dict[str, Any] = {}
    chunks: list[tuple[str, bytes]] = []
    keys: list[str] = []
    stored: dict[str, History[Any]] = {}
    tag = secrets.token_hex(4)  # two writers at one seq never share a key
    kind_of_state: Any = type(state)
    for name, argument, kind, item, shape in _fields(kind_of_state):
        value = getattr(state, name)
        if not shape:
            row[name] = converter.unstructure(value, kind)
            continue
        ledger = value if shape == "ledger" else None
        history = ledger.values_kept if ledger is not None else value
        if not isinstance(history, History):
            history = History(history)
        stored_row, history, new = _store(f"{name}.{seq}.{tag}", history, item)
        chunks.extend(new)
        keys.extend(c.key for c in history.chunks)
        if ledger is not None:
            row[name] = {"index": dict(ledger.index), "values": stored_row}
            if new:
                stored[argument] = ledger.with_values(history)
        else:
            row[name] = stored_row
            if new:
                stored[argument] = history
    return Encoded(row=row, chunks=chunks, keys=keys, state=attrs.evolve(state, **stored))


def _store(
    key: str, history: History[Any], item: Any
) -> tuple[dict[str, Any], History[Any], list[tuple[str, bytes]]]:
    """What a snapshot's row holds for ``history`` (its chunks, its last items), the History
    that names the chunks, and the new chunk to write, if any."""
    new: list[tuple[str, bytes]] = []
    if len(history.tail) > KEEP:
        # The last few items stay in the row: what the next steps read (the last turn, the
        # last call) is then at hand without decoding a chunk.
        tail = tuple(history.tail[:-KEEP])
        raw = _encode(tail, item)
        new.append((key, raw))
        checksum = _checksum(raw, len(tail))
        chunk = Chunk(key, len(tail), raw, _decoder(item), checksum=checksum, items=tail)
        history = history.stored(chunk, KEEP)
    row: dict[str, Any] = {
        "chunks": [[c.key, c.count, c.checksum] for c in history.chunks],
        "tail": [converter.unstructure(x, item) for x in history.tail],
    }
    if history.released:  # its first items released: their count, not their values
        row["offset"], row["released"] = history.offset, history.released
    return row, history, new


_UPSERT = """
INSERT INTO toren.snapshots (actor_id, seq, version, state) VALUES ($1, $2, $3, $4)
ON CONFLICT (actor_id) DO UPDATE SET seq = EXCLUDED.seq, version = EXCLUDED.version,
    state = EXCLUDED.state, created_at = now()
WHERE toren.snapshots.seq < EXCLUDED.seq
RETURNING 1
"""


async def write(pool: asyncpg.Pool, actor_id: str, version: int, seq: int, snap: Encoded) -> bool:
    """Store ``snap`` as the snapshot of ``actor_id`` at ``seq``; False if a newer one is kept."""
    try:
        async with pool.acquire() as conn, conn.transaction():
            await _write(conn, actor_id, version, seq, snap)
    except _Lost:
        return False
    return True


async def _write(conn: Any, actor_id: str, version: int, seq: int, snap: Encoded) -> None:
    """Raises: _Lost, a newer snapshot is stored (the transaction is then rolled back)."""
    if snap.chunks:
        await conn.executemany(
            "INSERT INTO toren.snapshot_chunks (actor_id, key, data) VALUES ($1, $2, $3)",
            [(actor_id, key, data) for key, data in snap.chunks],
        )
    if await conn.fetchval(_UPSERT, actor_id, seq, version, snap.row) is None:
        raise _Lost
    await conn.execute(
        "DELETE FROM toren.snapshot_chunks WHERE actor_id = $1 AND NOT (key = ANY($2))",
        actor_id,
        snap.keys,
    )


async def read(conn: Any, actor_id: str, state_type: type, version: int) -> tuple[Any, int] | None:
    """The stored snapshot of ``actor_id`` as ``(state, seq)``, or None if there is none that
    this code can read (then the journal is folded from its start).

    Call it inside a repeatable-read transaction, so that the row and its chunks match.
    """
    row = await conn.fetchrow(
        "SELECT seq, version, state FROM toren.snapshots WHERE actor_id = $1", actor_id
    )
    if row is None or row["version"] != version:
        return None
    try:
        chunks = await _chunks(conn, actor_id, row["state"])
        with collector_paused():
            return _state(chunks, row["state"], state_type), row["seq"]
    except Exception as exc:  # noqa: BLE001  (derived data: any damage means fold instead)
        log.warning(
            "%s: the snapshot at seq %d cannot be read (%s: %s); folding the journal instead",
            actor_id,
            row["seq"],
            type(exc).__name__,
            exc,
        )
        return None


async def _chunks(conn: Any, actor_id: str, row: Any) -> dict[str, bytes]:
    stored = []  # what the row says is stored in chunks: each History, a Ledger's values
    for value in row.values() if isinstance(row, Mapping) else ():
        if isinstance(value, Mapping) and isinstance(value.get("values"), Mapping):
            value = value["values"]
        if isinstance(value, Mapping) and isinstance(value.get("chunks"), list):
            stored.append(value)
    keys = [key for value in stored for key, *_ in value["chunks"]]
    if not keys:
        return {}
    rows = await conn.fetch(
        "SELECT key, data FROM toren.snapshot_chunks WHERE actor_id = $1 AND key = ANY($2)",
        actor_id,
        keys,
    )
    return {r["key"]: r["data"] for r in rows}


def _history(chunks: Mapping[str, bytes], value: Any, item: Any) -> History[Any]:
    decode = _decoder(item)
    tail = [converter.structure(x, item) for x in value["tail"]]
    stored = []
    for key, count, checksum in value["chunks"]:
        raw, count = chunks[key], int(count)
        # A chunk is checked here (its bytes and count), decoded when first read.
        if _checksum(raw, count) != checksum:
            raise ValueError(f"chunk {key!r} is not the one the snapshot names")
        stored.append(Chunk(key, count, raw, decode, checksum=checksum))
    offset, released = int(value.get("offset", 0)), int(value.get("released", 0))
    return History(tail, chunks=stored, offset=offset, released=released)


def _state(chunks: Mapping[str, bytes], row: Any, state_type: type) -> Any:
    if not attrs.has(state_type):
        return converter.structure(row, state_type)
    values: dict[str, Any] = {}
    for name, argument, kind, item, shape in _fields(state_type):
        value = row[name]
        if not shape:
            values[argument] = converter.structure(value, kind)
        elif shape == "history":
            values[argument] = _history(chunks, value, item)
        else:
            index = value["index"]
            values[argument] = Ledger(
                index=pmap(index, pre_size=2 * len(index)),
                values=_history(chunks, value["values"], item),
            )
    return state_type(**values)
