"""Group commit: steps of many actors in one transaction, each fenced and failing on its own.

Batches are made to form by holding the worker's one commit lane: its first step waits on a row
lock held by another connection, and the steps that arrive meanwhile queue behind it and go
together once it commits.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import anyio
import pytest

from tests import app
from tests.conftest import wait_for
from toren import Client, FencedOut, InternalError, Settings, UnknownActor
from toren._core.actor import Context, Envelope
from toren._core.group_commit import BatchOutcomeUnknown, GroupCommit
from toren._core.leases import claim
from toren._core.mailbox import claim_next, commit_step, open_envelope
from toren._core.session import WorkerSession

pytestmark = pytest.mark.anyio

KINDS = [app.Counter.kind]


class _Steps:
    """Counters claimed by one worker session, a message each in hand, ready to commit."""

    def __init__(self, client: Client, session: WorkerSession, commits: GroupCommit) -> None:
        self.client, self.session, self.commits = client, session, commits
        self.epochs: dict[str, int] = {}
        self.envelopes: dict[str, Envelope] = {}

    async def take(self, ids: list[str]) -> None:
        for actor_id in ids:
            await self.client.spawn(app.Counter, actor_id)
            await self.client.send(actor_id, app.Add(n=1, tag=actor_id))
        claims = await claim(
            self.client.pool, self.session.worker_id, limit=100, lease=30, kinds=KINDS, hosted=[]
        )
        for c in claims:
            self.epochs[c.actor_id] = c.epoch
            envelope = await claim_next(
                self.client.pool, c.actor_id, self.session.worker_id, c.epoch
            )
            assert envelope is not None
            self.envelopes[c.actor_id] = open_envelope(envelope)

    async def commit(self, actor_id: str, *, to: str | None = None, retry: bool = False) -> Any:
        actor = app.Counter(actor_id, {})
        envelope = self.envelopes[actor_id]
        ctx = Context(actor, actor.initial_state(), 0, self.epochs[actor_id], envelope)
        ctx.emit(app.Added(n=1, tag=actor_id, message_id=envelope.id))
        if to is not None:
            ctx.send(to, app.Add(n=1, tag="x"))
        return await commit_step(
            self.client.pool, self.session.worker_id, envelope, ctx, via=self.commits, retry=retry
        )


@asynccontextmanager
async def _steps(client: Client, db_url: str, **commits: Any) -> AsyncIterator[_Steps]:
    session = await WorkerSession.open(db_url, Settings(database_url=db_url))
    try:
        yield _Steps(client, session, GroupCommit(client.pool, **commits))
    finally:
        await session.close()


async def _batched(
    steps: _Steps,
    first: str,
    rest: dict[str, Callable[[], Awaitable[Any]]],
    then: Callable[[], Awaitable[None]] | None = None,
) -> dict[str, Any]:
    """Commit ``first``, its step held on a row lock (holding the one lane) until ``rest`` have
    queued behind it; then the lock goes, ``first`` commits and ``rest`` go as one batch. Each
    step's result or the exception it raised. ``then`` runs once the lock is gone."""
    out: dict[str, Any] = {}

    async def one(name: str, step: Callable[[], Awaitable[Any]]) -> None:
        try:
            out[name] = await step()
        except Exception as exc:
            out[name] = exc

    async with steps.client.pool.acquire() as conn:
        tx = conn.transaction()
        await tx.start()
        await conn.execute("SELECT 1 FROM toren.actors WHERE actor_id = $1 FOR UPDATE", first)
        async with anyio.create_task_group() as tg:
            tg.start_soon(one, first, lambda: steps.commit(first))
            await wait_for(lambda: _true(steps.commits._busy == 1), what="the lane held")
            for name, step in rest.items():
                tg.start_soon(one, name, step)
            await wait_for(lambda: _true(len(steps.commits._queue) == len(rest)), what="queued")
            await tx.rollback()
            if then is not None:
                await then()
    return out


async def _journaled(client: Client, ids: list[str]) -> list[str]:
    return [a for a in ids if await client.journal(a)]


async def _true(value: bool) -> bool:
    return value


async def test_a_step_alone_commits_at_once_and_forms_no_batch(client: Client, db_url: str) -> None:
    ids = [f"g/alone/{i}" for i in range(4)]
    async with _steps(client, db_url, lanes=1) as steps:
        await steps.take(ids)
        for actor_id in ids:
            await steps.commit(actor_id)
        assert steps.commits.batches == 0
        assert await _journaled(client, ids) == ids


async def test_a_fenced_step_fails_alone_and_its_batch_mates_commit(
    client: Client, db_url: str
) -> None:
    first, *rest = ids = [f"g/fence/{i}" for i in range(5)]
    async with _steps(client, db_url, lanes=1) as steps:
        await steps.take(ids)
        # Another worker took g/fence/2 meanwhile: its epoch is no longer ours.
        await client.pool.execute(
            "UPDATE toren.actors SET epoch = epoch + 1 WHERE actor_id = 'g/fence/2'"
        )
        results = await _batched(steps, first, {a: (lambda a=a: steps.commit(a)) for a in rest})
        assert steps.commits.batches == 1
        assert steps.commits.batched == len(rest)
        assert isinstance(results["g/fence/2"], FencedOut)
        assert await _journaled(client, ids) == [a for a in ids if a != "g/fence/2"]
        # The fenced step consumed nothing: its message waits for its new owner.
        assert (
            await client.pool.fetchval(
                "SELECT count(*) FROM toren.mailbox WHERE actor_id = 'g/fence/2'"
            )
            == 1
        )


async def test_a_failing_step_fails_alone_with_its_own_error(client: Client, db_url: str) -> None:
    first, *rest = ids = [f"g/fail/{i}" for i in range(5)]
    async with _steps(client, db_url, lanes=1) as steps:
        await steps.take(ids)
        # g/fail/3 sends to an actor that does not exist: its statement raises, which aborts the
        # batch's transaction; each step is then committed alone.
        batch = {
            a: (lambda a=a: steps.commit(a, to="nobody" if a == "g/fail/3" else None)) for a in rest
        }
        results = await _batched(steps, first, batch)
        assert steps.commits.batches == 1
        assert isinstance(results["g/fail/3"], UnknownActor)
        assert await _journaled(client, ids) == [a for a in ids if a != "g/fail/3"]


async def test_a_batch_cut_mid_commit_is_unknown_and_committed_again_once(
    client: Client, db_url: str
) -> None:
    first, *rest = ids = [f"g/cut/{i}" for i in range(4)]
    async with _steps(client, db_url, lanes=1) as steps:
        await steps.take(ids)
        # The batch's first step waits on a row lock; its backend is terminated meanwhile, so
        # the batch never commits and its members never learn whether it did.
        async with client.pool.acquire() as locker:
            tx = locker.transaction()
            await tx.start()
            await locker.execute(
                "SELECT 1 FROM toren.actors WHERE actor_id = $1 FOR UPDATE", rest[0]
            )

            async def cut() -> None:
                pid = await wait_for(
                    lambda: client.pool.fetchval(
                        "SELECT pid FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                        "AND query LIKE '%fence AS%'"
                    ),
                    what="the batch waiting on the lock",
                )
                await client.pool.execute("SELECT pg_terminate_backend($1)", pid)

            batch = {a: (lambda a=a: steps.commit(a)) for a in rest}
            results = await _batched(steps, first, batch, then=cut)
            await tx.rollback()
        assert all(isinstance(results[a], BatchOutcomeUnknown) for a in rest), results
        assert await _journaled(client, ids) == [first]
        # Committed again (as the host does after an unknown outcome): each lands once.
        for actor_id in rest:
            await steps.commit(actor_id, retry=True)
            assert await steps.commit(actor_id, retry=True) is None  # found landed
        assert await _journaled(client, ids) == ids
        for actor_id in ids:
            assert len(await client.journal(actor_id)) == 1


async def test_a_batch_whose_rows_do_not_match_its_steps_fails_every_step_instead_of_hanging(
    client: Client,
) -> None:
    # Each step's statement must answer one row (the step statement always does); one that
    # answers none for a step leaves the batch's flat list of rows one short, so no row can be
    # told to its step. Every member learns it, rather than waiting for ever.
    commits = GroupCommit(client.pool, lanes=1)
    statement = "SELECT $1::int AS n WHERE $1::int > 0"
    out: dict[int, Any] = {}

    async def one(n: int, query: str = statement) -> None:
        try:
            out[n] = await commits.fetchrow(query, [n])
        except Exception as exc:
            out[n] = exc

    async with client.pool.acquire() as conn:
        tx = conn.transaction()
        await tx.start()
        await conn.execute("LOCK TABLE toren.workers IN ACCESS EXCLUSIVE MODE")
        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                # The first holds the one lane, waiting on the lock, while the others queue.
                tg.start_soon(one, -1, "SELECT count(*)::int FROM toren.workers WHERE $1 < 0")
                await wait_for(lambda: _true(commits._busy == 1), what="the lane held")
                for n in (1, 0, 2):
                    tg.start_soon(one, n)
                await wait_for(lambda: _true(len(commits._queue) == 3), what="queued")
                await tx.rollback()
    assert commits.batches == 1
    assert all(isinstance(out[n], InternalError) for n in (1, 0, 2)), out


async def test_lanes_leave_the_pool_a_connection_and_batches_are_bounded(client: Client) -> None:
    from supervisors.worker.hosts import HostRegistry
    from toren import ConfigError

    registry = HostRegistry(client.pool, uuid.uuid4(), Settings(pool_size=2, commit_lanes=4))
    assert registry.commits.lanes == 1
    assert HostRegistry(client.pool, uuid.uuid4(), Settings()).commits.lanes == 2
    assert Settings.load(env={"TOREN_COMMIT_BATCH": "1"}).commit_batch == 1
    for bad in (0, 1001):
        with pytest.raises(ConfigError):
            Settings(commit_batch=bad)
