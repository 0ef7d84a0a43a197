"""Run snapshots in Postgres: written by the worker as a run goes, read by every reader, and never
able to change what a run is (a lost race, a damaged or foreign snapshot: the journal decides).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

import attrs
import pytest

import toren.providers.anthropic  # noqa: F401  (the SDK import, paid once)
from tests import app
from tests.conftest import running_worker, wait_for
from toren import Actor, Client, Context, message
from toren._agent.app import load_app
from toren._agent.model import Text, ToolCall
from toren._core.journal import replay
from toren._core.snapshots import encode, read, write
from toren.runs import SNAPSHOT_VERSION, RunState, fold, read_run, start_run
from toren.testing import AnthropicServer, Reply

pytestmark = pytest.mark.anyio

STEPS = 12


@pytest.fixture
async def long_run(
    client: Client, db_url: str, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[str]:
    """A completed run of ``STEPS`` tool steps, snapshotted every 4 events by its worker."""
    load_app("tests.run_app")
    script = [
        Reply([Text(text=f"step {i}"), ToolCall(id=f"c{i}", name="create_ticket",
                                                  arguments={"title": f"t{i}"})])
        for i in range(STEPS)
    ] + [Reply("done")]  # fmt: skip
    async with AnthropicServer(script) as server:
        for name, value in server.env().items():
            monkeypatch.setenv(name, value)
        async with running_worker(db_url, snapshot_every=4):
            run_id = await start_run(client, "support", "many tickets")

            async def completed() -> bool:
                return (await read_run(client, run_id)).status == "completed"

            await wait_for(completed, timeout=60, what="the long run")
        yield run_id


async def _whole(client: Client, run_id: str) -> RunState:
    state: RunState = (await replay(client.pool, run_id, RunState(), fold)).state
    return state


async def test_a_run_is_snapshotted_and_read_back_from_its_snapshot(
    client: Client, long_run: str
) -> None:
    row = await client.pool.fetchrow(
        "SELECT seq, version FROM toren.snapshots WHERE actor_id = $1", long_run
    )
    assert row is not None
    assert row["version"] == SNAPSHOT_VERSION
    chunks = await client.pool.fetchval(
        "SELECT count(*) FROM toren.snapshot_chunks WHERE actor_id = $1", long_run
    )
    assert chunks > 0
    whole = await _whole(client, long_run)
    assert len(whole.calls) == STEPS + 1
    assert await read_run(client, long_run) == whole
    snapshot = await replay(
        client.pool, long_run, RunState(), fold, snapshots=(RunState, SNAPSHOT_VERSION)
    )
    assert snapshot.snapshot_seq == row["seq"]
    assert snapshot.state == whole
    # Every chunk stored is one the snapshot names: none is left behind by later snapshots.
    async with client.pool.acquire() as conn, conn.transaction(isolation="repeatable_read"):
        named = await conn.fetchval(
            "SELECT count(*) FROM toren.snapshot_chunks c JOIN toren.snapshots s USING (actor_id) "
            "WHERE c.actor_id = $1",
            long_run,
        )
    assert named == chunks


async def test_an_older_snapshot_never_replaces_a_newer_one(client: Client, long_run: str) -> None:
    state = await _whole(client, long_run)
    newest = await client.pool.fetchval(
        "SELECT seq FROM toren.snapshots WHERE actor_id = $1", long_run
    )
    before = await client.pool.fetch(
        "SELECT key FROM toren.snapshot_chunks WHERE actor_id = $1 ORDER BY key", long_run
    )
    # A late writer (a worker that lost the run) with an older state: nothing of it is kept.
    stale = encode(state, newest - 1)
    assert stale.chunks  # it would have written chunks
    assert not await write(client.pool, long_run, SNAPSHOT_VERSION, newest - 1, stale)
    after = await client.pool.fetch(
        "SELECT key FROM toren.snapshot_chunks WHERE actor_id = $1 ORDER BY key", long_run
    )
    assert after == before
    assert await read_run(client, long_run) == state


@pytest.mark.parametrize(
    "damage",
    [
        "UPDATE toren.snapshot_chunks SET data = '[1, 2' WHERE actor_id = $1",
        "DELETE FROM toren.snapshot_chunks WHERE actor_id = $1",
        "UPDATE toren.snapshots SET state = '{\"agent\": 5}' WHERE actor_id = $1",
        "UPDATE toren.snapshots SET version = version + 1 WHERE actor_id = $1",
        # The row names a chunk with another count (its bytes and checksum unchanged): the
        # state would be longer or shorter than its chunk holds.
        "UPDATE toren.snapshots SET state = jsonb_set(state, '{calls,chunks,0,1}', "
        "to_jsonb((state #>> '{calls,chunks,0,1}')::int + 1)) WHERE actor_id = $1",
        "UPDATE toren.snapshots SET state = jsonb_set(state, '{messages,chunks,0,1}', "
        "to_jsonb((state #>> '{messages,chunks,0,1}')::int - 1)) WHERE actor_id = $1",
    ],
)
async def test_a_damaged_or_foreign_snapshot_is_set_aside_for_the_journal(
    client: Client, long_run: str, damage: str, caplog: pytest.LogCaptureFixture
) -> None:
    whole = await _whole(client, long_run)
    await client.pool.execute(damage, long_run)
    with caplog.at_level(logging.WARNING, logger="toren.snapshots"):
        state = await read_run(client, long_run)
        assert list(state.calls) == list(whole.calls)  # every chunk read, if any is damaged
    assert state == whole
    if "version" not in damage:
        assert "folding the journal instead" in caplog.text


async def test_a_damaged_snapshot_found_late_is_said_so(client: Client, long_run: str) -> None:
    """A chunk is decoded when first read: damage found then names the chunk."""
    async with client.pool.acquire() as conn, conn.transaction(isolation="repeatable_read"):
        found = await read(conn, long_run, RunState, SNAPSHOT_VERSION)
    assert found is not None
    state, _ = found
    await client.pool.execute("DELETE FROM toren.actors WHERE actor_id = $1", long_run)
    chunk = state.calls.chunks[0]
    chunk.raw = b"[]"  # stands for bytes damaged after they were read and checked
    with pytest.raises(ValueError, match="holds 0 items, not"):
        list(state.calls)


async def test_snapshots_go_with_their_run(client: Client, long_run: str) -> None:
    await client.pool.execute("DELETE FROM toren.actors WHERE actor_id = $1", long_run)
    for table in ("toren.snapshots", "toren.snapshot_chunks"):
        n = await client.pool.fetchval(
            f"SELECT count(*) FROM {table} WHERE actor_id = $1", long_run
        )
        assert n == 0, table


# --- Review (issue 13): a snapshot that cannot be written never costs the actor anything ------


@message("test.snap.noted")
@attrs.frozen(kw_only=True)
class Noted:
    text: str


class _Opaque:
    """Something neither cattrs nor JSON can write."""


@attrs.frozen(kw_only=True)
class OpaqueState:
    notes: tuple[str, ...] = ()
    handle: Any = None


class ListSnapshots(Actor[list[str]]):
    """Snapshots of a state that is not an attrs class (a plain list), as snapshots allowed
    before chunks came."""

    kind = "test.snap.list"
    snapshot_every = 2
    state_type = list[str]
    idle_seconds = 0.2

    def initial_state(self) -> list[str]:
        return []

    def apply(self, state: list[str], event: Any) -> list[str]:
        return [*state, event.text] if isinstance(event, Noted) else state

    async def handle(self, ctx: Context[list[str]], msg: Any) -> None:
        if isinstance(msg, Noted):
            ctx.emit(msg)


class OpaqueSnapshots(Actor[OpaqueState]):
    """An attrs state holding an object that cannot be written: its snapshots fail."""

    kind = "test.snap.opaque"
    snapshot_every = 2
    state_type = OpaqueState
    idle_seconds = 0.2

    def initial_state(self) -> OpaqueState:
        return OpaqueState(handle=_Opaque())

    def apply(self, state: OpaqueState, event: Any) -> OpaqueState:
        if isinstance(event, Noted):
            return attrs.evolve(state, notes=(*state.notes, event.text))
        return state

    async def handle(self, ctx: Context[OpaqueState], msg: Any) -> None:
        if isinstance(msg, Noted):
            ctx.emit(msg)


@pytest.mark.parametrize("cls", [ListSnapshots, OpaqueSnapshots])
async def test_an_actor_whose_snapshot_cannot_be_written_goes_on_without_a_restart(
    client: Client, db_url: str, cls: type[Actor[Any]], caplog: pytest.LogCaptureFixture
) -> None:
    actor_id = f"{cls.kind}/1"
    await client.spawn(cls, actor_id)
    texts = [f"n{i}" for i in range(9)]
    for text in texts:
        await client.send(actor_id, Noted(text=text))
    with caplog.at_level(logging.WARNING):
        async with running_worker(db_url):

            async def handled() -> bool:
                journal = await client.journal(actor_id)
                return len(journal) == len(texts)

            await wait_for(handled, what="every message handled")

            async def passivated() -> bool:
                return (await client.actor(actor_id))["owner"] is None

            await wait_for(passivated, what="passivated")
    row = await client.actor(actor_id)
    assert (row["status"], row["failure"]) == ("live", None)
    # No restart was charged for a snapshot: it is derived data.
    restarts = await client.pool.fetchval(
        "SELECT count(*) FROM toren.restart_windows WHERE key LIKE '%' || $1 || '%'", actor_id
    )
    assert restarts == 0
    state, seq = await client.state(actor_id)
    assert seq == len(texts)
    if cls is ListSnapshots:  # a plain state is stored as it was before chunks
        assert state == texts
        assert await client.pool.fetchval(
            "SELECT seq FROM toren.snapshots WHERE actor_id = $1", actor_id
        )
    else:
        assert state.notes == tuple(texts)
        assert "snapshot" in caplog.text


HOSTILE = [
    "a\x00b",
    "\ud800",
    "x\udfffy\x00",
    "\ue000",
    "\ue000s\\x00",
    "\ue000i12",
    "\ue000f1e17",
    "\\u0000",
    "\\x00\\",
    "é😀\u2028",
    "",
]


def _hostile_journal() -> list[Any]:
    """A run's events full of what Postgres and UTF-8 refuse or Toren's tags look like, as the
    journal gives them back (each event written and read as a worker's emit does)."""
    from toren._agent.model import ModelResponse, Usage
    from toren._core.codec import decode as decode_payload
    from toren._core.codec import encode as encode_payload
    from toren._core.json_text import dumps, loads
    from toren.runs import (
        MessageReceived,
        ModelCalled,
        RunResumed,
        RunStarted,
        ToolIntended,
        ToolResulted,
    )

    events: list[Any] = [RunStarted(agent="a\x00", input="\ud800" + HOSTILE[0], at=1.5)]
    for i in range(24):
        h = HOSTILE[i % len(HOSTILE)]
        arguments = {
            "s": h,
            h: [2**70, -(2**65), 4.2e16, 1e300, -0.0, [{"\ue000k": h, "n": None}]],
        }
        call = ToolCall(id=f"c{i}", name="t", arguments=arguments)
        response = ModelResponse(
            content=(Text(text=h * 3), call),
            stop_reason="tool_use",
            usage=Usage(input_tokens=2**40, output_tokens=1),
            model="m",
        )
        events += [
            ModelCalled(step=i + 1, digest=h, model="m", response=response, cost_usd="0.1",
                        latency_ms=1, messages_len=2 * i + 1, checked_as=h),
            ToolIntended(call_id=f"c{i}", name="t", arguments=arguments, idempotency_key=h),
            ToolResulted(call_id=f"c{i}", content=h + "\x00"),
            MessageReceived(text=h, who=h, channel="\ue000"),
        ]  # fmt: skip
        if i % 7 == 3:
            events.append(RunResumed(replayed=i, checked_as=h or "p"))
    return [decode_payload(t, loads(dumps(b))) for t, b in map(encode_payload, events)]


async def test_hostile_text_goes_through_snapshot_chunks_and_rows_exactly(
    client: Client,
) -> None:
    """NUL, lone surrogates, the tag mark and what tags look like, numbers jsonb would change:
    a state written as a snapshot (its chunks as bytea, its row as jsonb) and read back is
    the state, at every point a worker could write one."""
    events = _hostile_journal()
    await client.spawn(app.Counter, "hostile/1")  # any actor: snapshots go with their actor
    state, host = RunState(), RunState()
    for seq, event in enumerate(events, start=1):
        state, host = fold(state, event), fold(host, event)
        if seq % 9 and seq != len(events):
            continue
        snap = encode(host, seq)
        assert await write(client.pool, "hostile/1", SNAPSHOT_VERSION, seq, snap)
        host = snap.state
        async with client.pool.acquire() as conn, conn.transaction(isolation="repeatable_read"):
            found = await read(conn, "hostile/1", RunState, SNAPSHOT_VERSION)
        assert found is not None, seq
        back, at = found
        assert at == seq
        assert back == state, seq
        assert host == state, seq
        # Item by item too (a History equals by items; here each item's fields are compared).
        for field in ("messages", "calls", "heard", "kept_cost", "voided"):
            assert list(getattr(back, field)) == list(getattr(state, field)), (seq, field)
        assert back.occurrences == state.occurrences
        assert back.intents == state.intents
    assert any(c.chunks for c in (back.calls, back.messages))  # chunks were written and read


async def test_racing_writers_leave_one_snapshot_whose_chunks_are_all_there(
    client: Client,
) -> None:
    """Writers at the same and at different seqs at once (a worker and a zombie that lost the
    run, both hosting it from the same snapshot): the newest wins, every chunk it names is
    stored, no other chunk is left, and it reads back as the fold up to its seq."""
    import anyio

    events = _hostile_journal()
    await client.spawn(app.Counter, "race/1")
    start = RunState()
    for event in events[:20]:
        start = fold(start, event)
    first = encode(start, 20)
    assert await write(client.pool, "race/1", SNAPSHOT_VERSION, 20, first)
    base, folded = first.state, {20: start}
    states = {}
    for seq in (40, 60, 80):
        state, whole = base, folded[20]
        for event in events[20:seq]:
            state, whole = fold(state, event), fold(whole, event)
        states[seq], folded[seq] = state, whole
    won: list[int] = []

    async def writer(seq: int) -> None:
        snap = encode(states[seq], seq)  # each writer its own chunks (its own tag)
        if await write(client.pool, "race/1", SNAPSHOT_VERSION, seq, snap):
            won.append(seq)

    async with anyio.create_task_group() as tg:
        for seq in (60, 80, 40, 80, 60, 40):
            tg.start_soon(writer, seq)
    assert won.count(80) == 1  # of two writers at one seq, one
    async with client.pool.acquire() as conn, conn.transaction(isolation="repeatable_read"):
        row = await conn.fetchrow("SELECT seq, state FROM toren.snapshots WHERE actor_id = $1",
                                  "race/1")  # fmt: skip
        stored = {r["key"] for r in await conn.fetch(
            "SELECT key FROM toren.snapshot_chunks WHERE actor_id = $1", "race/1")}  # fmt: skip
        found = await read(conn, "race/1", RunState, SNAPSHOT_VERSION)
    assert row["seq"] == 80
    # Each History's chunks, and each Ledger's (under "values").
    parts = [v.get("values", v) for v in row["state"].values() if isinstance(v, dict)]
    named = {c[0] for v in parts if isinstance(v, dict) and "chunks" in v for c in v["chunks"]}
    assert named == stored
    assert found is not None
    assert found[1] == 80
    assert found[0] == folded[80]


def test_a_snapshot_of_a_long_run_costs_what_was_added_not_the_run() -> None:
    """A run whose tools return a few kilobytes: snapshots written every 1,000 events as a
    worker writes them (each from the state the previous one left) cost about the same, the
    sixth as the first (the issue's promise: cost that stays flat as a run grows)."""
    import attrs as attrs_

    from bench.fold import step_events
    from toren._core.json_text import dumps
    from toren.runs import RunStarted, ToolResulted

    result = "r" * 4096
    state = fold(RunState(), RunStarted(agent="a", input="go", at=1.0))
    seq, costs = 1, []
    for i in range(1, 2001):
        for event in step_events(i, digest="d", messages_len=2 * i - 1):
            if isinstance(event, ToolResulted):
                event = attrs_.evolve(event, content=f"{result}{i}")
            state, seq = fold(state, event), seq + 1
            if seq % 1000 == 0:
                snap = encode(state, seq)
                costs.append(len(dumps(snap.row)) + sum(len(d) for _, d in snap.chunks))
                state = snap.state
    assert len(costs) == 6
    assert costs[-1] < 2 * costs[0], costs


async def test_a_snapshot_past_the_journals_end_is_set_aside(
    client: Client, long_run: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Journal rows deleted by hand behind a snapshot: the snapshot is not this journal's (a
    state from it would leave a gap at the next commit); the journal that is there decides."""
    snapshot_seq = await client.pool.fetchval(
        "SELECT seq FROM toren.snapshots WHERE actor_id = $1", long_run
    )
    await client.pool.execute(
        "DELETE FROM toren.journal WHERE actor_id = $1 AND seq >= $2", long_run, snapshot_seq
    )
    with caplog.at_level(logging.WARNING, logger="toren.snapshots"):
        rebuilt = await replay(
            client.pool, long_run, RunState(), fold, snapshots=(RunState, SNAPSHOT_VERSION)
        )
    assert rebuilt.seq == snapshot_seq - 1
    assert rebuilt.snapshot_seq == 0
    assert rebuilt.state == await _whole(client, long_run)
    assert "past the journal's end" in caplog.text
