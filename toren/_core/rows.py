"""The actors' rows as the layers above read and write them: the kernel's own queries on
``toren.actors`` and ``toren.mailbox``, generic over kinds.

Nothing outside the kernel holds SQL on the kernel's tables (``tests/test_floors.py``): a kind
names what it wants (its kind's name, the keys of ``args`` and ``summary`` it reads, the kind of
message it looks for) and the kernel writes the statement. What a kind keeps in ``args`` and
``summary`` is its own; the kernel only reads keys out of them.

A row always carries its small columns (id, kind, route, parent, status, run status, creation
time); the large ones (``args``, ``summary``, ``failure``) only when asked for by ``fields``:
``"args"`` (all of it), ``"args.agent"`` (only that key: the row's ``args`` is then
``{"agent": ...}``, ``None`` for a key it lacks), and so on. A statement is made for each
combination of what is asked, so each is planned for the index it can use; kinds are written
into it as literals, since the partial indexes of runs name theirs.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Iterable, Mapping
from datetime import datetime
from typing import TYPE_CHECKING, Any, Literal, TypeAlias

import asyncpg
import attrs

if TYPE_CHECKING:
    from asyncpg.pool import PoolConnectionProxy

    Db: TypeAlias = asyncpg.Connection | asyncpg.Pool | PoolConnectionProxy[Any]

_SMALL = "a.actor_id, a.kind, a.route, a.parent, a.status, a.run_status, a.created_at"
_LARGE = ("args", "summary", "failure")
_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,62}")
_KIND = re.compile(r"[A-Za-z0-9_.:/-]{1,200}")


@attrs.frozen(kw_only=True)
class ActorRow:
    """An actor's row: what it is, where it runs, whether it is live, and (when asked for) its
    arguments, its summary and why it failed."""

    actor_id: str
    kind: str
    route: str | None
    parent: str | None
    status: str  # live, failed (the kernel gave up on it), stopped
    run_status: str | None  # of a run: its summary's status, ``running`` until it has one
    created_at: datetime
    args: Any = None  # as spawned (or only the keys asked for)
    summary: Any = None  # what its last step recorded (or only the keys asked for)
    failure: str | None = None
    mail_waiting: bool | None = None  # when asked: whether a message of a given kind waits

    @property
    def args_dict(self) -> Mapping[str, Any]:
        """``args`` as a mapping (empty when it is not one)."""
        return self.args if isinstance(self.args, dict) else {}

    @property
    def summary_dict(self) -> Mapping[str, Any]:
        """``summary`` as a mapping (empty when it has none)."""
        return self.summary if isinstance(self.summary, dict) else {}


def json_key(key: str) -> str:
    """``key`` if it is a plain name (it is written into a statement).

    Raises:
        ValueError: it is not.
    """
    if not _KEY.fullmatch(key):
        raise ValueError(f"not a key the kernel reads: {key!r}")
    return key


def _kind(kind: str) -> str:
    """``kind`` as a literal of the statement (a name of letters, digits and ``._:/-``)."""
    if not _KIND.fullmatch(kind):
        raise ValueError(f"not a kind's name: {kind!r}")
    return f"'{kind}'"


def columns(fields: Iterable[str]) -> str:
    """The select list for ``fields`` (see the module's docstring).

    Raises:
        ValueError: a field is not ``args``, ``summary``, ``failure`` or a key of the first two.
    """
    whole: set[str] = set()
    keys: dict[str, list[str]] = {}
    for field in fields:
        column, dot, key = field.partition(".")
        if column not in _LARGE or (dot and column == "failure"):
            raise ValueError(f"not a field of an actor's row: {field!r}")
        if dot:
            keys.setdefault(column, []).append(json_key(key))
        else:
            whole.add(column)
    out = [_SMALL]
    for column in _LARGE:
        if column in whole:
            out.append(f"a.{column}")
        elif column in keys:
            pairs = ", ".join(f"'{k}', a.{column}->'{k}'" for k in keys[column])
            out.append(f"jsonb_build_object({pairs}) AS {column}")
    return ", ".join(out)


def row(r: asyncpg.Record) -> ActorRow:
    """The :class:`ActorRow` of a record selected by :func:`columns`."""
    found = set(r.keys())
    return ActorRow(
        actor_id=r["actor_id"],
        kind=r["kind"],
        route=r["route"],
        parent=r["parent"],
        status=r["status"],
        run_status=r["run_status"],
        created_at=r["created_at"],
        **{c: r[c] for c in _LARGE if c in found},
        mail_waiting=r["mail_waiting"] if "mail_waiting" in found else None,
    )


async def actor_row(
    db: Db,
    actor_id: str,
    *,
    kind: str | None = None,
    fields: Iterable[str] = (),
    lock: bool = False,
    keep: bool = False,
) -> ActorRow | None:
    """Actor ``actor_id``'s row, or ``None`` if there is none (or it is not of ``kind``).
    With ``lock``, the row is locked for update until ``db``'s transaction ends (so that
    checks of its ``args`` and their change serialize). With ``keep``, it is locked ``FOR KEY
    SHARE``: it is not deleted before the transaction ends (a prune skips it) and the actor's
    steps, which update it, are not held up."""
    sql = f"SELECT {columns(fields)} FROM toren.actors a WHERE a.actor_id = $1"
    if kind is not None:
        sql += f" AND a.kind = {_kind(kind)}"
    if lock:
        sql += " FOR UPDATE"
    elif keep:
        sql += " FOR KEY SHARE"
    found = await db.fetchrow(sql, actor_id)
    return row(found) if found is not None else None


async def actor_rows(db: Db, ids: Collection[str], *, fields: Iterable[str] = ()) -> list[ActorRow]:
    """The rows of those of ``ids`` that exist, by id, in one query."""
    if not ids:
        return []
    sql = (
        f"SELECT {columns(fields)} FROM toren.actors a "
        "WHERE a.actor_id = ANY($1::text[]) ORDER BY a.actor_id"
    )
    return [row(r) for r in await db.fetch(sql, list(ids))]


Order: TypeAlias = Literal["newest", "oldest", "id"]
_ORDERS: dict[str, str] = {
    "newest": "a.created_at DESC, a.actor_id DESC",
    "oldest": "a.created_at, a.actor_id",
    "id": "a.actor_id",
}


async def actors_of_kind(
    db: Db,
    kind: str,
    *,
    fields: Iterable[str] = (),
    run_status: str | None = None,
    route: str | None = None,
    args: Mapping[str, str] | None = None,
    summary_not: Mapping[str, str] | None = None,
    since: datetime | None = None,
    before: tuple[datetime, str] | None = None,
    order: Order = "newest",
    limit: int | None = None,
) -> list[ActorRow]:
    """The actors of ``kind``, in ``order`` (newest first, oldest first, or by id).

    Only those whose run status is ``run_status``, whose route is ``route`` (or ``route@...``:
    an agent's route pinned to a version), whose ``args``
    hold each of ``args``'s keys with that (text) value, whose ``summary`` does not hold
    ``summary_not``'s values (a key it lacks is not one), created after ``since``, or, a
    keyset page, before ``before`` (the ``(created_at, actor_id)`` of the previous page's
    last row; for the newest first). One statement per combination of filters: each is
    planned for the index it can use (runs by status, by route), the page's start included.

    Raises:
        ValueError: an unknown ``order``, or ``before`` with another order than ``newest``;
            a kind's name or a key that is not a plain name.
    """
    if order not in _ORDERS:
        raise ValueError(f"order must be one of {', '.join(_ORDERS)}, not {order!r}")
    if before is not None and order != "newest":
        raise ValueError("before pages the newest first only (order='newest')")
    where, values = [f"a.kind = {_kind(kind)}"], []

    def value(v: Any) -> str:
        values.append(v)
        return f"${len(values)}"

    if run_status is not None:
        where.append(f"a.run_status = {value(run_status)}")
    if route is not None:
        # Its versions too: an agent's runs pinned to a version are routed NAME@VERSION (the
        # index actors_runs_by_route is on this expression).
        where.append(f"split_part(a.route, '@', 1) = {value(route)}")
    for key, wanted in (args or {}).items():
        where.append(f"a.args->>'{json_key(key)}' = {value(wanted)}")
    for key, unwanted in (summary_not or {}).items():
        where.append(f"a.summary->>'{json_key(key)}' IS DISTINCT FROM {value(unwanted)}")
    if since is not None:
        where.append(f"a.created_at > {value(since)}::timestamptz")
    if before is not None:
        where.append(
            f"(a.created_at, a.actor_id) < ({value(before[0])}::timestamptz, {value(before[1])})"
        )
    sql = (
        f"SELECT {columns(fields)} FROM toren.actors a WHERE {' AND '.join(where)} "
        f"ORDER BY {_ORDERS[order]}"
    )
    if limit is not None:
        sql += f" LIMIT {value(limit)}"
    return [row(r) for r in await db.fetch(sql, *values)]


async def actors_in_range(
    db: Db, lowest: str, highest: str, *, kind: str, prefix: str, fields: Iterable[str], limit: int
) -> list[ActorRow]:
    """The actors of ``kind`` whose id starts with ``prefix``, found between ``lowest`` and
    ``highest`` (every id with the prefix must lie between them), by id: one range of the
    primary key's btree, whatever the number of actors."""
    sql = (
        f"SELECT {columns(fields)} FROM toren.actors a "
        f"WHERE a.actor_id BETWEEN $1 AND $2 AND a.kind = {_kind(kind)} "
        f"AND starts_with(a.actor_id, $3) ORDER BY a.actor_id LIMIT {int(limit)}"
    )
    return [row(r) for r in await db.fetch(sql, lowest, highest, prefix)]


async def descendants(
    db: Db,
    root: str,
    *,
    kind: str,
    via: str = "children",
    fields: Iterable[str] = (),
    max_depth: int = 64,
    limit: int = 1000,
) -> list[tuple[ActorRow, int]]:
    """The actors of ``kind`` below ``root``, each with its depth, nearest first: those whose
    ids ``root``'s summary lists under ``via`` (depth 1), those theirs lists, and so on, to
    ``max_depth``; at most ``limit``. One recursive query; a summary without such a list (or
    not of ``kind``) ends its branch, and a cycle ends at ``max_depth``."""
    below = f"""
WITH RECURSIVE below(actor_id, depth) AS (
    SELECT c.id, 1
    FROM toren.actors p, jsonb_array_elements_text(CASE
        WHEN jsonb_typeof(p.summary->'{json_key(via)}') = 'array' THEN p.summary->'{via}'
        ELSE '[]' END) AS c(id)
    WHERE p.actor_id = $1 AND p.kind = $2
    UNION
    SELECT c.id, b.depth + 1
    FROM below b JOIN toren.actors a ON a.actor_id = b.actor_id AND a.kind = $2,
         jsonb_array_elements_text(CASE
            WHEN jsonb_typeof(a.summary->'{via}') = 'array' THEN a.summary->'{via}'
            ELSE '[]' END) AS c(id)
    WHERE b.depth < $3
)
SELECT {columns(fields)}, min(b.depth) AS depth
FROM below b JOIN toren.actors a ON a.actor_id = b.actor_id AND a.kind = $2
GROUP BY a.actor_id
ORDER BY depth, a.created_at
LIMIT $4
"""
    rows = await db.fetch(below, root, kind, max_depth, limit)
    return [(row(r), r["depth"]) for r in rows]


async def queued(db: Db, ids: Collection[str], message_kind: str) -> set[str]:
    """Those of ``ids`` with a message of ``message_kind`` in their mailbox (delivered or
    delayed, not yet handled)."""
    if not ids:
        return set()
    rows = await db.fetch(
        "SELECT DISTINCT actor_id FROM toren.mailbox WHERE actor_id = ANY($1::text[]) "
        "AND kind = $2",
        list(ids),
        message_kind,
    )
    return {r["actor_id"] for r in rows}


async def set_args(db: Db, actor_id: str, args: Mapping[str, Any]) -> bool:
    """Replace actor ``actor_id``'s arguments by ``args``; whether they changed (``False``: the
    same already, or no such actor)."""
    done = await db.execute(
        "UPDATE toren.actors SET args = $2 WHERE actor_id = $1 AND args <> $2", actor_id, args
    )
    return str(done) != "UPDATE 0"


async def revive(db: Db, actor_id: str, *, kind: str) -> bool:
    """Make actor ``actor_id`` of ``kind``, which the kernel gave up on, live again (its
    failure forgotten); whether it was failed. Its restart window is its supervisor's (see
    :func:`toren._core.restarts.forget_restarts`)."""
    done = await db.execute(
        "UPDATE toren.actors SET status = 'live', failure = NULL "
        "WHERE actor_id = $1 AND kind = $2 AND status = 'failed'",
        actor_id,
        kind,
    )
    return str(done) != "UPDATE 0"


async def count_by_route(db: Db, kind: str, *, run_statuses: Collection[str]) -> dict[str, int]:
    """How many actors of ``kind`` whose run status is one of ``run_statuses`` each route has
    (routes with none are left out; so are actors without a route). One statement: for runs,
    it reads the index by status (``actors_runs_by_status``), so its cost follows the number of
    runs in those statuses, not all runs."""
    rows = await db.fetch(
        f"SELECT a.route, count(*) AS n FROM toren.actors a WHERE a.kind = {_kind(kind)} "
        "AND a.run_status = ANY($1::text[]) AND a.route IS NOT NULL GROUP BY a.route",
        list(run_statuses),
    )
    return {r["route"]: r["n"] for r in rows}


async def run_status_counts(db: Db) -> dict[str, int]:
    """How many runs have each run status (kept as runs change status: a few rows read,
    however many runs; see migration 0006)."""
    rows = await db.fetch("SELECT status, n FROM toren.run_status_counts")
    return {r["status"]: r["n"] for r in rows}


async def set_route(
    db: Db, actor_id: str, route: str, *, args: Mapping[str, Any] | None = None
) -> bool:
    """Give actor ``actor_id`` ``route`` (joins ``db``'s transaction, if in one): only workers
    serving it claim the actor from then on. A worker holding it keeps it until it lets it go.
    ``args`` are merged into the actor's arguments (key by key) in the same statement.

    Returns:
        Whether the actor exists.
    """
    found: str | None = await db.fetchval(
        "UPDATE toren.actors SET route = $2, args = coalesce(args, '{}'::jsonb) || $3::jsonb "
        "WHERE actor_id = $1 RETURNING actor_id",
        actor_id,
        route,
        dict(args or {}),
    )
    return found is not None
