"""Pruning an agent's ended runs, one batch at a time (issue 32).

A batch (:func:`prune_batch`, what the pruner actor and ``toren jobs prune`` run):

1. selects up to ``batch`` trees (:func:`toren._core.pruning.ended_trees`: a root run that
   ended, every run below it ended, no message waiting for any, past the agent's
   :class:`~toren.Retention`), taking no lock;
2. reads what each run's audit record keeps (its state folded, its start and decisions) and,
   with ``archive``, writes its journal to the archive store and reads it back
   (``toren._core.archive.archive_journal``), still taking no lock;
3. in one short transaction, under ``SET LOCAL lock_timeout`` (``lock_timeout``, 200 ms by
   default), locks the trees' rows ``FOR UPDATE SKIP LOCKED``, checks each again (every row
   locked, still ended, no mail, its journal's last event the one read in 2, so the archive
   and the record cover it all), writes the audit records, deletes the trees and logs the
   batch. A tree that fails a check is left whole for a later batch.

Every step may be killed: nothing is deleted before 3 commits, and 3 is one transaction. A
batch run again selects again, archives again (the same key: the same object) and writes no
audit record twice (``ON CONFLICT DO NOTHING``). So a batch is idempotent and the pruner
resumable. A batch cut short after 2 whose run then went on (a message, a retry) before the
next leaves an archive of the run's shorter journal that nothing names: the batch that prunes
the run deletes it after its commit (``toren._core.archive.drop_shorter``, one listing of the
run's folder in the store).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from datetime import datetime
from typing import Any

import asyncpg
import attrs

from toren._agent.retention import Retention
from toren._agent.routes import agent_route
from toren._core.archive import ArchiveRef, archive_journal, drop_shorter, read_archive
from toren._core.errors import ConfigError, TorenError
from toren._core.journal import JournalEntry, ReplayFailed, replay
from toren._core.journal_reads import events, last_seq
from toren._core.killpoints import kill_point
from toren._core.pruning import EndedTree, delete_trees, ended_trees, lock_trees
from toren._core.rows import actor_rows
from toren._core.truncation import Archives
from toren._core.truncation import archived as archived_ranges
from toren.runs.audit import AuditRecord, insert_audit, log_prune, receipt_json
from toren.runs.events import ENDED, RUN_KIND
from toren.runs.receipt import receipt
from toren.runs.state import SNAPSHOT_VERSION, RunState, fold

log = logging.getLogger("toren.retention")

PRUNE_BATCH = 100
"""Trees (a root run and the runs below it) one batch prunes at most, by default."""

PRUNE_LOCK_TIMEOUT = 0.2
"""Seconds a batch's transaction waits for a lock at most, by default (its rows are taken
``SKIP LOCKED``: it waits for none of them)."""

SPARE_UNDER = ("toren.channel",)
"""Runs started by actors of these kinds are never pruned by age or count: a chat's run goes on
with the chat's next message (bounded by ``conversation_keep_for`` instead)."""


@attrs.frozen(kw_only=True)
class PruneResult:
    """What one batch did (or, dry, would do).

    Attributes:
        agent: The agent whose runs it pruned.
        runs: Runs pruned (roots and the runs below them); dry: that would be.
        trees: The roots of the trees pruned (dry: that would be).
        events: Journal rows deleted; ``bytes`` their stored size (roughly).
        archived: Runs whose journal was archived first.
        skipped: Trees found but left for a later batch (a row held by a step, a run that
            changed since it was read, no archive store where one is needed).
        took: Seconds the batch took.
        held: Seconds its deleting transaction (step 3) took, from taking a connection to
            its commit (0: none ran).
        dry_run: Nothing was deleted.
        found: Trees selected (``batch`` of them: there may be more).
        last: The last tree selected, as ``(created_at, root)``: the ``after`` of a next batch
            that goes past the trees this one left (a journal not folded here can be left for
            good: a batch from the oldest again would select it again).
    """

    agent: str
    runs: int = 0
    trees: tuple[str, ...] = ()
    events: int = 0
    bytes: int = 0
    archived: int = 0
    skipped: int = 0
    took: float = 0.0
    held: float = 0.0
    dry_run: bool = False
    found: int = 0
    last: tuple[datetime, str] | None = None


@attrs.frozen(kw_only=True)
class _Read:
    """A run of a tree as step 2 read it."""

    run_id: str
    last_seq: int
    record: AuditRecord | None  # None: not a run (a sandbox): nothing is kept of it


def keep_for(retention: Retention) -> dict[str, float | None]:
    """Seconds each ended status is kept after the end (``None``: no age rule for it)."""
    return {status: retention.age_limit(status) for status in ENDED}


async def candidates(
    pool: asyncpg.Pool,
    agent: str,
    retention: Retention,
    *,
    batch: int = PRUNE_BATCH,
    after: tuple[datetime, str] | None = None,
) -> list[EndedTree]:
    """The trees a batch for ``agent`` would prune now, oldest first (after ``after``, a
    root's ``(created_at, root)``, if given; no lock taken)."""
    if not retention.prunes_runs:
        return []
    return await ended_trees(
        pool,
        kind=RUN_KIND,
        route=agent_route(agent),
        keep_for=keep_for(retention),
        keep_last=retention.keep_last,
        limit=batch,
        spare_under=SPARE_UNDER,
        after=after,
    )


async def prune_batch(
    pool: asyncpg.Pool,
    agent: str,
    retention: Retention,
    *,
    batch: int = PRUNE_BATCH,
    lock_timeout: float = PRUNE_LOCK_TIMEOUT,
    store: Any = None,
    dry_run: bool = False,
    after: tuple[datetime, str] | None = None,
) -> PruneResult:
    """Prune one batch of ``agent``'s ended runs under ``retention`` (see the module).

    Args:
        pool: The database.
        agent: The agent whose runs are pruned.
        retention: Its policy.
        batch: Trees at most.
        lock_timeout: Seconds the deleting transaction waits for a lock at most.
        store: The archive store (an ``ObjectStore``), needed when ``retention.archive``.
        dry_run: Only say what would go.
        after: Only trees whose root was made after this ``(created_at, root)`` (the ``last``
            of the batch before).

    Raises:
        ConfigError: ``batch`` or ``lock_timeout`` is out of range.
    """
    if not 1 <= batch <= 10_000:
        raise ConfigError(f"prune_batch must be 1 to 10000 runs, not {batch}")
    if not 0.001 <= lock_timeout <= 60:
        raise ConfigError(f"prune_lock_timeout must be from 1ms to 60s, not {lock_timeout}s")
    started = time.monotonic()
    trees = await candidates(pool, agent, retention, batch=batch, after=after)
    if dry_run:
        runs = sum(k == RUN_KIND for t in trees for k in t.kinds)
        return PruneResult(agent=agent, runs=runs, trees=tuple(t.root for t in trees), dry_run=True)
    if not trees:
        return PruneResult(agent=agent, took=time.monotonic() - started)
    done = await _batch(pool, agent, retention, trees, lock_timeout, store, started)
    return attrs.evolve(done, found=len(trees), last=(trees[-1].created_at, trees[-1].root))


async def _batch(
    pool: asyncpg.Pool,
    agent: str,
    retention: Retention,
    trees: list[EndedTree],
    lock_timeout: float,
    store: Any,
    started: float,
) -> PruneResult:
    """Steps 2 and 3 of a batch, on the ``trees`` step 1 selected (at ``started``)."""
    archiving = retention.archive
    if archiving and store is None:
        log.warning(
            "retention of %s archives journals and no archive store is open: nothing pruned "
            "(set archive_store)",
            agent,
        )
        return PruneResult(agent=agent, skipped=len(trees), took=time.monotonic() - started)
    read: dict[str, list[_Read]] = {}
    skipped = 0
    archived = 0
    for tree in trees:
        try:
            tree_runs = await _read_tree(pool, tree, store if archiving else None)
        # A journal not folded here, a store failing (a local store's disk: OSError).
        except (ReplayFailed, TorenError, OSError) as exc:
            log.warning("%s: not pruned now: %s: %s", tree.root, type(exc).__name__, exc)
            skipped += 1
            continue
        read[tree.root] = tree_runs
        archived += sum(_archived(r) for r in tree_runs)
    if not read:
        return PruneResult(agent=agent, skipped=skipped, took=time.monotonic() - started)
    kill_point("prune.read")
    result = await _delete(pool, agent, read, lock_timeout, skipped, archived, started)
    for root in result.trees:
        for run in read[root]:
            if run.record is not None and run.record.archive is not None:
                # a batch cut short before its commit, the run going on before this one
                await drop_shorter(store, run.record.archive)
    return result


async def _read_tree(pool: asyncpg.Pool, tree: EndedTree, store: Any) -> list[_Read]:
    """Each actor of ``tree`` as its audit record keeps it (its journal archived first when
    ``store`` is given)."""
    rows = {r.actor_id: r for r in await actor_rows(pool, tree.actors, fields=("args",))}
    out: list[_Read] = []
    for actor_id, kind in zip(tree.actors, tree.kinds, strict=True):
        row = rows.get(actor_id)
        if row is None:
            raise TorenError(f"{actor_id} is gone")
        if kind != RUN_KIND:
            seq = await last_seq(pool, actor_id) or 0
            out.append(_Read(run_id=actor_id, last_seq=seq, record=None))
        else:
            out.append(await _read_run(pool, tree.root, row, store))
    return out


async def _read_run(pool: asyncpg.Pool, root: str, row: Any, store: Any) -> _Read:
    """Run ``row`` of the tree under ``root``, folded, and its audit record (its journal
    archived first when ``store`` is given)."""
    actor_id = row.actor_id
    rebuilt = await replay(
        pool,
        actor_id,
        RunState(),
        fold,
        snapshots=(RunState, SNAPSHOT_VERSION),
        archives=Archives(store) if store is not None else None,
    )
    state: RunState = rebuilt.state
    if state.status not in ENDED:
        raise TorenError(f"{actor_id} is {state.status}")
    archive = None
    archived_before: list[JournalEntry] = []
    earlier = await archived_ranges(pool, actor_id)
    if earlier:
        # A long conversation's journal, truncated behind its snapshot as it went: its
        # first events are in the archive store only. Its audit record names those ranges
        # (they go with its row) and reads its decisions there too.
        if store is None:
            raise TorenError(
                f"{actor_id}'s journal was truncated as it went: it is pruned only with its "
                "agent's retention archiving (archive = true) and an archive store open"
            )
        for ref in earlier:
            archived_before += await read_archive(store, ref, actor_id=actor_id)
    if store is not None:
        archive = await archive_journal(pool, store, actor_id, last_seq=rebuilt.seq)
        follows = earlier[-1].last_seq + 1 if earlier else 1
        if archive.events and archive.first_seq != follows:
            # Truncated (by its host, after a snapshot) between the ranges read above and
            # the rows archived here: the record would miss the range just archived.
            raise TorenError(
                f"{actor_id}'s journal was truncated while it was read (its rows from seq "
                f"{archive.first_seq}, its ranges to seq {follows - 1}); pruned later"
            )
    record = await _record(pool, root, row, state, rebuilt.seq, archive, earlier, archived_before)
    return _Read(run_id=actor_id, last_seq=rebuilt.seq, record=record)


_RECORDED = ("run.started", "tool.intent", "approval.decided")
"""The events an audit record is read from (besides the run's folded state)."""


async def _record(
    pool: asyncpg.Pool,
    root: str,
    row: Any,
    state: RunState,
    seq: int,
    archive: ArchiveRef | None,
    earlier: Sequence[ArchiveRef] = (),
    archived_before: Sequence[JournalEntry] = (),
) -> AuditRecord:
    """The audit record of a run read as ``state`` through event ``seq`` (its events before
    its journal's first kept one, if it was truncated, read from ``earlier``'s archives as
    ``archived_before``)."""
    kept = await events(
        pool,
        row.actor_id,
        types=_RECORDED,
        keys=("by", "call_id", "name", "approved", "who", "reason", "channel", "at"),
    )
    found = [*(e for e in archived_before if e.type in _RECORDED), *kept]
    started_by = next((e.data.get("by") for e in found if e.type == "run.started"), None)
    tools = {e.data.get("call_id"): e.data.get("name") for e in found if e.type == "tool.intent"}
    decisions = tuple(
        {
            "call_id": e.data.get("call_id"),
            "tool": tools.get(e.data.get("call_id")),
            "approved": e.data.get("approved"),
            "by": e.data.get("by"),
            "who": e.data.get("who"),
            "reason": e.data.get("reason"),
            "channel": e.data.get("channel"),
            "at": e.data.get("at"),
        }
        for e in found
        if e.type == "approval.decided"
    )
    last = await events(pool, row.actor_id, after=seq - 1, keys=(), limit=1) if seq else []
    return AuditRecord(
        run_id=row.actor_id,
        root_id=root,
        parent=state.parent or None,
        agent=state.agent or str(row.args_dict.get("agent") or ""),
        version=state.version,
        args=row.args_dict,
        started_by=started_by,
        decisions=decisions,
        receipt=receipt_json(receipt(state)),
        status=state.status,
        error_class=state.error_class,
        error=state.error,
        created_at=row.created_at,
        ended_at=last[0].at if last else None,
        pruned_at=None,
        archive=archive,
        events=seq,
        earlier_archives=tuple(earlier),
    )


async def _delete(
    pool: asyncpg.Pool,
    agent: str,
    read: dict[str, list[_Read]],
    lock_timeout: float,
    skipped: int,
    archived: int,
    started: float,
) -> PruneResult:
    """Step 3: lock, check again, record and delete, in one short transaction."""
    ids = [r.run_id for runs in read.values() for r in runs]
    pruned: list[str] = []
    deleted = (0, 0, 0)
    began = time.monotonic()
    try:
        async with pool.acquire() as conn, conn.transaction():
            locked = await lock_trees(conn, ids, lock_timeout_ms=max(1, round(lock_timeout * 1000)))
            keep: list[AuditRecord] = []
            gone: list[str] = []
            for root, runs in read.items():
                if all(_unchanged(locked.get(r.run_id), r) for r in runs):
                    pruned.append(root)
                    keep.extend(r.record for r in runs if r.record is not None)
                    gone.extend(r.run_id for r in runs)
                else:
                    skipped += 1
                    archived -= sum(_archived(r) for r in runs)
            if gone:
                await insert_audit(conn, keep)
                deleted = await delete_trees(conn, gone)
                kill_point("prune.deleting")
                took = time.monotonic() - started
                await log_prune(
                    conn,
                    agent,
                    runs=len(keep),
                    events=deleted[1],
                    bytes=deleted[2],
                    archived=archived,
                    skipped=skipped,
                    took=took,
                )
    except asyncpg.LockNotAvailableError:
        # A lock waited for past the timeout (a table lock, a limit's row): nothing was
        # deleted; the trees are left for the next wake.
        log.info(
            "prune of %s: a lock was not free within %.3fs; left for later", agent, lock_timeout
        )
        return PruneResult(agent=agent, skipped=len(read), took=time.monotonic() - started)
    held = time.monotonic() - began
    took = time.monotonic() - started
    count = sum(1 for root in pruned for r in read[root] if r.record is not None)
    if pruned:
        log.info("pruned %d runs of %s (%d events) in %.3fs", count, agent, deleted[1], took)
    return PruneResult(
        agent=agent,
        runs=count,
        trees=tuple(pruned),
        events=deleted[1],
        bytes=deleted[2],
        archived=archived,
        skipped=skipped,
        took=took,
        held=held,
    )


def _archived(read: _Read) -> bool:
    return read.record is not None and read.record.archive is not None


def _unchanged(locked: Any, read: _Read) -> bool:
    """Whether a row locked now is as step 2 read it: ended, no mail, no event since."""
    if locked is None:  # held by another transaction (skipped), or gone
        return False
    if locked.mail or locked.last_seq != read.last_seq:
        return False
    return locked.kind != RUN_KIND or locked.run_status in ENDED
