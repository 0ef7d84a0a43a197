"""A never-ending conversation keeps its journal bounded (issue 32, item 4): the events behind
its snapshot, older than its retention, are archived and deleted by its worker as it goes; its
state and receipt stay exact, a missing snapshot is rebuilt from the archives and the journal's
tail, and without an archive store the journal is kept whole, said once in the log.

The conversation is the chat of ``bench/conversation_bytes.py`` (a human message, the model's
answer, a tool call every third turn, a hard compaction every fiftieth), recorded by a kernel
actor whose state is a run's (``RunState`` and its fold): 20,000 events in steps of 60 turns,
on a real worker, with no model round trips.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import attrs
import pytest

from bench.conversation_bytes import conversation, turn_events
from tests.conftest import person, running_worker, wait_for
from toren import Actor, Client, Context, Settings, message
from toren._core.codec import decode
from toren._core.journal import replay
from toren._core.resources import Resources
from toren._core.stores import LocalStore
from toren._core.truncation import ArchiveNeeded, Archives, archived
from toren.runs import (
    SNAPSHOT_VERSION,
    ContextCompacted,
    HistoryReleased,
    RunStarted,
    RunState,
    fold,
    release_due,
)
from toren.runs.receipt import receipt

pytestmark = pytest.mark.anyio

EVENTS = 20_000
TURNS_PER_STEP = 60
SNAPSHOT_EVERY = 1000


@message("test.chat.turns")
@attrs.frozen(kw_only=True)
class Turns:
    first: int  # 0: the run's start
    count: int


class Chat(Actor[RunState]):
    """A conversation that never ends, kept as a run's state; its events older than nothing
    (``journal_keep_for`` 0) are archived once a snapshot covers them."""

    kind = "test.chat"
    idle_seconds = 0.5
    snapshot_every = SNAPSHOT_EVERY
    state_type = RunState
    snapshot_version = SNAPSHOT_VERSION

    def initial_state(self) -> RunState:
        return RunState()

    def apply(self, state: RunState, event: Any) -> RunState:
        return fold(state, event)

    async def handle(self, ctx: Context[RunState], msg: Any) -> None:
        if not isinstance(msg, Turns):
            return
        if msg.first == 0:
            ctx.emit(RunStarted(agent="chat", input="hello", at=1.0))
        for turn in range(max(1, msg.first), msg.first + msg.count):
            for event in turn_events(turn):
                ctx.emit(event)
                # As a run of an agent with a conversation retention does after each hard
                # compaction (actors/runs/compaction.py): its old turns let go of.
                if isinstance(event, ContextCompacted) and event.tier == "hard":
                    released = release_due(ctx.state)
                    if released is not None:
                        ctx.emit(released)

    def journal_keep_for(self, state: RunState, resources: Resources) -> float | None:
        return 0.0


def _expected(events: int, *, release: bool = True) -> RunState:
    """The chat's state after ``events`` events; without ``release``, its state after the same
    turns had its history never been released."""
    state = RunState()
    for event in conversation(events, release=True):
        if release or not isinstance(event, HistoryReleased):
            state = fold(state, event)
    return state


def _events_of(turns: int) -> int:
    return 1 + sum(len(turn_events(t, release=True)) for t in range(1, turns))


@contextlib.asynccontextmanager
async def _worker(db_url: str, store: LocalStore | None) -> AsyncIterator[Any]:
    from toren.supervisors.worker import Worker

    settings = Settings(database_url=db_url, lease_seconds=3.0, renew_seconds=1.0,
                        poll_seconds=0.2, grace_seconds=5.0, sandboxes=False)  # fmt: skip
    worker = Worker(settings, db_url)
    if store is not None:
        worker.resources.put(Archives(store))
    async with anyio.create_task_group() as tg:
        await tg.start(worker.run)
        try:
            yield worker
        finally:
            with anyio.fail_after(15, shield=True):
                await worker.stop()


async def _chat(client: Client, actor_id: str, events: int) -> int:
    """Send the turns of a chat of about ``events`` events; the count the journal will hold."""
    await client.spawn(Chat, actor_id)
    turn = 0
    while _events_of(turn + 1) < events:
        count = TURNS_PER_STEP
        while count > 1 and _events_of(turn + count) > events:
            count -= 1
        await client.send(actor_id, Turns(first=turn, count=count))
        turn += count
    return _events_of(turn)


async def _sizes(client: Client, actor_id: str) -> tuple[int, int, int, int]:
    """Journal rows and bytes (as stored, compressed), the snapshot's chunk bytes (raw) and
    row bytes (as stored)."""
    row = await client.pool.fetchrow(
        "SELECT (SELECT count(*) FROM toren.journal WHERE actor_id = $1) AS rows, "
        "(SELECT coalesce(sum(pg_column_size(j.*)), 0) FROM toren.journal j "
        " WHERE actor_id = $1) AS journal, "
        "(SELECT coalesce(sum(octet_length(c.data)), 0) FROM toren.snapshot_chunks c "
        " WHERE actor_id = $1) AS chunks, "
        "(SELECT coalesce(sum(pg_column_size(s.state)), 0) FROM toren.snapshots s "
        " WHERE actor_id = $1) AS snapshot",
        actor_id,
    )
    return row["rows"], row["journal"], row["chunks"], row["snapshot"]


async def test_a_never_ending_conversation_keeps_its_journal_bounded_and_its_receipt_exact(
    client: Client, db_url: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    actor_id = "test.chat/1"
    store = LocalStore(tmp_path / "archive")
    total = await _chat(client, actor_id, EVENTS)
    assert total >= EVENTS - 7 * TURNS_PER_STEP
    sizes = []
    async with _worker(db_url, store):

        async def all_recorded() -> bool:
            _, seq = await client.state(actor_id)
            return bool(seq == total)

        await wait_for(all_recorded, timeout=120, what="every turn recorded")
        sizes.append(await _sizes(client, actor_id))

        async def passivated() -> bool:
            return (await client.actor(actor_id))["owner"] is None

        await wait_for(passivated, what="the chat passivated")
    rows, journal_bytes, chunk_bytes, snapshot_bytes = sizes[-1]
    # The journal holds what its last snapshot does not cover, and that snapshot's own event:
    # at most one snapshot interval and one step's events.
    step = max(len(turn_events(t)) for t in range(1, 60)) * TURNS_PER_STEP
    assert rows <= SNAPSHOT_EVERY + step, rows
    ranges = await archived(client.pool, actor_id)
    assert ranges
    assert ranges[0].first_seq == 1
    assert all(a.last_seq + 1 == b.first_seq for a, b in itertools.pairwise(ranges))
    first = await client.pool.fetchval(
        "SELECT min(seq) FROM toren.journal WHERE actor_id = $1", actor_id
    )
    assert first == ranges[-1].last_seq + 1
    # The state from its snapshot and tail is the conversation's as recorded, and its receipt
    # that of the whole conversation, as if nothing had been let go of.
    expected = _expected(total)
    state, seq = await client.state(actor_id)
    assert seq == total
    assert state == expected
    assert receipt(state) == receipt(expected) == receipt(_expected(total, release=False))
    # The snapshot's chunks hold the recent turns only: the calls before the last hard
    # compaction but one, and the conversation the requests since carry, by chunk (a chunk
    # holds up to a snapshot interval of a field's items). Unreleased, they held 11.5 MB at
    # 20,000 events, growing ~580 bytes an event (bench/conversation_bytes.py); released,
    # 0.17-0.24 MB from 5,000 to 40,000 events.
    assert state.calls.released > len(state.calls) - 200
    assert state.messages.released > len(state.messages) - 2 * SNAPSHOT_EVERY
    assert chunk_bytes < 2 * SNAPSHOT_EVERY * 600, chunk_bytes
    archive_bytes = sum(r.bytes for r in ranges)
    print(f"\n{total} events: journal {rows} rows {journal_bytes} B; snapshot row "
          f"{snapshot_bytes} B, chunks {chunk_bytes} B; archived {len(ranges)} ranges "
          f"{archive_bytes} B")  # fmt: skip

    # The snapshot deleted (derived data): rebuilt from the archives and the journal's tail.
    await client.pool.execute("DELETE FROM toren.snapshots WHERE actor_id = $1", actor_id)
    with pytest.raises(ArchiveNeeded, match="set archive_store"):
        await replay(
            client.pool, actor_id, RunState(), fold, snapshots=(RunState, SNAPSHOT_VERSION)
        )
    rebuilt = await replay(
        client.pool, actor_id, RunState(), fold,
        snapshots=(RunState, SNAPSHOT_VERSION), archives=Archives(store),
    )  # fmt: skip
    assert (rebuilt.seq, rebuilt.snapshot_seq) == (total, 0)
    assert rebuilt.state == expected  # released alike: the release is an event
    assert receipt(rebuilt.state) == receipt(expected)
    # ... and by a worker, which goes on with the conversation from there.
    async with _worker(db_url, store):
        await client.send(actor_id, Turns(first=10_001, count=1))
        more = total + len(turn_events(10_001, release=True))

        async def went_on() -> bool:
            return bool((await replay(client.pool, actor_id, RunState(), fold,
                                      archives=Archives(store))).seq == more)  # fmt: skip

        await wait_for(went_on, timeout=60, what="the chat went on")
    row = await client.actor(actor_id)
    assert (row["status"], row["failure"]) == ("live", None)
    # The worker wrote a snapshot once it had folded the archives: readers without an archive
    # store (the API, the CLI) read the conversation again.
    state, seq = await client.state(actor_id)
    assert seq == more
    for event in turn_events(10_001, release=True):
        expected = fold(expected, event)
    assert receipt(state) == receipt(expected)


async def test_without_an_archive_store_the_journal_is_kept_whole_and_said_so(
    client: Client, db_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    actor_id = "test.chat/2"
    total = await _chat(client, actor_id, 2500)
    with caplog.at_level(logging.WARNING, logger="toren.host"):
        async with _worker(db_url, None):

            async def all_recorded() -> bool:
                return bool((await client.state(actor_id))[1] == total)

            await wait_for(all_recorded, timeout=60, what="every turn recorded")
    rows = await client.pool.fetchval(
        "SELECT count(*) FROM toren.journal WHERE actor_id = $1", actor_id
    )
    assert rows == total
    assert await archived(client.pool, actor_id) == []
    said = [r.getMessage() for r in caplog.records if "kept whole" in r.getMessage()]
    assert len(said) == 1
    assert said[0].startswith(f"{actor_id}: its journal is kept whole: no archive store is set")


async def test_a_truncated_run_is_read_from_its_snapshot_and_refused_as_a_fork_source(
    client: Client, tmp_path: Path
) -> None:
    """The run kind's own actor, its events appended by the kernel's statements' shape (no
    worker): truncated by hand as its worker would, it reads as before from its snapshot (as
    the API and CLI read it, with no archive store), its events list starts after the archived
    ones, and a fork, which copies a journal from its start, is refused with the reason."""
    from toren._core.archive import archive_journal
    from toren._core.codec import encode as encode_payload
    from toren._core.json_text import dumps
    from toren._core.snapshots import encode as encode_snapshot
    from toren._core.snapshots import write as write_snapshot
    from toren._core.truncation import TruncationRefused, truncate_journal
    from toren.runs import RUN_KIND, InvalidFork, fork_run

    run_id = "run/00000000-0000-4000-8000-000000000032"
    await client.spawn(RUN_KIND, run_id, {"agent": "chat"})
    events = list(conversation(300))
    encoded = [encode_payload(e) for e in events]
    await client.pool.execute(
        "INSERT INTO toren.journal (actor_id, seq, epoch, type, data) "
        "SELECT $1, e.n, 1, e.type, e.data::jsonb "
        "FROM unnest($2::text[], $3::text[]) WITH ORDINALITY AS e(type, data, n)",
        run_id,
        [t for t, _ in encoded],
        [dumps(d) for _, d in encoded],
    )
    state = _expected(250)
    assert await write_snapshot(
        client.pool, run_id, SNAPSHOT_VERSION, 250, encode_snapshot(state, 250)
    )
    with pytest.raises(TruncationRefused, match="no archive store"):
        await truncate_journal(client.pool, None, run_id, keep_for=0)
    # Nothing is old enough: nothing done.
    store = LocalStore(tmp_path / "archive")
    assert await truncate_journal(client.pool, store, run_id, keep_for=3600) is None
    # A worker killed after writing the archive and before deleting the rows (kill point
    # truncation.archived) left the object and no record: the next truncation writes the same
    # object (kept as it is) and goes on.
    leftover = await archive_journal(client.pool, store, run_id, first_seq=1, last_seq=200)
    assert await archived(client.pool, run_id) == []
    done = await truncate_journal(client.pool, store, run_id, keep_for=0, batch=200)
    assert done is not None
    assert done.ref == leftover  # with the batch larger than what was left: the same range
    assert (done.ref.first_seq, done.ref.last_seq, done.deleted) == (1, 200, 200)
    rest = await truncate_journal(client.pool, store, run_id, keep_for=0, batch=200)
    assert rest is not None
    assert (rest.ref.first_seq, rest.ref.last_seq, rest.deleted) == (201, 249, 49)
    assert await truncate_journal(client.pool, store, run_id, keep_for=0) is None  # done
    rebuilt = await replay(
        client.pool, run_id, RunState(), fold, snapshots=(RunState, SNAPSHOT_VERSION)
    )
    assert (rebuilt.seq, rebuilt.snapshot_seq) == (300, 250)
    assert receipt(rebuilt.state) == receipt(_expected(300))
    assert [e.seq for e in await client.journal(run_id)][:1] == [250]
    # A snapshot older than the journal's first row (one written before the truncation, say,
    # kept when a newer one was deleted): it is used, and the archived events after it folded.
    await client.pool.execute("DELETE FROM toren.snapshots WHERE actor_id = $1", run_id)
    assert await write_snapshot(
        client.pool, run_id, SNAPSHOT_VERSION, 100, encode_snapshot(_expected(100), 100)
    )
    with pytest.raises(ArchiveNeeded, match="events 1-249"):
        await replay(client.pool, run_id, RunState(), fold, snapshots=(RunState, SNAPSHOT_VERSION))
    older = await replay(
        client.pool, run_id, RunState(), fold,
        snapshots=(RunState, SNAPSHOT_VERSION), archives=Archives(store),
    )  # fmt: skip
    assert (older.seq, older.snapshot_seq, older.archived) == (300, 100, 149)
    assert older.state == _expected(300)
    with pytest.raises(InvalidFork, match="before seq 250 were archived"):
        await fork_run(client, run_id, at=1)


async def test_a_chat_run_of_an_agent_with_a_conversation_retention_is_truncated_as_it_goes(
    client: Client, db_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The wiring end to end: an agent's ``Retention(conversation_keep_for=...)``, its run
    (a chat continued turn by turn through the model server), a worker with an archive store
    and a short snapshot interval: the run's first events are archived and deleted while it
    goes on, and its receipt reads as it would from the whole journal."""
    from toren import Agent, Retention
    from toren.runs import Agents, read_run, say, start_run
    from toren.testing import AnthropicServer, Reply

    def answer(body: dict[str, Any], n: int) -> Reply:
        return Reply(f"answer {n}")

    agents = Agents()
    agents.register([
        Agent(name="chatty", model="anthropic/claude-sonnet-4-6", system="chat",
              retention=Retention(archive=True, conversation_keep_for=0.001)),
    ])  # fmt: skip
    store = LocalStore(tmp_path / "archive")
    async with AnthropicServer(answer) as server:
        for name, value in server.env().items():
            monkeypatch.setenv(name, value)
        from toren.supervisors.worker import Worker

        settings = Settings(database_url=db_url, lease_seconds=3.0, renew_seconds=1.0,
                            poll_seconds=0.2, grace_seconds=5.0, sandboxes=False,
                            snapshot_every=4)  # fmt: skip
        worker = Worker(settings, db_url, agents=agents)
        worker.resources.put(Archives(store))
        async with anyio.create_task_group() as tg:
            await tg.start(worker.run)
            try:
                run_id = await start_run(client, "chatty", "hello")

                async def answered_all() -> bool:
                    state = await read_run(client, run_id)
                    return state.status == "completed" and len(state.calls) == 8

                for turn in range(1, 8):

                    async def answered(turn: int = turn) -> bool:
                        state = await read_run(client, run_id)
                        return state.status == "completed" and len(state.calls) == turn

                    await wait_for(answered, timeout=30, what=f"turn {turn} answered")
                    await say(client, run_id, f"and then {turn}?")
                await wait_for(answered_all, timeout=30, what="the last turn answered")
                await wait_for(lambda: _truncated(client, run_id), what="the chat truncated")
            finally:
                with anyio.fail_after(15, shield=True):
                    await worker.stop()
    ranges = await archived(client.pool, run_id)
    assert ranges[0].first_seq == 1
    # The whole conversation, read from the archives and the journal, folds to the run the
    # API shows (from its snapshot), to the cent.
    whole = await replay(client.pool, run_id, RunState(), fold, archives=Archives(store))
    shown = await read_run(client, run_id)
    assert receipt(shown) == receipt(whole.state)
    assert receipt(shown).calls_made == len(server.received)
    # Pruned once it ended, its audit record names every range (those archived as it went
    # and the rest), and a restore reads them all back to the same fold.
    from toren.runs.audit import audit_record
    from toren.runs.prune import prune_batch
    from toren.runs.restore import restored_run

    pruned = await prune_batch(
        client.pool, "chatty", Retention(keep_for=0.001, archive=True), store=store
    )
    assert pruned.runs == 1
    record = await audit_record(client.pool, run_id)
    assert record is not None
    assert [r.first_seq for r in record.earlier_archives] == [r.first_seq for r in ranges]
    assert record.archive.first_seq == ranges[-1].last_seq + 1
    restored, entries = await restored_run(client, run_id, store=store)
    assert [e.seq for e in entries] == list(range(1, whole.seq + 1))
    assert restored == whole.state


async def _truncated(client: Client, run_id: str) -> bool:
    return bool(await archived(client.pool, run_id))


async def test_a_run_that_lets_go_of_its_old_turns_asks_the_same_and_checks_only_the_rest(
    client: Client, db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The run actor end to end on a small window (a hard compaction every second call): an
    agent with a conversation retention records ``history.released`` after its hard
    compactions and makes exactly the requests an agent without one makes; its receipt is
    the whole journal's; and a code change that alters the requests of its settled calls
    (released) and of a later one invalidates from the later one only."""
    import toren.actors.runs.request
    from tests import compaction_app
    from tests.compaction_app import WINDOW, pages
    from tests.test_compaction import TASK, _shout_page
    from toren._agent.app import load_app
    from toren.actors.runs.request import recomputed
    from toren.runs import ENDED, fork_run, read_run, say, start_run
    from toren.testing import AnthropicServer

    load_app("tests.compaction_app")

    async def ended(run_id: str) -> RunState | None:
        state = await read_run(client, run_id)
        return state if state.status in ENDED else None

    bodies: dict[str, list[Any]] = {}
    for name in ("reader", "keeper"):
        async with AnthropicServer(pages(12, 12000), window=WINDOW) as s:
            for key, value in s.env().items():
                monkeypatch.setenv(key, value)
            async with running_worker(db_url):
                run_id = await start_run(client, name, TASK)

                async def done(run_id: str = run_id) -> RunState | None:
                    return await ended(run_id)

                await wait_for(done, timeout=90, what=f"the {name}'s end")
            bodies[name] = [r.body for r in s.served]
    assert bodies["keeper"] == bodies["reader"]  # the model is asked the same
    state = await read_run(client, run_id)
    assert state.status == "completed", state.error
    journal = await client.journal(run_id)
    releases = [e.data["before_calls"] for e in journal if e.type == "history.released"]
    assert releases
    assert releases == sorted(releases)
    assert state.settled_calls == releases[-1]
    assert 0 < state.calls.released < state.settled_calls
    assert state.messages.released > 0
    whole = RunState()
    for event in (decode(e.type, e.data) for e in journal):
        if not isinstance(event, HistoryReleased):
            whole = fold(whole, event)
    assert receipt(state) == receipt(whole)
    assert receipt(state).calls_made == len(bodies["keeper"])

    # A fork from its last step (its journal kept whole: no archive store here) copies the
    # releases with the prefix, and asks the model once more, as the source did.
    at = len(state.calls)
    async with AnthropicServer(pages(12, 12000), window=WINDOW) as s:
        for key, value in s.env().items():
            monkeypatch.setenv(key, value)
        async with running_worker(db_url):
            fork = await fork_run(client, run_id, at=at)

            async def fork_done() -> RunState | None:
                return await ended(fork)

            forked = await wait_for(fork_done, timeout=60, what="the fork's end")
        assert [r.body for r in s.served] == bodies["keeper"][-1:]
    assert (forked.status, forked.output) == ("completed", state.output)
    assert forked.calls.released == state.calls.released
    assert (receipt(forked).calls_inherited, receipt(forked).calls_made) == (at - 1, 1)

    # A code change: pages 1 (settled, released) and the first page after the settled calls
    # rendered otherwise. Only the later one invalidates.
    page = state.settled_calls + 1
    first, later = _shout_page(1), _shout_page(page)

    def shout(agent: Any, messages: Any, callees: Any = None) -> Any:
        return later(agent, first(agent, messages, callees).messages, callees)

    monkeypatch.setattr(toren.actors.runs.request, "build_request", shout)
    async with AnthropicServer(pages(12, 12000), window=WINDOW) as s:
        for key, value in s.env().items():
            monkeypatch.setenv(key, value)
        async with running_worker(db_url):
            await say(client, run_id, "And once more, please.", by=person("ada"))

            async def redone() -> RunState | None:
                state = await read_run(client, run_id)
                return state if state.voided and state.status == "completed" else None

            after = await wait_for(redone, timeout=90, what="invalidated and done again")
        served = len(s.served)
    journal = await client.journal(run_id)
    [invalidated] = [e.data["from_step"] for e in journal if e.type == "steps.invalidated"]
    assert invalidated == page + 1
    agent = compaction_app.keeper
    checked = list(recomputed(after, agent, shout, first=after.settled_calls))
    assert checked
    assert all(call.digest == digest for call, digest in checked)
    assert receipt(after).calls_made == len(bodies["keeper"]) + served


def test_the_receipt_reads_the_costs_it_needs_after_they_were_released() -> None:
    """A fork that resumed early (its inherited calls and its replayed calls both among those
    later released): its receipt, folded with the releases, read back from a snapshot at
    every thousandth event, is the receipt of the same events folded without them."""
    from toren._core.json_text import dumps, loads
    from toren._core.snapshots import _state as read_state
    from toren._core.snapshots import encode as encode_snapshot
    from toren.runs import RunForked, RunResumed

    released, whole = RunState(), RunState()
    for seq, event in enumerate(conversation(6000, release=True), start=1):
        extra: list[Any] = []
        if seq == 40:
            extra = [RunForked(source="run/source", step=9, calls=len(whole.calls), at=1.0)]
        elif seq == 80:
            extra = [RunResumed(replayed=len(whole.calls))]
        for e in [event, *extra]:
            released = fold(released, e)
            if not isinstance(e, HistoryReleased):
                whole = fold(whole, e)
        if seq % 1000 == 0:
            snap = encode_snapshot(released, seq)
            released = read_state(dict(snap.chunks), loads(dumps(snap.row)), RunState)
    assert released.calls.released > whole.replayed > (whole.forked.calls if whole.forked else 0)
    assert released.forked is not None
    assert set(released.cost_marks) == {f"kept:{whole.replayed}", f"kept:{whole.forked.calls}"}
    assert receipt(released) == receipt(whole)
    assert receipt(released).usd_not_repaid > 0
