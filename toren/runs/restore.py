"""Pruned runs brought back from their archive.

A run pruned with ``Retention(archive=True)`` keeps an audit record (:mod:`toren.runs.audit`)
naming its journal's archive (:class:`toren._core.archive.ArchiveRef`). :func:`restored_run`
reads that archive, checked (:func:`toren._core.archive.read_archive`), and folds it with the
run's own fold: the state, timeline and receipt the run had before it was pruned, read-only
(``toren jobs restore RUN``). :func:`restore_into_journal` writes the archived events back as
the run's journal, with its actor row, as a live run that has ended (``toren jobs restore RUN
--into-journal``): then it can be forked, shown and listed as before it was pruned. Its audit
record stays (it is never deleted).

Errors::

    TorenError
    └── NotRestorable   the run was not pruned, was pruned without an archive, is in the
                        database already, or its archive does not hold its whole journal
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from toren._agent.routes import agent_route, version_route
from toren._core.archive import ArchiveRef, read_archive, restore_journal
from toren._core.codec import decode
from toren._core.errors import TorenError
from toren.runs._fold import fold
from toren.runs.events import RUN_KIND
from toren.runs.state import RunState, summary

if TYPE_CHECKING:
    from toren._core.client import Client
    from toren._core.journal import JournalEntry
    from toren._core.stores import ObjectStore


class NotRestorable(TorenError):
    """A run cannot be restored from an archive; the message says why and what to do."""

    def __init__(self, run_id: str, why: str, hint: str) -> None:
        self.run_id = run_id
        self.why = why
        self.hint = hint
        super().__init__(f"run {run_id} cannot be restored: {why}. {hint}")


async def _archived(client: Client, run_id: str) -> tuple[Any, ArchiveRef]:
    """Run ``run_id``'s audit record and its archive's reference.

    Raises:
        NotRestorable: it was not pruned, or pruned without an archive.
    """
    # The audit record is the run kind's (toren/runs/audit.py); named, not imported, so that
    # this module reads records as that one writes them.
    audit = importlib.import_module("toren.runs.audit")
    record = await audit.audit_record(client.pool, run_id)
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
    if not isinstance(ref, ArchiveRef):
        ref = ArchiveRef.from_json(ref)
    return record, ref


async def restored_run(
    client: Client, run_id: str, *, store: ObjectStore
) -> tuple[RunState, list[JournalEntry]]:
    """Pruned run ``run_id`` as its archive in ``store`` holds it: its state, folded from the
    archived events by the run's fold, and those events (read-only: nothing is written).

    Raises:
        NotRestorable: see :func:`_archived`; or the archive does not start at the journal's
            first event.
        CorruptArchive: the archive does not match its record (see
            :func:`toren._core.archive.read_archive`); ``MissingArchive`` if it is gone.
        StoreError, ConfigError: the store's own.
    """
    _, ref = await _archived(client, run_id)
    if ref.first_seq != 1:
        raise NotRestorable(
            run_id,
            f"its archive {ref.location} holds events {ref.first_seq}-{ref.last_seq} only, "
            "not its journal from its first event",
            "Earlier events were archived apart (a truncated conversation): restore reads "
            "whole journals only.",
        )
    events = await read_archive(store, ref, actor_id=run_id)
    state = RunState()
    for entry in events:
        state = fold(state, decode(entry.type, entry.data))
    return state, events


async def restore_into_journal(client: Client, run_id: str, *, store: ObjectStore) -> RunState:
    """Write pruned run ``run_id`` back from its archive in ``store``: its actor row (its
    agent's route, its args and parent as its audit record keeps them, its summary as its
    fold gives it) and its journal, with their seqs and times, in one transaction. The run is
    live and ended as it was (completed, failed or cancelled): it can be shown, forked, and
    sent a message as before it was pruned; nothing runs until it gets mail. Its audit record
    stays.

    Raises:
        NotRestorable: see :func:`restored_run`; or the run is in the database already
            (restored before).
        CorruptArchive, StoreError, ConfigError: as :func:`restored_run`.
    """
    record, _ = await _archived(client, run_id)
    state, events = await restored_run(client, run_id, store=store)  # no transaction open
    route = version_route(record.agent, record.version) if record.version else None
    async with client.pool.acquire() as conn, conn.transaction():
        created = await client.spawn(
            RUN_KIND,
            run_id,
            dict(record.args),
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
    return state
