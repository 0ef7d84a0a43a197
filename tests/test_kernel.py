"""The actor kernel in one process: sends, asks, dedupe, depth limits, lanes, passivation."""

from __future__ import annotations

import gc

import anyio
import pytest

from tests import app
from tests.conftest import running_worker, wait_for
from toren import Client, MailboxFull, UnknownActor

pytestmark = pytest.mark.anyio


async def total(client: Client, actor_id: str) -> int:
    state, _ = await client.state(actor_id)
    return int(state.total)


async def test_messages_sent_are_handled_and_journaled_in_order(
    client: Client, db_url: str
) -> None:
    await client.spawn(app.Counter, "c/1")
    for i in range(5):
        await client.send("c/1", app.Add(n=i, tag=f"t{i}"))
    async with running_worker(db_url):
        await wait_for(lambda: _eq(total(client, "c/1"), 10), what="total 10")
    journal = await client.journal("c/1")
    assert [e.seq for e in journal] == [1, 2, 3, 4, 5]
    assert [e.data["tag"] for e in journal] == ["t0", "t1", "t2", "t3", "t4"]


async def _eq(value_coro, expected):  # type: ignore[no-untyped-def]
    return (await value_coro) == expected


async def test_ask_returns_the_reply(client: Client, db_url: str) -> None:
    await client.spawn(app.Counter, "c/ask")
    await client.send("c/ask", app.Add(n=7, tag="a"))
    async with running_worker(db_url):
        with anyio.fail_after(10):
            reply = await client.ask("c/ask", app.Get(), timeout=10)
    assert reply == {"total": 7}


async def test_dedupe_key_makes_a_repeated_send_a_no_op(client: Client, db_url: str) -> None:
    await client.spawn(app.Counter, "c/dd")
    first = await client.send("c/dd", app.Add(n=1, tag="x"), dedupe_key="k1")
    second = await client.send("c/dd", app.Add(n=1, tag="x"), dedupe_key="k1")
    assert first is not None
    assert second is None
    async with running_worker(db_url):
        await wait_for(lambda: _eq(total(client, "c/dd"), 1))
        # Consumed messages keep their key: a late retry is still a no-op.
        assert await client.send("c/dd", app.Add(n=1, tag="x"), dedupe_key="k1") is None


async def test_send_beyond_the_depth_limit_raises_mailbox_full(client: Client) -> None:
    await client.spawn(app.Counter, "c/full", max_depth=2)
    await client.send("c/full", app.Add(n=1, tag="a"))
    await client.send("c/full", app.Add(n=1, tag="b"))
    with pytest.raises(MailboxFull) as info:
        await client.send("c/full", app.Add(n=1, tag="c"))
    assert info.value.depth == 2
    # The system lane is not subject to the user depth limit.
    await client.send("c/full", app.Get(), system=True)


async def test_send_to_an_unknown_actor_raises(client: Client) -> None:
    with pytest.raises(UnknownActor):
        await client.send("nobody", app.Add(n=1, tag="a"))


async def test_system_lane_is_drained_before_user_messages(client: Client, db_url: str) -> None:
    await client.spawn(app.Counter, "c/lanes")
    await client.send("c/lanes", app.Add(n=1, tag="user-1"))
    await client.send("c/lanes", app.Add(n=1, tag="user-2"))
    await client.send("c/lanes", app.Add(n=1, tag="system"), system=True)
    async with running_worker(db_url):
        await wait_for(lambda: _eq(total(client, "c/lanes"), 3))
    tags = [e.data["tag"] for e in await client.journal("c/lanes")]
    assert tags == ["system", "user-1", "user-2"]


async def test_a_send_joins_the_callers_transaction(client: Client, db_url: str) -> None:
    import asyncpg

    await client.spawn(app.Counter, "c/tx")
    conn = await asyncpg.connect(db_url)  # the application's own connection, no Toren codecs
    try:
        tx = conn.transaction()
        await tx.start()
        await client.send("c/tx", app.Add(n=1, tag="rolled-back"), conn=conn)
        await tx.rollback()
        async with conn.transaction():
            await client.send("c/tx", app.Add(n=1, tag="kept"), conn=conn)
    finally:
        await conn.close()
    kinds = await client.pool.fetch("SELECT body->>'tag' AS tag FROM toren.mailbox")
    assert [r["tag"] for r in kinds] == ["kept"]


async def test_idle_actor_passivates_and_leaves_no_object_behind(
    client: Client, db_url: str
) -> None:
    app.live_objects.clear()
    await client.spawn(app.Tracked, "t/1")

    async def journal_length() -> int:  # reading the journal creates no actor object
        return len(await client.journal("t/1"))

    async with running_worker(db_url) as worker:
        await client.send("t/1", app.Add(n=1, tag="a"))
        await wait_for(lambda: _eq(journal_length(), 1))
        assert any(ref() is not None for ref in app.live_objects)

        async def passivated() -> bool:
            row = await client.actor("t/1")
            return row["owner"] is None and "t/1" not in worker.hosts.hosts

        await wait_for(passivated, what="passivation")
        await anyio.sleep(0.05)
        gc.collect()
        assert [ref() for ref in app.live_objects] == [None]

        # New mail re-activates it, with its state rebuilt from the journal.
        await client.send("t/1", app.Add(n=2, tag="b"))
        await wait_for(lambda: _eq(journal_length(), 2))
        assert len(app.live_objects) == 2


async def test_snapshots_shorten_the_replay(client: Client, db_url: str) -> None:
    await client.spawn(app.SnapshotCounter, "s/1")
    for i in range(25):
        await client.send("s/1", app.Add(n=1, tag=f"t{i}"))
    async with running_worker(db_url):
        await wait_for(lambda: _eq(total(client, "s/1"), 25))
        snap = await client.pool.fetchrow("SELECT seq, state FROM toren.snapshots")
        assert snap["seq"] == 20
        assert snap["state"]["total"] == 20
        # Rebuild after passivation goes through the snapshot and gives the same state.
        await wait_for(lambda: _owner_is_none(client, "s/1"), what="passivation")
        await client.send("s/1", app.Add(n=1, tag="t25"))
        await wait_for(lambda: _eq(total(client, "s/1"), 26))
    journal = await client.journal("s/1")
    assert [e.seq for e in journal] == list(range(1, 27))


async def _owner_is_none(client: Client, actor_id: str) -> bool:
    return (await client.actor(actor_id))["owner"] is None


async def test_worker_stops_claiming_at_its_cap(client: Client, db_url: str) -> None:
    for i in range(5):
        await client.spawn(app.Worker, f"cap/{i}")
        await client.send(f"cap/{i}", app.Work(seconds=0.3, tag=f"t{i}"))
    peak = 0
    async with running_worker(db_url, max_actors=2) as worker:

        async def all_done() -> bool:
            nonlocal peak
            peak = max(peak, len(worker.hosts))
            owned = await client.pool.fetchval(
                "SELECT count(*) FROM toren.actors WHERE owner IS NOT NULL"
            )
            assert owned <= 2
            done = await client.pool.fetchval("SELECT count(*) FROM toren.journal")
            return done == 5

        await wait_for(all_done, interval=0.02, what="all five handled")
    assert peak == 2


async def test_housekeeping_forgets_old_dedupe_keys_and_replies(client: Client) -> None:
    from toren.kernel import housekeep

    await client.spawn(app.Counter, "c/hk")
    await client.send("c/hk", app.Add(n=1, tag="a"), dedupe_key="old")
    await client.send("c/hk", app.Add(n=1, tag="b"), dedupe_key="new")
    await client.pool.execute(
        "UPDATE toren.dedupe SET created_at = now() - interval '8 days' WHERE key = 'old'"
    )
    await client.pool.execute(
        "INSERT INTO toren.replies (correlation_id, kind, body, created_at) "
        "VALUES (gen_random_uuid(), 'json', '{}', now() - interval '2 hours')"
    )
    from toren._surfaces.tokens import authenticate, create_token, open_session

    _, token = await create_token(client.pool, "ops")
    access = await authenticate(client.pool, token)
    assert access is not None
    await open_session(client.pool, access)
    await open_session(client.pool, access)
    await client.pool.execute(
        "UPDATE toren.sessions SET expires_at = now() - interval '1 second' "
        "WHERE ctid = (SELECT min(ctid) FROM toren.sessions)"
    )
    done = await housekeep(client.pool, dedupe_retention=7 * 86400)
    assert done["keys"] == 1
    assert done["replies"] == 1
    assert done["sessions"] == 1  # the expired console session, not the live one
    assert await client.send("c/hk", app.Add(n=1, tag="a2"), dedupe_key="old") is not None
    assert await client.send("c/hk", app.Add(n=1, tag="b2"), dedupe_key="new") is None


async def test_a_dedicated_connection_cancelled_while_it_is_set_up_is_closed(
    db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker stopped as it starts cancels its death watch and listener mid-connect: the
    connection is closed then, never left to the garbage collector (a ResourceWarning that
    failed whichever test ran next, on a loaded machine)."""
    import toren._core.db
    from toren._core.workers import open_death_watch

    opened = []
    setup = toren._core.db.init_connection

    async def slow_setup(conn: object) -> None:
        opened.append(conn)
        await setup(conn)
        await anyio.sleep_forever()

    monkeypatch.setattr(toren._core.db, "init_connection", slow_setup)
    with anyio.move_on_after(0.5):
        await toren._core.db.connect(db_url)
    with anyio.move_on_after(0.5):
        await open_death_watch(db_url, recheck=1.0)
    assert len(opened) == 2
    assert all(conn.is_closed() for conn in opened)  # type: ignore[attr-defined]
