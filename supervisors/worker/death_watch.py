"""The death watch: learns of a peer worker's death the moment Postgres drops its session.

Workers watch each other in a ring (each waits on a shared request for its successor's advisory
lock), so a worker killed with SIGKILL is noticed at once by its watcher, which sweeps and claims
its actors, instead of at the next poll. The poll remains the fallback for everyone else.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable

import anyio

from toren import Settings
from toren.kernel import open_death_watch, watch_successor

log = logging.getLogger("toren.worker")

RECHECK_SECONDS = 5.0


class DeathWatch:
    """Calls ``on_death()`` whenever the watched peer dies."""

    def __init__(
        self,
        url: str,
        worker_id: uuid.UUID,
        lock_key: int,
        settings: Settings,
        on_death: Callable[[], None],
    ) -> None:
        self.url = url
        self.worker_id = worker_id
        self.lock_key = lock_key
        self.settings = settings
        self.on_death = on_death

    async def run(self, started: Callable[[], None]) -> None:
        """Watch until cancelled.

        The watch is an optimisation over polling and holds no claim, so losing its connection
        is not the worker's problem: it reconnects (with backoff) on its own.
        """
        started()
        failures = 0
        while True:
            try:
                await self._watch()
            # Any failure of the watch only costs speed (polling still finds dead workers), so
            # it must never end the worker's incarnation.
            except Exception as exc:  # noqa: BLE001
                failures += 1
                delay = min(RECHECK_SECONDS, 0.1 * 2**failures)
                log.warning("death watch connection failed (%s); again in %.1fs", exc, delay)
                await anyio.sleep(delay)

    async def _watch(self) -> None:
        conn = await open_death_watch(self.url, recheck=RECHECK_SECONDS)
        try:
            while True:
                died = await watch_successor(conn, self.worker_id, self.lock_key)
                if died:
                    self.on_death()
                elif died is None:
                    # Alone: look for a peer to watch again shortly.
                    await anyio.sleep(min(self.settings.poll_seconds, RECHECK_SECONDS))
        finally:
            conn.terminate()  # a lock wait may be pending: no polite close
