"""The lease keeper: renews all of this worker's leases in one statement, every few seconds.

Renewal also publishes the worker's live statistics (actors in memory, leases held, RSS) to the
registry. Any actor missing from the renewed set was taken by another worker: it is stopped at
once. If renewal fails, or the worker's registry row is gone, the keeper raises; the worker's
supervisor then stops every actor and starts a new incarnation.
"""

from __future__ import annotations

import logging
import uuid

import anyio
import asyncpg
import psutil

from actors.hosts import HostRegistry
from toren import Settings, TorenError
from toren.kernel import renew

log = logging.getLogger("toren.worker")


class RegistrationLost(TorenError):
    """This worker's registry row disappeared: others consider it dead."""

    def __init__(self, worker_id: uuid.UUID) -> None:
        self.worker_id = worker_id
        super().__init__(f"worker {worker_id} is no longer registered; starting a new incarnation")


class LeaseKeeper:
    """Renews leases and publishes statistics for one worker incarnation."""

    def __init__(
        self, pool: asyncpg.Pool, worker_id: uuid.UUID, hosts: HostRegistry, settings: Settings
    ) -> None:
        self.pool = pool
        self.worker_id = worker_id
        self.hosts = hosts
        self.settings = settings
        self._process = psutil.Process()

    def stats(self, leases: int) -> dict[str, int]:
        """What ``toren workers`` shows for this worker."""
        return {
            "actors_in_memory": len(self.hosts),
            "leases_held": leases,
            "rss_bytes": self._process.memory_info().rss,
        }

    async def renew_once(self) -> int:
        """Renew every lease now; returns how many are held.

        Raises:
            RegistrationLost: the registry row is gone.
        """
        held = await renew(
            self.pool,
            self.worker_id,
            lease=self.settings.lease_seconds,
            stats=self.stats(leases=len(self.hosts)),
        )
        if held is None:
            raise RegistrationLost(self.worker_id)
        for actor_id in self.hosts.stop_lost(held):
            log.warning("%s: lease lost to another worker; stopped here", actor_id)
        return len(held)

    async def run(self, started: object) -> None:
        """Renew every ``renew_seconds`` until cancelled."""
        await self.renew_once()
        if callable(started):
            started()
        while True:
            await anyio.sleep(self.settings.renew_seconds)
            await self.renew_once()
