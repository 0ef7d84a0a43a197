"""Run snapshots in Postgres: written by the worker as a run goes, read by every reader, and never
able to change what a run is (a lost race, a damaged or foreign snapshot: the journal decides).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

import pytest

import toren.providers.anthropic  # noqa: F401  (the SDK import, paid once)
from tests.conftest import running_worker, wait_for
from toren import Client
from toren._app import load_app
from toren._journal import replay
from toren._model import Text, ToolCall
from toren._snapshots import encode, read, write
from toren.actors.run import close_providers
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
        try:
            async with running_worker(db_url, snapshot_every=4):
                run_id = await start_run(client, "support", "many tickets")

                async def completed() -> bool:
                    return (await read_run(client, run_id)).status == "completed"

                await wait_for(completed, timeout=60, what="the long run")
            yield run_id
        finally:
            await close_providers()


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
