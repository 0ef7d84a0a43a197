"""A worker incarnation's session: its advisory lock, its registry row and its LISTEN, on one
dedicated connection.

A worker is alive while it holds its session advisory lock: when its process dies, Postgres drops
the session and the lock with it, so its actors are claimable at the next poll instead of after
the lease (:mod:`toren._core.leases`), and the worker watching it in the ring hears of it at once
(:mod:`toren._core.workers`). :data:`LIVE_WORKERS` is that test, in SQL.
"""

from __future__ import annotations

import logging
import os
import socket
import uuid
from collections.abc import Callable, Mapping

import anyio
import asyncpg

from toren._core.config import WorkerSettings
from toren._core.db import TRANSIENT_DB_ERRORS, connect
from toren._version import __version__

log = logging.getLogger("toren.leases")  # the name operators' log filters know

LOCK_NAMESPACE = 0x746F7265  # "tore": classid of every worker's advisory lock in pg_locks


def code_version(settings: WorkerSettings) -> str:
    """The version a worker reports: the package version plus the optional deploy label."""
    return f"{__version__}+{settings.deploy_label}" if settings.deploy_label else __version__


# Any of these on the lock connection means the lock may be gone: the incarnation ends.
_LOCK_CONNECTION_ERRORS: tuple[type[BaseException], ...] = (
    *TRANSIENT_DB_ERRORS,
    asyncpg.PostgresError,
)


JOIN_CHANNEL = "toren_workers"
"""Where a worker announces its registration (the payload: its lock key), so that the worker
that should now watch it in the ring (:func:`toren._core.workers.successor`) does so at once."""

_REGISTER = f"""
WITH registered AS (
    INSERT INTO toren.workers (worker_id, lock_key, name, version, deploy_label, host, pid)
    VALUES ($1, $2, $3, $4, $5, $6, $7)
    RETURNING lock_key
), versions AS (
    INSERT INTO toren.agent_versions (agent, version)
    SELECT * FROM unnest($8::text[], $9::text[])
    ON CONFLICT DO NOTHING
)
SELECT count(pg_notify('{JOIN_CHANNEL}', lock_key::text)) FROM registered
"""


class WorkerSession:
    """A worker incarnation: its registry row and its advisory lock on a dedicated connection.

    The same connection carries the worker's LISTEN registrations. When the connection dies,
    :attr:`lost` is set: the lock is gone, other workers may already own this incarnation's
    actors, and the caller must stop them all and open a new session (a new incarnation).
    """

    def __init__(self, conn: asyncpg.Connection, worker_id: uuid.UUID, lock_key: int) -> None:
        self.conn = conn
        self.worker_id = worker_id
        self.lock_key = lock_key
        self.lost = anyio.Event()
        self._closing = False
        # Called synchronously the moment the connection drops, before any other task runs:
        # the worker stops its actors here, as early as it can know its lock is gone.
        self.on_lost: Callable[[], object] = lambda: None
        conn.add_termination_listener(self._on_termination)

    @classmethod
    async def open(
        cls, url: str, settings: WorkerSettings, versions: Mapping[str, str] | None = None
    ) -> WorkerSession:
        """Connect, take a fresh advisory lock and register this worker incarnation, with the
        version of each agent it serves (``versions``, by agent): in the same statement, a
        version not seen before is noted as first seen now (what makes it its agent's newest:
        :func:`toren._core.workers.newest_card`); one seen before keeps its time.

        A registration that does not commit within ``lease_seconds`` (a primary that lost its
        synchronous standby) raises :class:`TimeoutError`: the worker tries again, on its
        route's next choice of server.

        Raises:
            DatabaseUnavailable: Postgres cannot be reached.
            TimeoutError: the registration did not answer in time.
        """
        conn = await connect(url, name="toren-worker-lock")
        try:
            lock_key: int = await conn.fetchval("SELECT nextval('toren.worker_lock_keys')")
            await conn.execute("SELECT pg_advisory_lock($1, $2)", LOCK_NAMESPACE, lock_key)
            worker_id = uuid.uuid4()
            agents = sorted(versions or {})
            with anyio.fail_after(settings.lease_seconds):
                await conn.execute(
                    _REGISTER,
                    worker_id,
                    lock_key,
                    settings.worker_name,
                    code_version(settings),
                    settings.deploy_label,
                    socket.gethostname(),
                    os.getpid(),
                    agents,
                    [(versions or {})[a] for a in agents],
                )
            session = cls(conn, worker_id, lock_key)
        except TimeoutError:
            conn.terminate()  # its commit may still be waiting: nothing to close politely
            raise
        except BaseException:
            await _close_quietly(conn)
            raise
        log.info("worker %s registered (lock key %d)", worker_id, lock_key)
        return session

    async def listen(
        self, on_mail: Callable[[str], None], on_join: Callable[[int], None] = lambda _key: None
    ) -> None:
        """Call ``on_mail(actor_id)`` for every ``toren_mail`` notification, and
        ``on_join(lock_key)`` whenever another worker registers (:data:`JOIN_CHANNEL`)."""
        await self.conn.add_listener(
            "toren_mail", lambda _c, _pid, _ch, payload: on_mail(str(payload))
        )
        await self.conn.add_listener(
            JOIN_CHANNEL, lambda _c, _pid, _ch, payload: _joined(on_join, payload)
        )

    def abandon(self) -> None:
        """Give the session up without deregistering: its server no longer commits (a stale
        primary, :mod:`toren._core.primary`), so the lock it holds there guards nothing. The
        worker stops its actors (:attr:`on_lost`) and opens a new incarnation elsewhere."""
        self._mark_lost()
        self.conn.terminate()

    def _on_termination(self, _conn: object) -> None:
        if not self._closing:
            self._mark_lost()

    def _mark_lost(self) -> None:
        if not self.lost.is_set():
            self.lost.set()
            log.error("worker %s lost its lock connection; stopping its actors", self.worker_id)
            self.on_lost()

    async def keepalive(self, interval: float) -> None:
        """Ping the lock connection every ``interval`` seconds until it fails.

        Returns when the connection is lost (a dead socket may only show up on use).
        """
        while not self.lost.is_set():
            with anyio.move_on_after(interval):
                await self.lost.wait()
            if self.lost.is_set():
                return
            try:
                with anyio.fail_after(interval):
                    await self.conn.fetchval("SELECT 1")
            except _LOCK_CONNECTION_ERRORS:
                self._mark_lost()

    async def close(self) -> None:
        """Deregister and drop the lock (closing the connection releases it)."""
        self._closing = True
        if not self.lost.is_set():
            with anyio.move_on_after(5, shield=True):
                try:
                    await self.conn.execute(
                        "DELETE FROM toren.workers WHERE worker_id = $1", self.worker_id
                    )
                except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError):
                    log.warning("could not deregister worker %s", self.worker_id)
        await _close_quietly(self.conn)


def _joined(on_join: Callable[[int], None], payload: object) -> None:
    try:
        key = int(str(payload))
    except ValueError:  # not a worker's: anyone may notify on a channel
        return
    on_join(key)


async def _close_quietly(conn: asyncpg.Connection) -> None:
    with anyio.move_on_after(5, shield=True):
        try:
            await conn.close()
        except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError):
            conn.terminate()


# Advisory locks belong to one database, but pg_locks shows every database's: filter on ours,
# or another Toren installation on the same server would make our dead workers look alive.
LIVE_WORKERS = f"""
    SELECT w.worker_id FROM toren.workers w
    JOIN pg_locks l ON l.locktype = 'advisory' AND l.granted AND l.objsubid = 2
        AND l.mode = 'ExclusiveLock'  -- not a watcher's shared lock, granted as the owner died
        AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
        AND l.classid = {LOCK_NAMESPACE}::oid AND l.objid = w.lock_key::oid
"""
"""Registered workers that hold their session lock: the live ones (a subquery of worker ids)."""
