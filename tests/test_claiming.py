"""Claiming: what a sweep finds, and that a quiet actor is not starved by busy ones.

Mail to be handled at once and mail for later (durable timers, delayed sends) are found through
separate indexes, so that actors asleep on future timers cost a sweep nothing; these tests check
the behaviour: what is due is claimed, what is not due is not, and fairness holds.
"""

from __future__ import annotations

import pytest

from tests import app
from tests.conftest import wait_for
from toren import Client, Settings
from toren._core.leases import claim
from toren._core.session import WorkerSession

pytestmark = pytest.mark.anyio

KINDS = [app.Counter.kind]


async def _session(db_url: str) -> WorkerSession:
    return await WorkerSession.open(db_url, Settings(database_url=db_url))


async def test_one_message_is_claimed_within_a_few_rounds_beside_fifty_busy_actors(
    client: Client, db_url: str
) -> None:
    # 50 actors that always have mail (a backlog each, and they stay hosted), then one that gets
    # a single message. Its id sorts before theirs and after theirs: neither order starves it.
    for name in ("c/a-single", *(f"c/busy-{i:02d}" for i in range(50)), "c/z-single"):
        await client.spawn(app.Counter, name)
    for i in range(50):
        for n in range(20):
            await client.send(f"c/busy-{i:02d}", app.Add(n=1, tag=str(n)))
    session = await _session(db_url)
    try:
        hosted: list[str] = []
        # The busy ones are claimed and kept (as a worker keeps actors that have mail).
        while len(hosted) < 50:
            got = await claim(
                client.pool, session.worker_id, limit=10, lease=30, kinds=KINDS, hosted=hosted
            )
            assert got, "the busy actors should all be claimable"
            hosted += [c.actor_id for c in got]
        for single in ("c/z-single", "c/a-single"):
            await client.send(single, app.Add(n=1, tag="only"))
            rounds = 0
            while single not in hosted:
                rounds += 1
                assert rounds <= 3, f"{single} not claimed after {rounds - 1} rounds"
                got = await claim(
                    client.pool, session.worker_id, limit=10, lease=30, kinds=KINDS, hosted=hosted
                )
                hosted += [c.actor_id for c in got]
            assert rounds == 1
    finally:
        await session.close()


async def test_mail_for_later_is_claimed_once_due_and_not_before(
    client: Client, db_url: str
) -> None:
    for name in ("c/later", "c/soon", "c/now"):
        await client.spawn(app.Counter, name)
    await client.send("c/later", app.Add(n=1, tag="l"), delay=3600)
    await client.send("c/soon", app.Add(n=1, tag="s"), delay=0.5)
    await client.send("c/now", app.Add(n=1, tag="n"))
    session = await _session(db_url)
    try:
        got = await claim(
            client.pool, session.worker_id, limit=10, lease=30, kinds=KINDS, hosted=[]
        )
        assert [c.actor_id for c in got] == ["c/now"]
        hosted = ["c/now"]

        # Due after half a second: claimed then (polled with a deadline, never slept on).
        async def claimed() -> list[str]:
            got = await claim(
                client.pool, session.worker_id, limit=10, lease=30, kinds=KINDS, hosted=hosted
            )
            return [c.actor_id for c in got]

        assert await wait_for(claimed, timeout=10, what="the delayed message due") == ["c/soon"]
        # An hour away: nothing to claim, however often the worker sweeps.
        hosted.append("c/soon")
        for _ in range(3):
            assert (
                await claim(
                    client.pool, session.worker_id, limit=10, lease=30, kinds=KINDS, hosted=hosted
                )
                == []
            )
        # Once its time comes (moved here instead of waiting an hour), it is claimed.
        await client.pool.execute(
            "UPDATE toren.mailbox SET visible_at = now() - interval '1 second', "
            "created_at = now() - interval '1 hour' WHERE actor_id = 'c/later'"
        )
        got = await claim(
            client.pool, session.worker_id, limit=10, lease=30, kinds=KINDS, hosted=hosted
        )
        assert [c.actor_id for c in got] == ["c/later"]
    finally:
        await session.close()
