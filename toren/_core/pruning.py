"""Deleting ended actors' trees, the kernel's half of retention (issue 32).

A kind that prunes (the run kind, ``toren/runs/prune.py``) finds the trees it may delete with
:func:`ended_trees` (no lock taken), reads and keeps what it must of them, then, in one short
transaction of its own, locks them with :func:`lock_trees` and deletes them with
:func:`delete_trees`. The kernel knows nothing of what the kind keeps (an audit row, an archive):
it only finds, locks and deletes rows, so that no statement on its tables lives above it.

A tree is an actor and every actor below it by ``toren.actors.parent`` (a run's child runs, its
sandbox, theirs). :func:`lock_trees` takes their rows ``FOR UPDATE SKIP LOCKED`` under the
transaction's ``lock_timeout``: a row a step holds (its step statement locks it) is skipped,
never waited for, so pruning never makes a step wait longer than that timeout (the statements
that take no row lock, such as a send's foreign-key check, wait at most as long). A tree with a
row skipped, a message waiting, or an actor still running is left whole for a later batch.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from datetime import datetime
from typing import TYPE_CHECKING, Any

import attrs

from toren._core.rows import _kind, json_key

if TYPE_CHECKING:
    from toren._core.rows import Db

LOCK_TIMEOUT_MS_MAX = 60_000
"""The longest lock timeout a prune may set (milliseconds)."""


@attrs.frozen(kw_only=True)
class EndedTree:
    """A root actor that ended, and the actors below it."""

    root: str
    status: str  # the root's run status
    created_at: datetime
    ended_at: datetime  # when its last event was appended
    actors: tuple[str, ...]  # the whole tree, the root first
    kinds: tuple[str, ...]  # the kind of each


_ROOT = """a.kind = {kind} AND split_part(a.route, '@', 1) = $1
      AND a.run_status = ANY($2::text[])
      AND NOT EXISTS (SELECT 1 FROM toren.actors up WHERE up.actor_id = a.parent
                      AND (up.kind = {kind} OR up.kind = ANY($6::text[])))"""
"""An ended root of ``kind`` on route $1: its parent (if any) is not of ``kind`` nor of a kind
in $6 (the same test for the count boundary and the roots)."""

_TREES = """
WITH RECURSIVE boundary AS (
    -- the newest of the ended roots kept by count: older roots than it may go
    SELECT a.created_at, a.actor_id FROM toren.actors a
    WHERE {root}
    ORDER BY a.created_at DESC, a.actor_id DESC
    OFFSET greatest(coalesce($4::int, 0) - 1, 0) LIMIT 1
), roots AS (
    SELECT a.actor_id, a.run_status, a.created_at, last.created_at AS ended_at
    FROM toren.actors a
    JOIN unnest($2::text[], $3::float8[]) AS p(status, keep) ON p.status = a.run_status
    CROSS JOIN LATERAL (
        SELECT j.created_at FROM toren.journal j WHERE j.actor_id = a.actor_id
        ORDER BY j.seq DESC LIMIT 1
    ) AS last
    WHERE {root}
      AND (coalesce($4::int, 0) = 0
           OR (a.created_at, a.actor_id) < (SELECT b.created_at, b.actor_id FROM boundary b))
      -- ended before its keep ran out, so made before too: bounds the scan by the index
      AND ($7::float8 IS NULL OR a.created_at < now() - make_interval(secs => $7))
      AND (p.keep IS NOT NULL OR $4::int IS NOT NULL)
      -- a run restored into the journal (args.restored_at) counts its keep from then
      AND (p.keep IS NULL OR greatest(last.created_at, (a.args->>'restored_at')::timestamptz)
                             < now() - make_interval(secs => p.keep))
      -- after the last root of the batch before (one whose trees it could not prune)
      AND ($8::timestamptz IS NULL OR (a.created_at, a.actor_id) > ($8, $9::text))
    ORDER BY a.created_at, a.actor_id
    LIMIT $5
), tree(root, actor_id) AS (
    SELECT r.actor_id, r.actor_id FROM roots r
    UNION
    SELECT t.root, c.actor_id FROM tree t JOIN toren.actors c ON c.parent = t.actor_id
)
SELECT r.actor_id AS root, r.run_status, r.created_at, r.ended_at,
       array_agg(t.actor_id ORDER BY t.actor_id <> r.actor_id, t.actor_id) AS actors,
       array_agg(a.kind ORDER BY t.actor_id <> r.actor_id, t.actor_id) AS kinds
FROM roots r JOIN tree t ON t.root = r.actor_id JOIN toren.actors a ON a.actor_id = t.actor_id
GROUP BY r.actor_id, r.run_status, r.created_at, r.ended_at
HAVING bool_and((a.kind <> {kind} OR a.run_status = ANY($2::text[]))
                AND NOT EXISTS (SELECT 1 FROM toren.mailbox m WHERE m.actor_id = a.actor_id))
ORDER BY r.created_at, r.actor_id
"""


async def ended_trees(
    db: Db,
    *,
    kind: str,
    route: str,
    keep_for: Mapping[str, float | None],
    keep_last: int | None,
    limit: int,
    spare_under: Collection[str] = (),
    after: tuple[datetime, str] | None = None,
) -> list[EndedTree]:
    """Up to ``limit`` trees whose root may be pruned, oldest first; no lock is taken.

    A root is an actor of ``kind`` on ``route`` (its part before ``@``) whose parent is not
    of ``kind`` (nor of a kind in ``spare_under``: their runs are never pruned here), whose
    run status is a key of ``keep_for``, which ended (its last event was appended) longer ago
    than ``keep_for[status]`` seconds (``None``: no age rule) and which is not among the newest
    ``keep_last`` such roots (``None``: no count rule). A status with neither rule is never
    pruned. Every actor of its tree has ended too (a run: its status is a key of ``keep_for``)
    and has no message waiting. With ``after`` (a root's ``(created_at, root)``), only roots
    made after it.
    """
    statuses = list(keep_for)
    ages = [keep_for[s] for s in statuses]
    # Every status kept for an age: no run made since the shortest of them may go yet.
    made_before = min(a for a in ages if a is not None) if None not in ages else None
    quoted = _kind(kind)
    rows = await db.fetch(
        _TREES.format(root=_ROOT.format(kind=quoted), kind=quoted),
        route,
        statuses,
        ages,
        keep_last,
        int(limit),
        list(spare_under),
        made_before,
        after[0] if after is not None else None,
        after[1] if after is not None else None,
    )
    return [
        EndedTree(
            root=r["root"],
            status=r["run_status"],
            created_at=r["created_at"],
            ended_at=r["ended_at"],
            actors=tuple(r["actors"]),
            kinds=tuple(r["kinds"]),
        )
        for r in rows
    ]


@attrs.frozen(kw_only=True)
class Locked:
    """A row :func:`lock_trees` holds, as it is now."""

    actor_id: str
    kind: str
    run_status: str | None
    last_seq: int  # 0: no event
    mail: bool  # a message waits in its mailbox


LOCK_STATEMENT = """
SELECT a.actor_id, a.kind, a.run_status,
       coalesce((SELECT max(j.seq) FROM toren.journal j WHERE j.actor_id = a.actor_id), 0)
           AS last_seq,
       EXISTS (SELECT 1 FROM toren.mailbox m WHERE m.actor_id = a.actor_id) AS mail
FROM toren.actors a
WHERE a.actor_id = ANY($1::text[])
ORDER BY a.actor_id
FOR UPDATE OF a SKIP LOCKED
"""
"""Locks the rows of the actors asked for, skipping those another transaction holds."""


def lock_timeout_statement(milliseconds: int) -> str:
    """The ``SET LOCAL lock_timeout`` a prune's transaction starts with."""
    ms = int(milliseconds)
    if not 1 <= ms <= LOCK_TIMEOUT_MS_MAX:
        raise ValueError(f"a prune's lock timeout must be 1 to {LOCK_TIMEOUT_MS_MAX} ms")
    return f"SET LOCAL lock_timeout = '{ms}ms'"


async def lock_trees(conn: Any, ids: Sequence[str], *, lock_timeout_ms: int) -> dict[str, Locked]:
    """In ``conn``'s transaction (it must be in one): set its lock timeout, then lock the rows of
    ``ids`` that no other transaction holds; returns them by id (an id missing: skipped, or
    gone)."""
    await conn.execute(lock_timeout_statement(lock_timeout_ms))
    rows = await conn.fetch(LOCK_STATEMENT, list(ids))
    return {
        r["actor_id"]: Locked(
            actor_id=r["actor_id"],
            kind=r["kind"],
            run_status=r["run_status"],
            last_seq=r["last_seq"],
            mail=r["mail"],
        )
        for r in rows
    }


RELEASE_STATEMENT = "SELECT toren.release_permits(x.id) FROM unnest($1::text[]) AS x(id)"
"""Hands on the permits the actors hold and their places in limit queues (an ended run holds
none: it gave them back in the step that ended it)."""

DELETE_STATEMENT = """
WITH journal AS (
    DELETE FROM toren.journal WHERE actor_id = ANY($1::text[])
    RETURNING pg_column_size(data) + 40 AS size
), keys AS (
    DELETE FROM toren.dedupe WHERE actor_id = ANY($1::text[]) RETURNING 1
), windows AS (
    DELETE FROM toren.restart_windows
    WHERE key = ANY(ARRAY(SELECT 'actors/' || x FROM unnest($1::text[]) AS x)) RETURNING 1
), actors AS (
    DELETE FROM toren.actors WHERE actor_id = ANY($1::text[]) RETURNING 1
)
SELECT (SELECT count(*) FROM actors) AS actors, (SELECT count(*) FROM journal) AS events,
       (SELECT coalesce(sum(size), 0) FROM journal) AS bytes
"""
"""Deletes the actors (their mailboxes, snapshots and chunks go by cascade), their journals,
dedupe keys and restart windows."""


async def delete_trees(conn: Any, ids: Sequence[str]) -> tuple[int, int, int]:
    """In ``conn``'s transaction, holding their rows (:func:`lock_trees`): delete the actors
    ``ids`` and what is theirs; returns ``(actors, events, bytes)`` deleted (bytes: the
    journal rows' stored size, roughly)."""
    if not ids:
        return 0, 0, 0
    await conn.execute(RELEASE_STATEMENT, list(ids))
    r = await conn.fetchrow(DELETE_STATEMENT, list(ids))
    return int(r["actors"]), int(r["events"]), int(r["bytes"])


async def table_sizes(db: Db) -> dict[str, int]:
    """Bytes each table of schema ``toren`` takes, indexes and TOAST included
    (``pg_total_relation_size``), by table name."""
    rows = await db.fetch(
        "SELECT c.relname AS name, pg_total_relation_size(c.oid) AS bytes "
        "FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
        "WHERE n.nspname = 'toren' AND c.relkind IN ('r', 'p') ORDER BY c.relname"
    )
    return {r["name"]: int(r["bytes"]) for r in rows}


_GROUPS = {"arg": "a.args->>'{key}'", "day": "(a.created_at AT TIME ZONE 'UTC')::date"}

# An integer past 64 bits, as Toren's JSON text keeps it (toren/_core/json_text.py): the mark,
# "i", the digits.
_TAGGED_INT = "'^' || chr(57344) || 'i-?[0-9]+$'"


def json_integer(column: str, key: str) -> str:
    """SQL for member ``key`` of jsonb ``column`` as a ``numeric`` integer: a JSON number, or
    an integer past 64 bits as it is stored tagged; ``NULL`` for anything else. Counts a
    provider reports (tokens) are unbounded: a ``bigint`` cast of one past 2**63 failed the
    whole statement."""
    value = f"{column}->'{json_key(key)}'"
    text = f"{column}->>'{json_key(key)}'"
    return (
        f"(CASE jsonb_typeof({value}) WHEN 'number' THEN ({text})::numeric "
        f"WHEN 'string' THEN CASE WHEN length({text}) <= 1000 AND {text} ~ ({_TAGGED_INT}) "
        f"THEN substr({text}, 3)::numeric END END)"
    )


async def summary_totals(
    db: Db,
    *,
    kind: str,
    group_arg: str | None,
    by_day: bool,
    decimals: Sequence[str],
    integers: Sequence[str],
    since: datetime | None = None,
    until: datetime | None = None,
) -> list[dict[str, Any]]:
    """The actors of ``kind`` made in ``[since, until)`` counted (``actors``) and the keys of
    their summaries summed (``decimals`` as numeric, exactly; ``integers`` too, however large:
    :func:`json_integer`; a key a summary lacks counts 0), grouped by the value of their args'
    key ``group_arg`` (as ``group_key``) and by the UTC day they were made (as ``day``)."""
    keys: list[str] = []
    if group_arg is not None:
        keys.append(f"{_GROUPS['arg'].format(key=json_key(group_arg))} AS group_key")
    if by_day:
        keys.append(f"{_GROUPS['day']} AS day")
    sums = [
        f"sum(coalesce((a.summary->>'{json_key(k)}')::numeric, 0)) AS {k}" for k in decimals
    ] + [f"coalesce(sum({json_integer('a.summary', k)}), 0) AS {k}" for k in integers]
    grouped = f" GROUP BY {', '.join(str(i + 1) for i in range(len(keys)))}" if keys else ""
    sql = (
        f"SELECT {', '.join([*keys, 'count(*) AS actors', *sums])} FROM toren.actors a "
        f"WHERE a.kind = {_kind(kind)} AND ($1::timestamptz IS NULL OR a.created_at >= $1) "
        f"AND ($2::timestamptz IS NULL OR a.created_at < $2){grouped}"
    )
    return [dict(r) for r in await db.fetch(sql, since, until)]
