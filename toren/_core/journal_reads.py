"""Journals as the layers above read them: the kernel's own queries on ``toren.journal``,
generic over kinds (a kind names the event types and the keys of their data it wants).

Every query reads by the journal's primary key ``(actor_id, seq)``: one actor's events, or
several actors' in one query.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import asyncpg

from toren._core.journal import JournalEntry
from toren._core.rows import ActorRow, columns, json_key, row

if TYPE_CHECKING:
    from toren._core.rows import Db

_ENTRY = "j.seq, j.epoch, j.type, j.data, j.created_at AS at"


def _entry(r: asyncpg.Record) -> JournalEntry:
    return JournalEntry(seq=r["seq"], epoch=r["epoch"], type=r["type"], data=r["data"], at=r["at"])


async def events(
    db: Db,
    actor_id: str,
    *,
    types: Collection[str] | None = None,
    after: int = 0,
    limit: int | None = None,
    match: Mapping[str, Collection[str]] | None = None,
    present: Iterable[str] = (),
    keys: Sequence[str] | None = None,
    without: Iterable[str] = (),
) -> list[JournalEntry]:
    """Actor ``actor_id``'s events after ``seq`` ``after``, in order; the first ``limit``.

    Only those of ``types``; whose data's keys in ``match`` hold one of its (text) values;
    whose data holds each key of ``present``. Their data is read whole, or only its ``keys``
    (``None`` for one it lacks), or without the keys ``without`` (large values not needed).

    Raises:
        ValueError: a key is not a plain name.
    """
    where, values = ["j.actor_id = $1", "j.seq > $2"], [actor_id, after]

    def value(v: Any) -> str:
        values.append(v)
        return f"${len(values)}"

    if types is not None:
        where.append(f"j.type = ANY({value(list(types))}::text[])")
    for key, wanted in (match or {}).items():
        where.append(f"j.data->>'{json_key(key)}' = ANY({value(list(wanted))}::text[])")
    where.extend(f"j.data->>'{json_key(key)}' IS NOT NULL" for key in present)
    data = "j.data"
    if keys is not None:
        pairs = ", ".join(f"'{json_key(k)}', j.data->'{k}'" for k in keys)
        data = f"jsonb_build_object({pairs})"
    for key in without:
        data += f" - '{json_key(key)}'"
    sql = (
        f"SELECT j.seq, j.epoch, j.type, {data} AS data, j.created_at AS at "
        f"FROM toren.journal j WHERE {' AND '.join(where)} ORDER BY j.seq"
    )
    if limit is not None:
        sql += f" LIMIT {value(limit)}"
    return [_entry(r) for r in await db.fetch(sql, *values)]


_AFTER = f"""
SELECT w.actor_id, {_ENTRY}
FROM unnest($1::text[], $2::bigint[]) AS w(actor_id, after)
CROSS JOIN LATERAL (
    SELECT seq, epoch, type, data, created_at FROM toren.journal
    WHERE actor_id = w.actor_id AND seq > w.after ORDER BY seq LIMIT $3
) AS j
ORDER BY w.actor_id, j.seq
"""


async def events_after(
    db: Db, reads: Sequence[tuple[str, int]], *, limit: int
) -> list[tuple[str, JournalEntry]]:
    """For each ``(actor id, seq)`` of ``reads``, the first ``limit`` events of that actor
    after that ``seq``: ``(actor id, event)`` by actor id, then in order. One query."""
    if not reads:
        return []
    rows = await db.fetch(_AFTER, [a for a, _ in reads], [s for _, s in reads], limit)
    return [(r["actor_id"], _entry(r)) for r in rows]


async def last_seq(db: Db, actor_id: str) -> int | None:
    """The ``seq`` of actor ``actor_id``'s last event; ``None`` if it has none."""
    seq: int | None = await db.fetchval(
        "SELECT max(seq) FROM toren.journal WHERE actor_id = $1", actor_id
    )
    return seq


async def actor_and_events(
    db: Db,
    actor_id: str,
    *,
    after: int,
    fields: Iterable[str] = (),
    mail_kind: str | None = None,
) -> tuple[ActorRow, list[JournalEntry]] | None:
    """Actor ``actor_id``'s row (its small columns, and ``fields`` as :func:`actor_row` reads
    them) and its events after ``seq`` ``after``, in one query; ``None`` if there is no such
    actor. With ``mail_kind``, the row's ``mail_waiting`` says whether a message of that kind
    waits in its mailbox (in the same query)."""
    waiting = (
        ", EXISTS (SELECT 1 FROM toren.mailbox m WHERE m.actor_id = a.actor_id "
        "AND m.kind = $3) AS mail_waiting"
        if mail_kind is not None
        else ""
    )
    rows = await db.fetch(
        f"SELECT {columns(fields)}{waiting}, {_ENTRY} FROM toren.actors a "
        "LEFT JOIN toren.journal j ON j.actor_id = a.actor_id AND j.seq > $2 "
        "WHERE a.actor_id = $1 ORDER BY j.seq",
        actor_id,
        after,
        *(() if mail_kind is None else (mail_kind,)),
    )
    if not rows:
        return None
    return row(rows[0]), [_entry(r) for r in rows if r["seq"] is not None]
