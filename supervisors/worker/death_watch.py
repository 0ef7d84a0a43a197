"""The death watch: learns of a peer worker's death the moment Postgres drops its session.

Workers watch each other in a ring (each waits on a shared request for its successor's advisory
lock), so a worker killed with SIGKILL is noticed at once by its watcher, which sweeps and claims
its actors, instead of at the next poll. The poll remains the fallback for everyone else.

The ring changes as workers come and go. A death is seen by the one watching it, which then
watches the dead worker's successor. A newcomer announces itself as it registers: the worker it
now follows in the ring stops waiting on its old peer and watches the newcomer at once. Without
that, a worker that joined was watched only after its predecessor's next recheck (seconds), and
killed before then, its actors waited for a poll.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable

import anyio
import asyncpg

from toren import Settings
from toren.kernel import open_death_watch, ring_position, successor, wait_for_death

log = logging.getLogger("toren.worker")

RECHECK_SECONDS = 5.0
REWATCH_GAP = 0.1
"""The shortest time between two watches that a newcomer interrupted."""


class DeathWatch:
    """Calls ``on_death()`` whenever the watched peer dies; :meth:`joined` is told of every
    worker that registers. ``recheck``: how long a lock wait lasts before the peer is chosen
    again (the fallback should an announcement be missed; default :data:`RECHECK_SECONDS`)."""

    def __init__(
        self,
        url: str,
        worker_id: uuid.UUID,
        lock_key: int,
        settings: Settings,
        on_death: Callable[[], None],
        *,
        recheck: float | None = None,
    ) -> None:
        self.url = url
        self.worker_id = worker_id
        self.lock_key = lock_key
        self.settings = settings
        self.on_death = on_death
        self.recheck = RECHECK_SECONDS if recheck is None else recheck
        self.peer: int | None = None
        """The lock key of the worker watched now (``None``: none, or not chosen yet)."""
        self._choosing = True
        self._changed = anyio.Event()

    def joined(self, lock_key: int) -> None:
        """A worker registered with ``lock_key``: if it comes before the peer watched in the
        ring (or none is), choose the peer again now."""
        if lock_key == self.lock_key:
            return
        if (
            self._choosing  # the choice being made may not have seen it
            or self.peer is None
            or ring_position(lock_key, self.lock_key) < ring_position(self.peer, self.lock_key)
        ):
            self._changed.set()

    async def run(self, started: Callable[[], None]) -> None:
        """Watch until cancelled.

        The watch is an optimisation over polling and holds no claim, so losing its connection
        is not the worker's problem: it reconnects (with backoff) on its own.
        """
        started()
        failures = 0
        while True:
            try:
                began = anyio.current_time()
                await self._watch()
                failures = 0  # a newcomer interrupted a lock wait: watch it on a new connection
                # at most every REWATCH_GAP (anyone who may connect may NOTIFY: a flood of
                # joins must not become a flood of connections; the poll still finds deaths)
                await anyio.sleep(REWATCH_GAP - (anyio.current_time() - began))
            # Any failure of the watch only costs speed (polling still finds dead workers), so
            # it must never end the worker's incarnation.
            except Exception as exc:  # noqa: BLE001
                failures += 1
                delay = min(RECHECK_SECONDS, 0.1 * 2**failures)
                log.warning("death watch connection failed (%s); again in %.1fs", exc, delay)
                await anyio.sleep(delay)

    async def _watch(self) -> None:
        """Watch on one connection; return when a newcomer interrupts a lock wait (the
        connection is left mid-request, so it is dropped)."""
        conn = await open_death_watch(self.url, recheck=self.recheck)
        try:
            while True:
                self._changed = anyio.Event()
                self._choosing = True
                self.peer = await successor(conn, self.worker_id, self.lock_key)
                self._choosing = False
                if self._changed.is_set():
                    continue  # a worker joined while the peer was chosen: choose again
                if self.peer is None:
                    # Alone: wait for a worker to join (or look again after a while).
                    with anyio.move_on_after(min(self.settings.poll_seconds, self.recheck)):
                        await self._changed.wait()
                    continue
                died = await self._wait(conn, self.peer)
                if died is None:
                    return
                if died:
                    self.on_death()
        finally:
            self.peer, self._choosing = None, True
            conn.terminate()  # a lock wait may be pending: no polite close

    async def _wait(self, conn: asyncpg.Connection, peer: int) -> bool | None:
        """:func:`wait_for_death` until a newcomer to watch instead interrupts it (``None``)."""
        died: bool | None = None
        async with anyio.create_task_group() as tg:

            async def interrupt() -> None:
                await self._changed.wait()
                tg.cancel_scope.cancel()

            tg.start_soon(interrupt)
            died = await wait_for_death(conn, peer)
            tg.cancel_scope.cancel()
        return died
