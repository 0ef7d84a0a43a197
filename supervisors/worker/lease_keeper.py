"""The lease keeper: renews all of this worker's leases in one statement, every few seconds.

Renewal also publishes the worker's live statistics (actors in memory, leases held, RSS) to the
registry; a worker whose actors have all passivated frees what their burst left in memory. Any
claim the renewal names but does not find any more (owner or epoch changed) was
taken by another worker: its actor is stopped at once. A renewal that fails on a dropped
connection is retried while the leases are still certainly valid; if it keeps failing past that,
or the worker's registry row is gone, the keeper raises, and the worker's supervisor stops every
actor and starts a new incarnation. A renewal that times out (rather than failing) may be stuck
on a server that no longer commits (a primary without its synchronous standby): the keeper asks
the worker to check its route (:class:`~toren.kernel.Route`), and if its connections now reach
another server, raises :class:`ServerMoved` at once.
"""

from __future__ import annotations

import ctypes
import gc
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import asyncpg
import psutil

from toren import Settings, TorenError
from toren.kernel import TRANSIENT_DB_ERRORS, kill_point, renew
from toren.supervisors.worker.hosts import HostRegistry

log = logging.getLogger("toren.worker")

try:  # glibc: hand freed heap pages back to the OS
    _malloc_trim: Callable[[int], int] | None = ctypes.CDLL(None).malloc_trim
except (OSError, AttributeError):
    _malloc_trim = None

# A renewal that failed on these may simply be tried again (while the leases are still valid).
_RENEWAL_ERRORS: tuple[type[BaseException], ...] = (*TRANSIENT_DB_ERRORS, TimeoutError)


class RegistrationLost(TorenError):
    """This worker's registry row disappeared: others consider it dead."""

    def __init__(self, worker_id: uuid.UUID) -> None:
        self.worker_id = worker_id
        super().__init__(f"worker {worker_id} is no longer registered; starting a new incarnation")


class ServerMoved(TorenError):
    """The server this worker's connections reached no longer commits; another one does."""

    def __init__(self, worker_id: uuid.UUID) -> None:
        self.worker_id = worker_id
        super().__init__(
            f"worker {worker_id}: its database server stopped committing and another took "
            "over; starting a new incarnation there"
        )


async def _nothing_moved() -> bool:
    return False


class LeaseKeeper:
    """Renews leases and publishes statistics for one worker incarnation."""

    def __init__(
        self,
        pool: asyncpg.Pool,
        worker_id: uuid.UUID,
        hosts: HostRegistry,
        settings: Settings,
        *,
        on_stuck: Callable[[], Awaitable[bool]] = _nothing_moved,
    ) -> None:
        self.pool = pool
        self.on_stuck = on_stuck
        """Called when a renewal timed out; True if the worker's server moved."""
        self.worker_id = worker_id
        self.hosts = hosts
        self.settings = settings
        self._process = psutil.Process()
        self._busy = False  # actors were in memory at the last renewal

    def release_memory(self) -> None:
        """Once the worker holds no actor any more, free what its last burst left behind.

        A burst of runs leaves collectable cycles and freed heap pages the allocator keeps;
        collecting and trimming then (never while actors run: the collection pauses the
        loop) keeps an idle worker's RSS near where it started.
        """
        if len(self.hosts):
            self._busy = True
            return
        if self._busy:
            self._busy = False
            gc.collect()
            if _malloc_trim is not None:
                _malloc_trim(0)

    def stats(self, leases: int) -> dict[str, Any]:
        """What ``toren workers`` shows for this worker (and what ``toren run`` checks)."""
        return {
            "actors_in_memory": len(self.hosts),
            "leases_held": leases,
            "rss_bytes": self._process.memory_info().rss,
            "routes": self.hosts.agents.served_routes(),
            "agents": self.hosts.directory.local_cards(),
        }

    async def renew_once(self) -> int:
        """Renew every lease now; returns how many are held.

        Raises:
            RegistrationLost: the registry row is gone.
        """
        # Judge only the claims held when the statement starts: a claim taken meanwhile is
        # neither renewed nor judged lost (its lease is fresh).
        judged = self.hosts.claims()
        self.release_memory()
        if judged:
            kill_point("lease.renewing")
        sent_at = time.monotonic()
        with anyio.fail_after(self.settings.renew_seconds):
            held = await renew(
                self.pool,
                self.worker_id,
                judged,
                lease=self.settings.lease_seconds,
                stats=self.stats(leases=len(judged)),
            )
        if judged:
            kill_point("lease.renewed")
        if held is None:
            raise RegistrationLost(self.worker_id)
        self.hosts.renewed(held, sent_at)
        for actor_id in self.hosts.stop_lost(judged, held):
            log.warning("%s: lease lost to another worker; stopped here", actor_id)
        return len(held)

    async def run(self, started: Callable[[], None]) -> None:
        """Renew every ``renew_seconds`` until cancelled.

        A renewal that fails on a dropped connection is retried after a short, growing pause,
        for as long as the leases are certainly still valid: until one renewal interval before
        the leases of the last successful renewal (counted from when it was sent) expire. Past
        that the keeper raises, and the worker stops every actor (they may soon be claimed
        elsewhere).

        Raises:
            RegistrationLost: the registry row is gone.
            ServerMoved: a renewal timed out, and the server that commits is now another.
            Exception: renewal kept failing until the safety deadline.
        """
        started()
        renewed_at = anyio.current_time()  # a new incarnation holds no lease yet
        while True:
            deadline = renewed_at + self.settings.lease_seconds - self.settings.renew_seconds
            delay = 0.05
            while True:
                sent_at = anyio.current_time()
                try:
                    with anyio.fail_after(max(0.1, deadline - sent_at)):
                        await self.renew_once()
                    renewed_at = sent_at  # the new leases run from when the statement was sent
                    break
                except _RENEWAL_ERRORS as exc:
                    if isinstance(exc, TimeoutError) and await self.on_stuck():
                        raise ServerMoved(self.worker_id) from exc
                    if anyio.current_time() + delay >= deadline:
                        log.exception("lease renewal keeps failing; stopping all actors")
                        raise
                    log.warning("lease renewal failed (%s); retrying in %.2fs", exc, delay)
                    await anyio.sleep(delay)
                    delay = min(delay * 2, 1.0)
            await anyio.sleep(self.settings.renew_seconds)
