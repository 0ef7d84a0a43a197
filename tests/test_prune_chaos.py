"""Chaos for pruning with archiving on (issue 32): real worker processes faulted at the pruner's
kill points, then the oracle over every run.

The runs: seven trees of ``keeper`` (a root and its ``aide`` child, written as a worker leaves
them; some with text a JSON reader must keep exact), aged past the agent's ``keep_for``; the
workers prune them three trees a batch (``prune_batch`` 3), archiving each journal to a
directory store first. The faults:

- ``prune.read#2``: the first batch committed, the second's archives written and verified, its
  rows not deleted;
- ``prune.deleting``: a batch's audit records written and its rows deleted, not committed;

each under ``SIGKILL`` (then a replacement worker) and under ``pg_terminate_backend`` (the
worker lives on). After each, for every run (:func:`_oracle`): either it is whole (its row, its
journal as it was, no audit record) or it is pruned (no row, no journal, one audit record whose
archive reads back to exactly the events it had); a tree is whole or pruned together; the prune
log counts each pruned run once; the store holds one object per pruned run (the one its record
names) and nothing else but the archive of a whole run's journal (which the next batch writes
again under the same key, the same bytes) or, for a run that went on after a batch archived it,
of the start of its journal (which the batch that prunes it deletes). And the pruner resumes by
itself: a replacement's start wakes it, or the worker retries the message the cut cost it.

The truncation of a never-ending journal (``truncation.archived``) is faulted the same way on a
kernel actor (``tests/prune_chaos_app.py``: ``Ledger``).
"""

from __future__ import annotations

import hashlib
import itertools
from pathlib import Path
from typing import Any

import attrs
import pytest

from tests.conftest import WorkerFactory, WorkerProcess, person, wait_for
from tests.prune_chaos_app import Ledger, LedgerState, Post, apply_posted, posted
from tests.test_retention import ended_run
from toren import Client
from toren._agent.model import ModelResponse, Text, Usage
from toren._core.archive import ARCHIVE_FORMAT, ArchiveRef, archive_key, parse_archive
from toren._core.archive import read_archive as read_archive_ref
from toren._core.codec import encode
from toren._core.journal import JournalEntry, read_journal, replay
from toren._core.stores import LocalStore
from toren._core.truncation import Archives, archived
from toren.runs import RUN_KIND
from toren.runs.audit import audit_record
from toren.runs.client import read_run
from toren.runs.events import MessageReceived, ModelCalled, RunCompleted
from toren.runs.state import fold, summary

pytestmark = pytest.mark.anyio

APP = "tests.prune_chaos_app"
TREES = 7
BATCH = 3
HOSTILE = "why \x00 not \ud800 é"

Journals = dict[str, list[JournalEntry]]


async def _trees(client: Client, count: int) -> list[tuple[str, str]]:
    """``count`` ended trees of keeper's (root, child), oldest first, past its keep_for."""
    trees = []
    for n in range(count):
        root = await ended_run(client, "keeper", decided=HOSTILE if n % 2 else None)
        child = await ended_run(client, "aide", parent=root, status="failed", error=HOSTILE)
        trees.append((root, child))
        for table in ("journal", "actors"):
            await client.pool.execute(
                f"UPDATE toren.{table} SET created_at = now() - make_interval(mins => 180 - $2) "
                "WHERE actor_id = ANY($1::text[])",
                [root, child],
                n,
            )
    return trees


async def _journals(client: Client, trees: list[tuple[str, str]]) -> Journals:
    return {r: await read_journal(client.pool, r) for tree in trees for r in tree}


async def _keys(store: LocalStore) -> set[str]:
    return {key async for key in store.list_keys("journals/")}


@attrs.frozen
class Seen:
    pruned: frozenset[str]  # runs pruned, each with its audit record and archive checked
    whole: frozenset[str]  # runs still whole in the journal
    leftovers: frozenset[str]  # store keys no record names: a whole run's archive


async def _oracle(
    client: Client, store: LocalStore, trees: list[tuple[str, str]], before: Journals
) -> Seen:
    """Every run whole or pruned with its archive exact; nothing pruned twice; no stray object
    in the store but a whole run's archive of its whole journal (see the module)."""
    pruned: set[str] = set()
    whole: set[str] = set()
    named: set[str] = set()
    for tree in trees:
        for run_id in tree:
            events = before[run_id]
            row = await client.pool.fetchval(
                "SELECT count(*) FROM toren.actors WHERE actor_id = $1", run_id
            )
            journal = await read_journal(client.pool, run_id)
            record = await audit_record(client.pool, run_id)
            if record is None:
                assert (row, journal) == (1, events), f"{run_id}: not pruned, and not whole"
                whole.add(run_id)
                continue
            assert (row, journal) == (0, []), f"{run_id}: its audit record is written, rows kept"
            assert record.archive is not None, f"{run_id}: deleted without its archive"
            assert record.events == len(events)
            read = await read_archive_ref(store, record.archive, actor_id=run_id)
            assert read == events, f"{run_id}: its archive is not the events it had"
            named.add(record.archive.location)
            pruned.add(run_id)
        assert set(tree) <= pruned or set(tree) <= whole, f"tree {tree} pruned in part"
    audits = await client.pool.fetchval("SELECT count(*) FROM toren.run_audit")
    logged = await client.pool.fetchval("SELECT coalesce(sum(runs), 0) FROM toren.prune_log")
    assert audits == logged == len(pruned), (audits, logged, len(pruned))
    keys = await _keys(store)
    assert named <= keys
    leftovers = keys - named
    for key in leftovers:  # only the archive of a whole run's journal, or of a prefix of it
        owner, last = next(
            (
                (r, n)
                for r in whole
                for n in range(1, len(before[r]) + 1)
                if key == archive_key(RUN_KIND, r, 1, n)
            ),
            ("", 0),
        )
        assert owner, f"a stray object in the archive store: {key}"
        assert await _read_object(store, key, 1, last) == before[owner][:last]
    assert await client.pool.fetchval("SELECT count(*) FROM toren.deadletters") == 0
    return Seen(frozenset(pruned), frozenset(whole), frozenset(leftovers))


async def _went_on(client: Client, run_id: str) -> list[JournalEntry]:
    """``run_id`` (ended) told something and answered, as its worker records it; its journal."""
    state = await read_run(client, run_id)
    seq = await client.pool.fetchval(
        "SELECT max(seq) FROM toren.journal WHERE actor_id = $1", run_id
    )
    response = ModelResponse(
        content=(Text(text="again"),),
        stop_reason="end",
        usage=Usage(input_tokens=9, output_tokens=2),
        model="m",
    )
    more = [
        MessageReceived(text="one more thing", who="bob", channel="test", by=person("bob")),
        ModelCalled(
            step=2, digest="e", model="m", response=response, cost_usd="0.01", latency_ms=5
        ),
        RunCompleted(output="again", at=3.0),
    ]
    for n, event in enumerate(more, seq + 1):
        name, data = encode(event)
        await client.pool.execute(
            "INSERT INTO toren.journal (actor_id, seq, epoch, type, data, created_at) "
            "VALUES ($1, $2, 1, $3, $4, now() - interval '2 hours')",
            run_id,
            n,
            name,
            data,
        )
        state = fold(state, event)
    await client.pool.execute(
        "UPDATE toren.actors SET summary = $2 WHERE actor_id = $1", run_id, summary(state)
    )
    return await read_journal(client.pool, run_id)


async def _read_object(store: LocalStore, key: str, first: int, last: int) -> list[JournalEntry]:
    """An archive object no record names, read with every check a record's would get."""
    data = await store.get(key)
    ref = ArchiveRef(
        location=key,
        sha256=hashlib.sha256(data).hexdigest(),
        first_seq=first,
        last_seq=last,
        events=last - first + 1,
        bytes=len(data),
        format=ARCHIVE_FORMAT,
    )
    return parse_archive(data, ref)


def _armed(points: Path, point: str) -> dict[str, str]:
    (points / "hit").unlink(missing_ok=True)
    (points / "go").unlink(missing_ok=True)
    return {"kill_point": point, "kill_point_dir": str(points)}


async def _hit(points: Path, worker: WorkerProcess, what: str) -> None:
    async def hit() -> bool:
        assert worker.proc.poll() is None, f"the worker exited:\n{worker.log()[-3000:]}"
        return (points / "hit").exists()

    await wait_for(hit, timeout=60, what=what)


async def _all_pruned(
    client: Client, store: LocalStore, trees: list[tuple[str, str]], before: Journals
) -> Seen:
    async def done() -> bool:
        n = await client.pool.fetchval("SELECT count(*) FROM toren.run_audit")
        return bool(n == 2 * len(trees))

    await wait_for(done, timeout=60, what="the pruner resumed and pruned every run")
    seen = await _oracle(client, store, trees, before)
    assert (len(seen.pruned), seen.whole, seen.leftovers) == (2 * len(trees), set(), set())
    return seen


def _batch(trees: list[tuple[str, str]], n: int) -> frozenset[str]:
    return frozenset(r for tree in trees[BATCH * n : BATCH * (n + 1)] for r in tree)


def _setting_up(tmp_path: Path) -> tuple[LocalStore, dict[str, Any], Path]:
    """The archive store, the workers' settings and the kill points' folder."""
    points = tmp_path / "points"
    points.mkdir()
    settings = {"archive_store": str(tmp_path / "archive"), "prune_batch": BATCH}
    return LocalStore(tmp_path / "archive"), settings, points


async def _second_batch_archived(
    client: Client, store: LocalStore, trees: list[tuple[str, str]], before: Journals
) -> Seen:
    """The oracle at ``prune.read#2``: the first batch pruned, the second archived (each run's
    whole journal), the rest untouched."""
    seen = await _oracle(client, store, trees, before)
    assert seen.pruned == _batch(trees, 0)
    assert seen.leftovers == {archive_key(RUN_KIND, r, 1, len(before[r])) for r in _batch(trees, 1)}
    return seen


async def test_a_pruner_killed_after_archiving_and_mid_batch_loses_nothing_and_resumes(
    client: Client, workers: WorkerFactory, tmp_path: Path
) -> None:
    """SIGKILL at ``prune.read#2``, then (a replacement) at ``prune.deleting``, then a
    replacement unarmed: the oracle after each, and the runs pruned by the third on its own."""
    store, settings, points = _setting_up(tmp_path)
    trees = await _trees(client, TREES)
    before = await _journals(client, trees)

    # Killed with its second batch archived and verified, before its deleting transaction.
    first = workers(APP, **_armed(points, "prune.read#2"), **settings)
    await _hit(points, first, "the second batch archived")
    first.kill()
    seen = await _second_batch_archived(client, store, trees, before)

    # One of them goes on meanwhile (told something, answered, completed again): its archive
    # in the store is of a shorter journal than it has now.
    went_on = trees[BATCH][0]
    before[went_on] = await _went_on(client, went_on)
    assert (await _oracle(client, store, trees, before)).leftovers == seen.leftovers

    # A replacement killed in the middle of its batch (the same three trees: their archives
    # written again, the same, but the one that went on): nothing of it committed.
    second = workers(APP, **_armed(points, "prune.deleting"), **settings)
    await _hit(points, second, "the replacement's batch deleting")
    second.kill()
    again = await _oracle(client, store, trees, before)
    longer = archive_key(RUN_KIND, went_on, 1, len(before[went_on]))
    assert again == attrs.evolve(seen, leftovers=seen.leftovers | {longer})

    # A replacement resumes by itself (its start wakes the pruner; nothing asked it to prune).
    workers(APP, **settings)
    await _all_pruned(client, store, trees, before)


async def test_a_pruner_cut_off_from_postgres_after_archiving_or_mid_batch_resumes_by_itself(
    client: Client, workers: WorkerFactory, tmp_path: Path
) -> None:
    """``pg_terminate_backend``: at ``prune.read#2`` every session of the worker (its lock's
    too), then, on a second set of runs, at ``prune.deleting#2`` only the pruner's deleting
    transaction. The worker lives on both times and prunes what is left without being asked."""
    store, settings, points = _setting_up(tmp_path)
    trees = await _trees(client, TREES)
    before = await _journals(client, trees)

    first = workers(APP, **_armed(points, "prune.read#2"), **settings)
    await _hit(points, first, "the second batch archived")
    await _second_batch_archived(client, store, trees, before)
    cut = await client.pool.fetchval(
        "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
        "WHERE application_name LIKE 'toren-worker%' AND datname = current_database()"
    )
    assert cut >= 2  # its lock's session and its pool's
    (points / "go").touch()
    await _all_pruned(client, store, trees, before)
    first.kill()

    more = await _trees(client, TREES)
    before.update(await _journals(client, more))
    second = workers(APP, **_armed(points, "prune.deleting#2"), **settings)
    await _hit(points, second, "the second batch deleting")
    held = await client.pool.fetch(
        "SELECT DISTINCT pid FROM pg_locks WHERE relation = 'toren.run_audit'::regclass "
        "AND mode = 'RowExclusiveLock' AND pid <> pg_backend_pid()"
    )
    assert len(held) == 1  # the batch's transaction: audit rows inserted, not committed
    assert await client.pool.fetchval("SELECT pg_terminate_backend($1)", held[0]["pid"])
    seen = await _oracle(client, store, trees + more, before)
    assert seen.pruned == {r for t in trees for r in t} | _batch(more, 0)
    (points / "go").touch()
    await _all_pruned(client, store, trees + more, before)
    assert second.proc.poll() is None  # one worker did it all: it retried its message


async def test_a_truncation_killed_after_its_archive_keeps_the_rows_and_the_state(
    client: Client, workers: WorkerFactory, tmp_path: Path
) -> None:
    """SIGKILL at ``truncation.archived`` (a never-ending actor's events behind its snapshot
    archived and verified, not recorded nor deleted): the journal is whole and the state
    rebuilds; a replacement truncates as it goes on, and the archives and the journal's tail
    hold every event once."""
    store, settings, points = _setting_up(tmp_path)
    ledger = f"{Ledger.kind}/1"
    await client.spawn(Ledger, ledger)
    await client.send(ledger, Post(first=1, count=12))  # a snapshot at 12: 1-11 go
    everything = [posted(n) for n in range(1, 37)]

    def state_at(n: int) -> LedgerState:
        state = LedgerState()
        for event in everything[:n]:
            state = apply_posted(state, event)
        return state

    first = workers(APP, **_armed(points, "truncation.archived"), **settings)
    await _hit(points, first, "the ledger's events archived")
    first.kill()
    journal = await read_journal(client.pool, ledger)
    assert [(e.type, e.data) for e in journal] == [encode(e) for e in everything[:12]]
    assert await archived(client.pool, ledger) == []
    [leftover] = await _keys(store)
    assert leftover == archive_key(Ledger.kind, ledger, 1, 11)
    assert await _read_object(store, leftover, 1, 11) == journal[:11]
    assert await client.state(ledger) == (state_at(12), 12)
    await client.pool.execute("DELETE FROM toren.snapshots WHERE actor_id = $1", ledger)
    rebuilt = await replay(client.pool, ledger, LedgerState(), apply_posted)
    assert (rebuilt.state, rebuilt.seq) == (state_at(12), 12)

    # A replacement goes on (two steps, a snapshot after each) and truncates behind them.
    workers(APP, **settings)
    await client.send(ledger, Post(first=13, count=12))
    await client.send(ledger, Post(first=25, count=12))

    async def truncated() -> bool:
        ranges = await archived(client.pool, ledger)
        return bool(ranges) and ranges[-1].last_seq == 35

    await wait_for(truncated, timeout=60, what="the ledger truncated behind its last snapshot")
    ranges = await archived(client.pool, ledger)
    assert ranges[0].first_seq == 1
    assert all(a.last_seq + 1 == b.first_seq for a, b in itertools.pairwise(ranges))
    assert [e.seq for e in await read_journal(client.pool, ledger)] == [36]
    await client.pool.execute("DELETE FROM toren.snapshots WHERE actor_id = $1", ledger)
    whole = await replay(client.pool, ledger, LedgerState(), apply_posted, archives=Archives(store))
    assert (whole.state, whole.seq, whole.archived) == (state_at(36), 36, 35)
    assert await _keys(store) == {r.location for r in ranges}, "an archive no range names"
