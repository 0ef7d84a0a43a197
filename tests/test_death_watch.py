"""The death watch follows the ring as workers join: a worker killed soon after it registered is
noticed by the worker before it in the ring, through its lock, not at a poll or a lease's end.

Each test runs a worker (in this process) whose poll and lease are ten minutes and whose death
watch rechecks its peer every ten minutes, so that only a death noticed through the lock can
hand an actor on within the test's deadline. The peers around it are bare sessions (a lock and a
registry row), one of which owns an actor and then dies.
"""

from __future__ import annotations

import uuid

import pytest

import toren.supervisors.worker.death_watch as death_watch
from tests import app
from tests.conftest import running_worker, wait_for
from toren import Client, Settings
from toren._core.session import LOCK_NAMESPACE, WorkerSession

pytestmark = pytest.mark.anyio

SLOW = {"poll_seconds": 600.0, "lease_seconds": 600.0, "renew_seconds": 300.0}


async def _session(db_url: str) -> WorkerSession:
    return await WorkerSession.open(db_url, Settings(database_url=db_url))


async def _waits_on(client: Client, lock_key: int) -> bool:
    """Whether a death watch waits on the lock of the worker with ``lock_key``."""
    found: int = await client.pool.fetchval(
        "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted "
        "AND mode = 'ShareLock' AND classid = $1::oid AND objid = $2::oid",
        LOCK_NAMESPACE,
        lock_key,
    )
    return found > 0


async def _own(client: Client, actor_id: str, worker_id: uuid.UUID) -> None:
    """``worker_id`` claims ``actor_id`` (a lease of ten minutes), then mail arrives for it."""
    await client.spawn(app.Counter, actor_id)
    await client.pool.execute(
        "UPDATE toren.actors SET owner = $2, epoch = epoch + 1, "
        "lease_expires_at = now() + interval '10 minutes' WHERE actor_id = $1",
        actor_id,
        worker_id,
    )
    await client.send(actor_id, app.Add(n=1, tag="a"))


@pytest.mark.parametrize("older_peer", [False, True], ids=["alone", "watching-an-older-peer"])
async def test_a_worker_killed_soon_after_it_joined_is_taken_over_through_its_lock(
    client: Client, db_url: str, monkeypatch: pytest.MonkeyPatch, older_peer: bool
) -> None:
    monkeypatch.setattr(death_watch, "RECHECK_SECONDS", 600.0)
    # With an older peer, the worker watches it (the ring wraps round to the lowest key) until
    # the newcomer, which comes after it, registers.
    older = await _session(db_url) if older_peer else None
    try:
        async with running_worker(db_url, **SLOW) as worker:
            assert worker.session is not None
            if older is not None:
                await wait_for(lambda: _waits_on(client, older.lock_key), what="older watched")
            else:  # alone: the watch has looked for a peer and found none
                await wait_for(
                    lambda: client.pool.fetchval(
                        "SELECT count(*) FROM pg_stat_activity WHERE application_name = "
                        "'toren-worker-watch' AND state = 'idle' AND query LIKE '%toren.workers%'"
                    ),
                    what="the watch alone",
                )
            joined = await _session(db_url)
            await wait_for(lambda: _waits_on(client, joined.lock_key), what="newcomer watched")
            await _own(client, "c/joined", joined.worker_id)
            await joined.conn.close()  # dies without deregistering or releasing its lease

            async def taken_over() -> bool:
                return bool(await client.journal("c/joined"))

            await wait_for(taken_over, what="the dead newcomer's actor taken over")
            [entry] = await client.journal("c/joined")
            assert entry.epoch == 2  # the newcomer's claim was the first
            owner = await client.pool.fetchval(
                "SELECT owner FROM toren.actors WHERE actor_id = 'c/joined'"
            )
            assert owner == worker.session.worker_id
    finally:
        if older is not None:
            await older.close()


@pytest.mark.parametrize(
    "payload", ["", "x", "1.5", "\x00", "9" * 5000, "-1", str(2**70)], ids=repr
)
def test_any_payload_on_the_join_channel_is_harmless(payload: str) -> None:
    """Anyone who may connect may NOTIFY toren_workers: a payload that is no integer, too long
    to be one, negative or beyond any lock key is ignored or at most makes the watch choose its
    peer again (which reads the live workers, not the payload); nothing raises."""
    from toren._core.session import _joined

    seen: list[int] = []
    _joined(seen.append, payload)
    watch = death_watch.DeathWatch(
        "postgresql://unused", uuid.uuid4(), 10, Settings(database_url="x"), lambda: None
    )
    watch._choosing, watch.peer = False, 11
    for key in seen:
        watch.joined(key)  # never raises; a re-choice at most
    assert seen == ([] if payload in ("", "x", "1.5", "\x00", "9" * 5000) else [int(payload)])
