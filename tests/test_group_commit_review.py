"""Review of group commit (issue 33): attacks on the batch path with a real Postgres."""

from __future__ import annotations

import random
from typing import Any

import anyio
import asyncpg
import pytest

from tests.conftest import wait_for
from tests.test_group_commit import _batched, _steps, _true
from toren import Client, UnknownActor
from toren._core.group_commit import BatchOutcomeUnknown, GroupCommit

pytestmark = pytest.mark.anyio


async def test_a_failing_member_leaves_nothing_of_its_batch_mates_committed(
    client: Client, db_url: str
) -> None:
    # If the batch had committed the members before the failing one, their commits alone
    # would find their messages gone and raise FencedOut: every other member returns cleanly.
    first, *rest = ids = [f"r/fail/{i}" for i in range(6)]
    async with _steps(client, db_url, lanes=1) as steps:
        await steps.take(ids)
        batch = {
            a: (lambda a=a: steps.commit(a, to="nobody" if a == "r/fail/4" else None)) for a in rest
        }
        results = await _batched(steps, first, batch)
        assert steps.commits.batches == 1
        assert isinstance(results["r/fail/4"], UnknownActor)
        assert all(not isinstance(results[a], Exception) for a in ids if a != "r/fail/4"), results


async def test_a_key_with_a_lone_surrogate_fails_its_own_step_only(
    client: Client, db_url: str
) -> None:
    # A dedupe key with a lone surrogate (a handler's own key, from untrusted text): the server
    # refuses it (a PostgresError of class 22), the batch rolls back, the others commit alone.
    first, *rest = ids = [f"r/enc/{i}" for i in range(5)]
    async with _steps(client, db_url, lanes=1) as steps:
        await steps.take(ids)
        bad = "r/enc/2"

        async def commit(a: str) -> Any:
            if a != bad:
                return await steps.commit(a)
            from tests import app
            from toren._core.actor import Context
            from toren._core.mailbox import commit_step

            actor = app.Counter(a, {})
            envelope = steps.envelopes[a]
            ctx = Context(actor, actor.initial_state(), 0, steps.epochs[a], envelope)
            ctx.emit(app.Added(n=1, tag=a, message_id=envelope.id))
            ctx.send(first, app.Add(n=1, tag="x"), dedupe_key="bad\ud800key")
            return await commit_step(
                client.pool, steps.session.worker_id, envelope, ctx, via=steps.commits
            )

        results = await _batched(steps, first, {a: (lambda a=a: commit(a)) for a in rest})
        assert steps.commits.batches == 1
        assert isinstance(results[bad], asyncpg.DataError), results
        others = {a: results[a] for a in rest if a != bad}
        assert not any(isinstance(r, BatchOutcomeUnknown) for r in others.values()), others


async def test_lanes_are_never_leaked_under_random_cancellation(client: Client) -> None:
    commits = GroupCommit(client.pool, lanes=2, max_batch=5)
    rng = random.Random(33)
    got: dict[int, int] = {}
    unknown: list[int] = []

    async def one(n: int, patience: float) -> None:
        with anyio.move_on_after(patience):
            try:
                row = await commits.fetchrow("SELECT $1::int AS n, pg_sleep(0.002)", [n])
            except BatchOutcomeUnknown:  # its batch's leader was cancelled
                unknown.append(n)
                return
            assert row is not None
            got[n] = row["n"]

    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg:
            for n in range(300):
                tg.start_soon(one, n, rng.choice([0.0005, 0.002, 0.005, 0.02, 10.0]))
                if n % 7 == 0:
                    await anyio.sleep(rng.choice([0, 0.001, 0.003]))
    assert all(got[n] == n for n in got)
    assert commits._busy == 0
    assert not commits._queue
    # Batches formed, some were cut by a cancelled leader, and the rest answered.
    assert commits.batches > 0
    assert got
    assert unknown
    # And the lanes still serve.
    row = await commits.fetchrow("SELECT $1::int AS n", [7])
    assert row is not None
    assert row["n"] == 7
    assert commits._busy == 0


async def test_a_leader_cancelled_mid_batch_leaves_members_unknown_and_retry_finds_each_once(
    client: Client, db_url: str
) -> None:
    ids = [f"r/lead/{i}" for i in range(5)]
    holder, leader, *members = ids
    async with _steps(client, db_url, lanes=1) as steps:
        await steps.take(ids)
        out: dict[str, Any] = {}
        scopes: dict[str, anyio.CancelScope] = {}

        async def one(a: str) -> None:
            with anyio.CancelScope() as scope:
                scopes[a] = scope
                try:
                    out[a] = await steps.commit(a)
                except Exception as exc:
                    out[a] = exc
                return
            out[a] = "cancelled"

        async with client.pool.acquire() as conn, client.pool.acquire() as locker:
            tx = conn.transaction()
            await tx.start()
            await conn.execute("SELECT 1 FROM toren.actors WHERE actor_id = $1 FOR UPDATE", holder)
            ltx = locker.transaction()
            await ltx.start()
            # The batch's second statement waits on this lock: the batch is in flight.
            await locker.execute(
                "SELECT 1 FROM toren.actors WHERE actor_id = $1 FOR UPDATE", members[0]
            )
            async with anyio.create_task_group() as tg:
                tg.start_soon(one, holder)
                await wait_for(lambda: _true(steps.commits._busy == 1), what="lane held")
                for a in (leader, *members):
                    tg.start_soon(one, a)
                await wait_for(lambda: _true(len(steps.commits._queue) == 4), what="queued")
                await tx.rollback()
                await wait_for(lambda: _true(steps.commits.batches == 1), what="batch sent")
                await wait_for(
                    lambda: client.pool.fetchval(
                        "SELECT count(*) > 0 FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
                    ),
                    what="the batch waiting",
                )
                scopes[leader].cancel()
                await wait_for(lambda: _true(all(m in out for m in members)), what="told")
                await ltx.rollback()
        assert out[leader] == "cancelled"
        assert all(isinstance(out[m], BatchOutcomeUnknown) for m in members), out
        assert steps.commits._busy == 0
        for a in members:
            await steps.commit(a, retry=True)
        for a in (holder, *members):
            assert len(await client.journal(a)) == 1


async def test_a_batch_and_its_workers_lease_renewal_do_not_deadlock(
    client: Client, db_url: str
) -> None:
    # A batch share-locks its members' actor rows one statement after another, in queue order,
    # and holds them to its commit; the worker's lease renewal updates the same rows, in its own
    # order. A lone step holds one actor row; a batch holds several: renewal holding A and
    # waiting for B, while the batch holds B and waits for A, is a deadlock.
    from toren._core.leases import renew

    holder, b, c, a = ids = [f"r/dl/{x}" for x in ("h", "b", "c", "a")]
    async with _steps(client, db_url, lanes=1) as steps:
        await steps.take(ids)
        out: dict[str, Any] = {}

        async def one(name: str) -> None:
            try:
                out[name] = await steps.commit(name)
            except Exception as exc:
                out[name] = exc

        async def renewal() -> None:
            try:
                out["renewal"] = await renew(
                    client.pool,
                    steps.session.worker_id,
                    [(a, steps.epochs[a]), (b, steps.epochs[b])],
                    lease=30,
                    stats={},
                )
            except Exception as exc:
                out["renewal"] = exc

        async def waiting(n: int) -> bool:
            found = await client.pool.fetchval(
                "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
            )
            return bool(found >= n)

        async with client.pool.acquire() as x, client.pool.acquire() as y:
            xt, yt = x.transaction(), y.transaction()
            await xt.start()
            await yt.start()
            await x.execute("SELECT 1 FROM toren.actors WHERE actor_id = $1 FOR UPDATE", holder)
            await y.execute("SELECT 1 FROM toren.actors WHERE actor_id = $1 FOR UPDATE", c)
            with anyio.fail_after(30):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(one, holder)
                    await wait_for(lambda: _true(steps.commits._busy == 1), what="lane held")
                    for n, name in enumerate((b, c, a), start=1):
                        tg.start_soon(one, name)
                        await wait_for(
                            lambda n=n: _true(len(steps.commits._queue) == n), what="queued"
                        )
                    await xt.rollback()  # the holder commits; the batch b, c, a goes
                    await wait_for(lambda: waiting(1), what="the batch holding b, waiting on c")
                    tg.start_soon(renewal)
                    await wait_for(lambda: waiting(2), what="the renewal holding a, waiting on b")
                    await yt.rollback()
    assert not isinstance(out["renewal"], Exception), out
    assert not any(isinstance(out[n], Exception) for n in (b, c, a)), out


async def test_a_failed_batch_commits_its_steps_one_by_one_on_its_own_lane(client: Client) -> None:
    # After a failed batch, its members run their statements again alone: one after another on
    # the lane the batch held, never all at once (they would take the pool's connections from
    # the claims and the lease renewals). Each is told its own row, the failing one its error.
    tag = "/* one-by-one */"
    others = (
        f"SELECT count(*) FROM pg_stat_activity WHERE query LIKE '{tag}%%' AND state = 'active'"
    )
    step = f"{tag} SELECT $1::int AS n, 1 / $2::int AS q, pg_sleep(0.01), ({others}) AS running"
    commits = GroupCommit(client.pool, lanes=1, max_batch=32)
    results: dict[int, Any] = {}

    async def one(n: int) -> None:
        try:
            results[n] = await commits.fetchrow(step, [n, 0 if n == 5 else 1])
        except Exception as exc:
            results[n] = exc

    async with anyio.create_task_group() as tg:
        tg.start_soon(commits.fetchrow, "SELECT pg_sleep(1)", [])
        await wait_for(_holding(commits, busy=1), what="a step holds the lane")
        for n in range(1, 12):
            tg.start_soon(one, n)
        await wait_for(_holding(commits, busy=1, queued=11), what="the steps queued")
    assert (commits.batches, commits.batched) == (1, 11)
    assert isinstance(results[5], asyncpg.DivisionByZeroError), results[5]
    rows = [results[n] for n in range(1, 12) if n != 5]
    assert [r["n"] for r in rows] == [n for n in range(1, 12) if n != 5]
    assert max(r["running"] for r in rows) == 1, [r["running"] for r in rows]
    assert (commits._busy, len(commits._queue)) == (0, 0)


async def test_steps_of_another_statement_are_not_sent_in_a_batch_of_the_first(
    client: Client,
) -> None:
    commits = GroupCommit(client.pool, lanes=1, max_batch=32)
    results: dict[int, Any] = {}

    async def one(n: int, statement: str) -> None:
        results[n] = await commits.fetchrow(statement, [n])

    async with anyio.create_task_group() as tg:
        tg.start_soon(one, 0, "SELECT $1::int AS n, pg_sleep(1), 'a' AS s")
        await wait_for(_holding(commits, busy=1), what="a step holds the lane")
        for n in range(1, 7):
            tg.start_soon(one, n, f"SELECT $1::int AS n, '{'ab'[n % 2]}' AS s")
        await wait_for(_holding(commits, busy=1, queued=6), what="the steps queued")
    assert {n: r["s"] for n, r in results.items()} == {0: "a"} | {
        n: "ab"[n % 2] for n in range(1, 7)
    }


def _holding(commits: GroupCommit, *, busy: int, queued: int = 0) -> Any:
    async def check() -> bool:
        return commits._busy == busy and len(commits._queue) == queued

    return check
