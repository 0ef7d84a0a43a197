"""What stays of a pruned run: its audit record (``toren.run_audit``, migration 0014).

Pruning a run (:mod:`toren.runs.prune`) deletes its actor row and journal and keeps one row:
its agent and version, its args as spawned (start digest, concurrency key, schedule slot), who
started it and how, each decision made on its calls, its receipt, how it ended and where its
journal was archived. The row is written in the transaction that deletes the run, and never
deleted: the API, the CLI and the console show a pruned run from it, the costs surface sums it
with the live runs (:mod:`toren.runs.costs`), and a start retried with the run's idempotency
key finds it (:func:`toren.runs.client.start_run`).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from datetime import datetime
from decimal import Decimal
from typing import TYPE_CHECKING, Any

import attrs

from toren._core.errors import TorenError, UnknownActor
from toren._core.json_text import safe_text
from toren.runs.receipt import Receipt

if TYPE_CHECKING:
    from toren._core.archive import ArchiveRef
    from toren._core.rows import Db

_COLUMNS = (
    "run_id, root_id, parent, agent, version, args, started_by, decisions, receipt, status, "
    "error_class, error, created_at, ended_at, pruned_at, archive, events, earlier_archives"
)


@attrs.frozen(kw_only=True)
class AuditRecord:
    """A pruned run as its audit record keeps it (one row of ``toren.run_audit``).

    Attributes:
        run_id: The run's id (``run/<uuid>``).
        root_id: The run at the top of its tree (itself for a run nobody called).
        parent: The run that started it by a cross-agent call, if one did.
        agent: Its agent; ``version`` the agent's version it last ran on.
        args: Its args as spawned: ``start`` (the digest of agent and input a retried keyed
            start is checked against), ``concurrency_key``, ``schedule`` and ``slot``...
        started_by: Who started it and how (a :class:`toren.Principal` as JSON: ``via`` is the
            surface), ``None`` in runs of versions before principals.
        decisions: Each decision on its calls: ``call_id``, ``tool``, ``approved``, ``by``
            (principal), ``who``, ``reason``, ``channel``, ``at`` (unix seconds).
        receipt: :class:`~toren.runs.receipt.Receipt`'s fields, decimals as strings.
        status: ``completed``, ``failed`` or ``cancelled``; ``error_class`` and ``error`` as
            the run ended.
        created_at: When the run's row was made; ``ended_at`` its last event; ``pruned_at``.
        archive: Where its journal was archived (``toren._core.archive.ArchiveRef``), or
            ``None``.
        events: How many events its journal held.
        earlier_archives: The ranges of its journal archived before ``archive`` while it
            went on (a long conversation truncated behind its snapshot), oldest first.
    """

    run_id: str
    root_id: str
    parent: str | None
    agent: str
    version: str
    args: Mapping[str, Any]
    started_by: Mapping[str, Any] | None
    decisions: tuple[Mapping[str, Any], ...]
    receipt: Mapping[str, Any]
    status: str
    error_class: str | None
    error: str | None
    created_at: datetime
    ended_at: datetime | None
    pruned_at: datetime | None
    archive: ArchiveRef | None
    events: int
    earlier_archives: tuple[ArchiveRef, ...] = ()

    @property
    def usd_paid(self) -> Decimal:
        """What the run itself paid (its children's own records hold theirs)."""
        return Decimal(str(self.receipt.get("usd_paid", "0")))

    def to_json(self) -> dict[str, Any]:
        """As the API shows it (times as ISO 8601 text)."""
        out = attrs.asdict(self, recurse=False)
        for key in ("created_at", "ended_at", "pruned_at"):
            out[key] = out[key].isoformat() if out[key] is not None else None
        out["args"] = dict(self.args)
        out["decisions"] = [dict(d) for d in self.decisions]
        out["receipt"] = dict(self.receipt)
        out["archive"] = self.archive_json()
        out["earlier_archives"] = [a.to_json() for a in self.earlier_archives]
        return out

    def archive_json(self) -> dict[str, Any] | None:
        """``archive`` as its ``jsonb`` column and the API hold it (``None``: not archived)."""
        return self.archive.to_json() if self.archive is not None else None


class RunPruned(UnknownActor):
    """The run was pruned: its journal and row are gone, its audit record stays (read it with
    :func:`audit_record`; ``toren jobs show RUN``). A kind of :class:`~toren.UnknownActor`, so
    that code that handles a missing run handles it too."""

    def __init__(self, run_id: str, pruned_at: datetime | None) -> None:
        self.actor_id = run_id
        self.pruned_at = pruned_at
        when = pruned_at.date().isoformat() if pruned_at is not None else "an earlier date"
        # Its own message, not UnknownActor's ("spawn it first"): the run existed.
        TorenError.__init__(
            self,
            f"run {run_id} was pruned on {when}: its journal is gone and it takes nothing "
            f"more; its audit record remains (toren jobs show {run_id})",
        )


def archive_ref(value: Any) -> ArchiveRef | None:
    """The archive reference a record stores, as an ``ArchiveRef`` (``None`` for none)."""
    return archive_refs([value])[0] if value is not None else None


def archive_refs(values: Sequence[Any] | None) -> tuple[ArchiveRef, ...]:
    """The archive references a record stores (``earlier_archives``), as ``ArchiveRef``s."""
    if not values:
        return ()
    # Here, not at the top: the archive's module brings the object stores (aioboto3), which
    # a client that only starts runs never needs.
    from toren._core.archive import ArchiveRef

    return tuple(ArchiveRef.from_json(v) for v in values)


def _record(r: Any) -> AuditRecord:
    return AuditRecord(
        run_id=r["run_id"],
        root_id=r["root_id"],
        parent=r["parent"],
        agent=r["agent"],
        version=r["version"],
        args=r["args"] or {},
        started_by=r["started_by"],
        decisions=tuple(r["decisions"] or ()),
        receipt=r["receipt"] or {},
        status=r["status"],
        error_class=r["error_class"],
        error=r["error"],
        created_at=r["created_at"],
        ended_at=r["ended_at"],
        pruned_at=r["pruned_at"],
        archive=archive_ref(r["archive"]),
        events=r["events"],
        earlier_archives=archive_refs(r["earlier_archives"]),
    )


async def audit_record(db: Db, run_id: str) -> AuditRecord | None:
    """The audit record of pruned run ``run_id`` (``None``: it was not pruned)."""
    r = await db.fetchrow(f"SELECT {_COLUMNS} FROM toren.run_audit WHERE run_id = $1", run_id)
    return _record(r) if r is not None else None


async def audit_records(db: Db, run_ids: Collection[str]) -> dict[str, AuditRecord]:
    """The audit records of those of ``run_ids`` that were pruned, by run id."""
    rows = await db.fetch(
        f"SELECT {_COLUMNS} FROM toren.run_audit WHERE run_id = ANY($1::text[])", list(run_ids)
    )
    return {r["run_id"]: _record(r) for r in rows}


async def unknown_run(db: Db, run_id: str) -> UnknownActor:
    """The error for a run that has no row: :class:`RunPruned` if it was pruned, else
    :class:`~toren.UnknownActor` (raise it)."""
    pruned = await db.fetchval("SELECT pruned_at FROM toren.run_audit WHERE run_id = $1", run_id)
    return RunPruned(run_id, pruned) if pruned is not None else UnknownActor(run_id)


def receipt_json(receipt: Receipt) -> dict[str, Any]:
    """A receipt as an audit record keeps it: every field, decimals as strings (exact)."""
    return {
        k: str(v) if isinstance(v, Decimal) else v for k, v in attrs.asdict(receipt).items()
    } | {"usd_total": str(receipt.usd_total)}


_INSERTED = _COLUMNS.replace(" pruned_at,", "")

_INSERT = f"""
INSERT INTO toren.run_audit ({_INSERTED})
VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16, $17)
ON CONFLICT (run_id) DO NOTHING
"""


def _text(value: str | None) -> str | None:
    """A text column's value: NUL and lone surrogates (an error's text may hold them) escaped
    readably (jsonb columns keep them exactly)."""
    return safe_text(value) if value is not None else None


async def insert_audit(conn: Any, records: Sequence[AuditRecord]) -> None:
    """Write ``records`` (in the caller's transaction; ``pruned_at`` is its time); a run
    recorded already keeps its first record (a batch retried after a kill writes nothing
    twice). One pipelined statement per record."""
    rows = [
        (
            r.run_id,
            r.root_id,
            r.parent,
            _text(r.agent),
            _text(r.version),
            dict(r.args),
            dict(r.started_by) if r.started_by is not None else None,
            [dict(d) for d in r.decisions],
            dict(r.receipt),
            r.status,
            _text(r.error_class),
            _text(r.error),
            r.created_at,
            r.ended_at,
            r.archive_json(),
            r.events,
            [a.to_json() for a in r.earlier_archives],
        )
        for r in records
    ]
    if rows:
        await conn.executemany(_INSERT, rows)


_LOG = """
WITH old AS (  -- the log keeps a month: it is what /metrics and --stats show, not an archive
    DELETE FROM toren.prune_log WHERE at < now() - interval '30 days'
)
INSERT INTO toren.prune_log (agent, runs, events, bytes, archived, skipped, took)
VALUES ($1, $2, $3, $4, $5, $6, $7)
"""


async def log_prune(
    conn: Any,
    agent: str,
    *,
    runs: int,
    events: int,
    bytes: int,
    archived: int,
    skipped: int,
    took: float,
) -> None:
    """Record what one batch removed (``/metrics`` and ``toren jobs prune --stats`` read it)."""
    await conn.execute(_LOG, agent, runs, events, bytes, archived, skipped, took)


async def last_prunes(db: Db) -> list[dict[str, Any]]:
    """The last batch that removed something, per agent."""
    rows = await db.fetch(
        "SELECT DISTINCT ON (agent) agent, at, runs, events, bytes, archived, skipped, took "
        "FROM toren.prune_log ORDER BY agent, id DESC"
    )
    return [dict(r) for r in rows]


class PrunedStart(Exception):  # a signal between two functions, never shown
    """A keyed start found its run pruned (its transaction is rolled back: see
    :func:`toren.runs.client.start_run`)."""

    def __init__(self, record: AuditRecord) -> None:
        super().__init__(record.run_id)
        self.record = record


async def refuse_pruned(conn: Any, run_ids: Sequence[str], agent: str) -> None:
    """In a keyed start's transaction, after it inserted the key's run: raise
    :class:`PrunedStart` if a run of ``agent`` under one of ``run_ids`` was pruned. Read after
    the insert, so that a prune deleting the run concurrently is waited for (the insert waits on
    its row) and its record seen (read committed: a new snapshot per statement).

    Raises:
        PrunedStart: it was.
    """
    r = await conn.fetchrow(
        f"SELECT {_COLUMNS} FROM toren.run_audit WHERE run_id = ANY($1::text[]) AND agent = $2 "
        "LIMIT 1",
        list(run_ids),
        agent,
    )
    if r is not None:
        raise PrunedStart(_record(r))
