"""Pruned runs brought back from their archive.

A run pruned with ``Retention(archive=True)`` keeps an audit record (:mod:`toren.runs.audit`)
naming its journal's archive (:class:`toren._core.archive.ArchiveRef`). :func:`restored_run`
reads that archive, checked (:func:`toren._core.archive.read_archive`), and folds it with the
run's own fold: the state, timeline and receipt the run had before it was pruned, read-only
(``toren jobs restore RUN``). :func:`restore_into_journal` writes the archived events back as
the run's journal, with its actor row, as a live run that has ended (``toren jobs restore RUN
--into-journal``): then it can be forked, shown and listed as before it was pruned. That undoes
the prune: in the same transaction its audit record is deleted, since its journal is its
record again (kept, the run would count twice in the costs, and a prune of it after it went
on would keep the old record and its shorter archive). A later prune writes a new record and
archives the journal again (the archive of the same events is the same object).

Errors::

    TorenError
    └── NotRestorable   the run was not pruned, was pruned without an archive, is in the
                        database already, or its archive does not hold its whole journal
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import TYPE_CHECKING

from toren._agent.routes import agent_route, version_route
from toren._core.archive import ArchiveRef, read_archive, restore_journal
from toren._core.codec import decode
from toren._core.errors import TorenError
from toren.runs._fold import fold
from toren.runs.audit import AuditRecord, audit_record
from toren.runs.events import RUN_KIND
from toren.runs.state import RunState, summary

if TYPE_CHECKING:
    from toren._core.client import Client
    from toren._core.journal import JournalEntry
    from toren._core.stores import ObjectStore


# The audit record of a run restored into the journal (toren/runs/audit.py's table).
_UNPRUNED = "DELETE FROM toren.run_audit WHERE run_id = $1"


class NotRestorable(TorenError):
    """A run cannot be restored from an archive; the message says why and what to do."""

    def __init__(self, run_id: str, why: str, hint: str) -> None:
        self.run_id = run_id
        self.why = why
        self.hint = hint
        super().__init__(f"run {run_id} cannot be restored: {why}. {hint}")


async def archive_of(client: Client, run_id: str) -> tuple[AuditRecord, tuple[ArchiveRef, ...]]:
    """Pruned run ``run_id``'s audit record (its ``agent``, ``pruned_at``...) and the
    references of its archives, oldest first: the ranges archived as it went (a long
    conversation truncated behind its snapshot), then the rest, archived when it was pruned.

    Raises:
        NotRestorable: it was not pruned, or pruned without an archive.
    """
    record = await audit_record(client.pool, run_id)
    if record is None:
        raise NotRestorable(
            run_id,
            "it was not pruned (no audit record)",
            f"A run that was not pruned is shown by `toren jobs show {run_id}`.",
        )
    ref = record.archive
    if ref is None:
        when = record.pruned_at.date().isoformat() if record.pruned_at else "an earlier date"
        raise NotRestorable(
            run_id,
            f"it was pruned on {when} without an archive (its agent's retention has "
            "archive = false)",
            f"Its audit record remains: `toren jobs show {run_id}`.",
        )
    return record, (*record.earlier_archives, ref)


async def restored_run(
    client: Client, run_id: str, *, store: ObjectStore
) -> tuple[RunState, list[JournalEntry]]:
    """Pruned run ``run_id`` as its archives in ``store`` hold it: its state, folded from the
    archived events by the run's fold, and those events (read-only: nothing is written).

    Raises:
        NotRestorable: see :func:`archive_of`; or its archives do not hold its journal from
            its first event without a gap.
        CorruptArchive: an archive does not match its record (see
            :func:`toren._core.archive.read_archive`); ``MissingArchive`` if one is gone.
        StoreError, ConfigError: the store's own.
    """
    _, refs = await archive_of(client, run_id)
    expected = 1
    for ref in refs:
        if ref.events and ref.first_seq != expected:
            raise NotRestorable(
                run_id,
                f"its archive {ref.location} holds events {ref.first_seq}-{ref.last_seq}, "
                f"not from event {expected} on",
                "Its archives do not hold its whole journal: restore reads whole journals only.",
            )
        expected = max(expected, ref.last_seq + 1)
    events = [e for ref in refs for e in await read_archive(store, ref, actor_id=run_id)]
    state = RunState()
    for entry in events:
        state = fold(state, decode(entry.type, entry.data))
    return state, events


async def restore_into_journal(client: Client, run_id: str, *, store: ObjectStore) -> RunState:
    """Write pruned run ``run_id`` back from its archive in ``store``: its actor row (its
    agent's route, its args and parent as its audit record keeps them, its summary as its
    fold gives it) and its journal, with their seqs and times, and delete its audit record,
    in one transaction. The run is live and ended as it was (completed, failed or cancelled):
    it can be shown, forked, and sent a message as before it was pruned; nothing runs until it
    gets mail. Its archive object stays in the store.

    Raises:
        NotRestorable: see :func:`restored_run`; or the run is in the database already
            (restored before).
        CorruptArchive, StoreError, ConfigError: as :func:`restored_run`.
    """
    record, _ = await archive_of(client, run_id)
    state, events = await restored_run(client, run_id, store=store)  # no transaction open
    route = version_route(record.agent, record.version) if record.version else None
    async with client.pool.acquire() as conn, conn.transaction():
        created = await client.spawn(
            RUN_KIND,
            run_id,
            # its keep_for counts from now: a run restored to be forked is not pruned again
            # before it can be
            {**record.args, "restored_at": datetime.now(UTC).isoformat()},
            parent=record.parent,
            route=route or agent_route(record.agent),
            conn=conn,
        )
        if not created:
            raise NotRestorable(
                run_id,
                "it is in the database already (restored before)",
                f"Show it with `toren jobs show {run_id}`.",
            )
        await restore_journal(
            conn, run_id, events, summary=summary(state), created_at=record.created_at
        )
        await conn.execute(_UNPRUNED, run_id)
    return state
