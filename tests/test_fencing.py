"""Fencing at the statement level: a stale epoch can neither consume, append, nor renew."""

from __future__ import annotations

import uuid

import asyncpg
import pytest

from tests import app
from toren import Client, FencedOut, Settings
from toren._core.actor import Context
from toren._core.leases import claim, release, renew
from toren._core.mailbox import claim_next, commit_step, open_envelope
from toren._core.migrate import available, migrate
from toren._core.session import WorkerSession
from toren._core.workers import live_workers

pytestmark = pytest.mark.anyio

KINDS = [app.Counter.kind]


async def _session(db_url: str) -> WorkerSession:
    return await WorkerSession.open(db_url, Settings(database_url=db_url))


async def test_a_newer_claim_fences_out_the_old_owners_step(client: Client, db_url: str) -> None:
    await client.spawn(app.Counter, "c/f")
    await client.send("c/f", app.Add(n=1, tag="a"))
    first, second = await _session(db_url), await _session(db_url)
    try:
        [c1] = await claim(client.pool, first.worker_id, limit=10, lease=30, kinds=KINDS, hosted=[])
        envelope = await claim_next(client.pool, "c/f", first.worker_id, c1.epoch)
        assert envelope is not None
        # The first owner's session dies; the second worker claims and raises the epoch.
        await first.conn.close()
        [c2] = await claim(
            client.pool, second.worker_id, limit=10, lease=30, kinds=KINDS, hosted=[]
        )
        assert c2.epoch == c1.epoch + 1

        actor = app.Counter("c/f", {})
        opened = open_envelope(envelope)
        ctx = Context(actor, actor.initial_state(), 0, c1.epoch, opened)
        ctx.emit(app.Added(n=1, tag="a", message_id=opened.id))
        with pytest.raises(FencedOut):
            await commit_step(client.pool, first.worker_id, opened, ctx)
        with pytest.raises(FencedOut):
            await claim_next(client.pool, "c/f", first.worker_id, c1.epoch)
        assert await client.journal("c/f") == []
        assert await client.pool.fetchval("SELECT count(*) FROM toren.mailbox") == 1

        # The new owner's step goes through.
        ctx2 = Context(actor, actor.initial_state(), 0, c2.epoch, opened)
        ctx2.emit(app.Added(n=1, tag="a", message_id=opened.id))
        await commit_step(client.pool, second.worker_id, opened, ctx2)
        [entry] = await client.journal("c/f")
        assert entry.epoch == c2.epoch
    finally:
        await second.close()


async def test_the_journal_primary_key_refuses_a_second_write_of_a_seq(
    client: Client, db_url: str
) -> None:
    await client.spawn(app.Counter, "c/pk")
    await client.pool.execute(
        "INSERT INTO toren.journal (actor_id, seq, epoch, type, data) "
        "VALUES ('c/pk', 1, 1, 'test.added', '{}')"
    )
    with pytest.raises(asyncpg.UniqueViolationError):
        await client.pool.execute(
            "INSERT INTO toren.journal (actor_id, seq, epoch, type, data) "
            "VALUES ('c/pk', 1, 2, 'test.added', '{}')"
        )


async def test_claims_skip_actors_of_live_workers_and_take_those_of_dead_ones(
    client: Client, db_url: str
) -> None:
    await client.spawn(app.Counter, "c/d")
    await client.send("c/d", app.Add(n=1, tag="a"))
    owner, other = await _session(db_url), await _session(db_url)
    try:
        [c1] = await claim(client.pool, owner.worker_id, limit=10, lease=30, kinds=KINDS, hosted=[])
        assert (
            await claim(client.pool, other.worker_id, limit=10, lease=30, kinds=KINDS, hosted=[])
            == []
        )
        assert {r["worker_id"] for r in await live_workers(client.pool)} == {
            owner.worker_id,
            other.worker_id,
        }
        await owner.conn.close()  # the process "dies": its lock goes with its session
        [c2] = await claim(client.pool, other.worker_id, limit=10, lease=30, kinds=KINDS, hosted=[])
        assert (c2.actor_id, c2.epoch) == ("c/d", c1.epoch + 1)
        # The dead incarnation's renewal finds its claim gone; the taker's holds.
        stale = [("c/d", c1.epoch)]
        assert await renew(client.pool, owner.worker_id, stale, lease=30, stats={}) == set()
        fresh = [("c/d", c2.epoch)]
        assert await renew(client.pool, other.worker_id, fresh, lease=30, stats={}) == set(fresh)
        assert await release(client.pool, other.worker_id) == 1
    finally:
        await other.close()


async def test_a_worker_without_its_lock_claims_nothing(client: Client, db_url: str) -> None:
    await client.spawn(app.Counter, "c/n")
    await client.send("c/n", app.Add(n=1, tag="a"))
    assert await claim(client.pool, uuid.uuid4(), limit=10, lease=30, kinds=KINDS, hosted=[]) == []


async def test_two_processes_migrating_at_once_both_succeed(empty_db_url: str) -> None:
    import anyio

    results: list[list[int]] = []

    async def run() -> None:
        conn = await asyncpg.connect(empty_db_url)
        try:
            results.append(await migrate(conn))
        finally:
            await conn.close()

    async with anyio.create_task_group() as tg:
        for _ in range(3):
            tg.start_soon(run)
    # Each migration is applied once, by whichever process takes its lock first, in order (a
    # process reaches a version only once the one before it is applied).
    every = [version for version, _, _ in available()]
    assert sorted(v for applied in results for v in applied) == every
    assert all(applied == sorted(applied) for applied in results)


async def test_a_worker_claims_only_kinds_it_knows_and_never_what_it_hosts(
    client: Client, db_url: str
) -> None:
    await client.spawn(app.Counter, "c/k")
    await client.send("c/k", app.Add(n=1, tag="a"))
    session = await _session(db_url)
    try:
        assert (
            await claim(client.pool, session.worker_id, limit=10, lease=30, kinds=["x"], hosted=[])
            == []
        )
        [c1] = await claim(
            client.pool, session.worker_id, limit=10, lease=30, kinds=KINDS, hosted=[]
        )
        await client.pool.execute(
            "UPDATE toren.actors SET lease_expires_at = now() - interval '1s'"
        )
        # Its own expired lease is renewed, not re-claimed, while it hosts the actor...
        hosted = ["c/k"]
        assert (
            await claim(
                client.pool, session.worker_id, limit=10, lease=30, kinds=KINDS, hosted=hosted
            )
            == []
        )
        mine = [("c/k", c1.epoch)]
        assert await renew(client.pool, session.worker_id, mine, lease=30, stats={}) == set(mine)
        # ...but an actor it owns and no longer hosts (a lost release) is claimed again.
        [c2] = await claim(
            client.pool, session.worker_id, limit=10, lease=30, kinds=KINDS, hosted=[]
        )
        assert (c2.actor_id, c2.epoch) == ("c/k", c1.epoch + 1)
    finally:
        await session.close()


async def test_a_commit_retried_after_its_answer_was_lost_is_recognised(
    client: Client, db_url: str
) -> None:
    await client.spawn(app.Counter, "c/r")
    await client.send("c/r", app.Add(n=1, tag="a"))
    owner = await _session(db_url)
    try:
        [c] = await claim(client.pool, owner.worker_id, limit=10, lease=30, kinds=KINDS, hosted=[])
        envelope = await claim_next(client.pool, "c/r", owner.worker_id, c.epoch)
        assert envelope is not None
        actor = app.Counter("c/r", {})
        opened = open_envelope(envelope)
        ctx = Context(actor, actor.initial_state(), 0, c.epoch, opened)
        ctx.emit(app.Added(n=1, tag="a", message_id=opened.id))
        await commit_step(client.pool, owner.worker_id, opened, ctx)
        # The first answer was lost (say): committing the same step again changes nothing...
        await commit_step(client.pool, owner.worker_id, opened, ctx, retry=True)
        assert len(await client.journal("c/r")) == 1
        # ...but a first attempt that finds its message gone is not ours to claim as landed.
        with pytest.raises(FencedOut):
            await commit_step(client.pool, owner.worker_id, opened, ctx)
        # And a retry by an owner that lost the actor is fenced out, not taken as landed.
        await client.pool.execute("UPDATE toren.actors SET epoch = epoch + 1")
        with pytest.raises(FencedOut):
            await commit_step(client.pool, owner.worker_id, opened, ctx, retry=True)
    finally:
        await owner.close()


async def test_a_watchers_shared_lock_does_not_keep_a_dead_worker_alive(
    client: Client, db_url: str
) -> None:
    from toren._core.session import LOCK_NAMESPACE

    dead = await _session(db_url)
    await dead.conn.close()  # dies without deregistering
    watcher = await asyncpg.connect(db_url)
    try:
        # A death watch waiting on the dead worker's lock is granted it, shared, at the death.
        await watcher.execute(
            "SELECT pg_advisory_lock_shared($1, $2)", LOCK_NAMESPACE, dead.lock_key
        )
        assert dead.worker_id not in {r["worker_id"] for r in await live_workers(client.pool)}
    finally:
        await watcher.close()


async def _claimed_step(
    client: Client, db_url: str, actor_id: str
) -> tuple[WorkerSession, int, Context[app.CounterState], app.Counter]:
    """Claim ``actor_id``'s first message and handle it (nothing committed yet)."""
    owner = await _session(db_url)
    [c] = await claim(client.pool, owner.worker_id, limit=10, lease=30, kinds=KINDS, hosted=[])
    envelope = await claim_next(client.pool, actor_id, owner.worker_id, c.epoch)
    assert envelope is not None
    actor = app.Counter(actor_id, {})
    opened = open_envelope(envelope)
    ctx = Context(actor, actor.initial_state(), 0, c.epoch, opened)
    ctx.emit(app.Added(n=opened.payload.n, tag=opened.payload.tag, message_id=opened.id))
    return owner, c.epoch, ctx, actor


async def _deliveries(client: Client, actor_id: str) -> list[tuple[str, int]]:
    rows = await client.pool.fetch(
        "SELECT body->>'tag' AS tag, deliveries FROM toren.mailbox WHERE actor_id = $1 ORDER BY id",
        actor_id,
    )
    return [(r["tag"], r["deliveries"]) for r in rows]


async def test_a_commit_claims_the_next_queued_message_system_lane_first(
    client: Client, db_url: str
) -> None:
    await client.spawn(app.Counter, "c/n")
    await client.send("c/n", app.Add(n=1, tag="a"))
    owner, epoch, ctx, _ = await _claimed_step(client, db_url, "c/n")
    try:
        await client.send("c/n", app.Add(n=2, tag="b"))
        await client.send("c/n", app.Add(n=3, tag="sys"), system=True)
        assert ctx.envelope is not None
        following = await commit_step(client.pool, owner.worker_id, ctx.envelope, ctx, claim=True)
        # The same statement consumed "a" and claimed the system-lane message, its delivery
        # counted before it is handled, exactly as claim_next would have.
        assert following is not None
        assert following.payload is None
        assert open_envelope(following).payload.tag == "sys"
        assert following.deliveries == 1
        assert await _deliveries(client, "c/n") == [("b", 0), ("sys", 1)]
        assert [e.type for e in await client.journal("c/n")] == ["test.added"]
        # Without claim, nothing is claimed.
        actor = app.Counter("c/n", {})
        ctx2 = Context(actor, actor.initial_state(), 1, epoch, open_envelope(following))
        ctx2.emit(app.Added(n=3, tag="sys", message_id=following.id))
        assert await commit_step(client.pool, owner.worker_id, ctx2.envelope, ctx2) is None
        assert await _deliveries(client, "c/n") == [("b", 0)]
    finally:
        await owner.close()


async def test_a_commit_claims_the_message_the_step_sends_itself_when_none_is_queued(
    client: Client, db_url: str
) -> None:
    await client.spawn(app.Counter, "c/s")
    await client.send("c/s", app.Add(n=1, tag="a"))
    owner, _, ctx, _ = await _claimed_step(client, db_url, "c/s")
    try:
        ctx.send("c/s", app.Add(n=2, tag="next"))
        ctx.send("c/s", app.Add(n=3, tag="after"))
        ctx.set_timer("later", 60, app.Add(n=4, tag="timer"))
        assert ctx.envelope is not None
        following = await commit_step(client.pool, owner.worker_id, ctx.envelope, ctx, claim=True)
        assert following is not None
        assert open_envelope(following).payload.tag == "next"
        assert following.deliveries == 1
        # Only the first due message it sent itself was inserted claimed.
        assert await _deliveries(client, "c/s") == [("next", 1), ("after", 0), ("timer", 0)]
    finally:
        await owner.close()


async def test_a_commit_does_not_claim_a_timer_the_step_replaces(
    client: Client, db_url: str
) -> None:
    await client.spawn(app.Counter, "c/t")
    await client.send("c/t", app.Add(n=1, tag="a"))
    owner, _, ctx, _ = await _claimed_step(client, db_url, "c/t")
    try:
        # A due timer is queued; the step replaces it with a later one.
        await client.pool.execute(
            "INSERT INTO toren.mailbox (actor_id, kind, body, timer_name) "
            "VALUES ('c/t', 'test.add', '{\"n\": 9, \"tag\": \"due\"}', 'tick')"
        )
        ctx.set_timer("tick", 60, app.Add(n=5, tag="later"))
        assert ctx.envelope is not None
        following = await commit_step(client.pool, owner.worker_id, ctx.envelope, ctx, claim=True)
        assert following is None
        assert await _deliveries(client, "c/t") == [("later", 0)]
    finally:
        await owner.close()
