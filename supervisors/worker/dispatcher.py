"""The dispatcher: claims runnable actors and starts them under the worker's dynamic supervisor.

It wakes on a ``toren_mail`` notification for an actor not hosted here, on a kick (an actor just
passivated), and every ``poll_seconds`` for a sweep that also finds actors of dead workers and
expired leases. It claims no more than the worker's free slots (``max_actors``): at the cap it
stops claiming, which is the worker's backpressure, and asks idle actors to passivate early so
that actors with mail get their turn.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Awaitable, Callable

import anyio
import asyncpg

from toren import Settings
from toren.kernel import TRANSIENT_DB_ERRORS, Claim, actor_kinds, claim, housekeep, waiting
from toren.supervisors.worker.hosts import HostRegistry

log = logging.getLogger("toren.worker")

StartHost = Callable[[Claim], Awaitable[None]]


class Dispatcher:
    """Turns mail into running actors for one worker incarnation."""

    def __init__(
        self,
        pool: asyncpg.Pool,
        worker_id: uuid.UUID,
        hosts: HostRegistry,
        settings: Settings,
        start_host: StartHost,
    ) -> None:
        self.pool = pool
        self.worker_id = worker_id
        self.hosts = hosts
        self.settings = settings
        self.start_host = start_host
        self._wanted: set[str] = set()
        self._kick = anyio.Event()
        self._sweep_now = False
        self._failures = 0  # consecutive failed claim passes
        self._sweeps = 0

    def on_mail(self, actor_id: str) -> None:
        """A notification: wake the actor if it runs here, else try to claim it."""
        if not self.hosts.wake(actor_id):
            self.want(actor_id)

    def sweep_now(self) -> None:
        """Sweep at once (a worker died: its actors are claimable now)."""
        self._sweep_now = True
        self._kick.set()

    def want(self, actor_id: str) -> None:
        """Try to claim ``actor_id`` soon (targeted, cheaper than a sweep)."""
        self._wanted.add(actor_id)
        self._kick.set()

    async def run(self, started: Callable[[], None]) -> None:
        """Claim until cancelled.

        Claims are single statements, so a dropped connection loses nothing: the dispatcher
        logs it, pauses, and goes on.
        """
        started()
        while True:
            try:
                await self._loop()
            except TRANSIENT_DB_ERRORS as exc:
                self._failures += 1
                delay = min(5.0, 0.05 * 2**self._failures)
                log.warning("claiming failed (%s); again in %.2fs", exc, delay)
                await anyio.sleep(delay)

    async def _loop(self) -> None:
        next_sweep = 0.0
        while True:
            now = anyio.current_time()
            if now >= next_sweep or self._sweep_now:
                self._sweep_now = False
                await self._claim(None)
                next_sweep = now + self.settings.poll_seconds
                self._sweeps += 1
                if self._sweeps % 60 == 0:
                    await self._housekeep()
            elif self._wanted:
                wanted, self._wanted = self._wanted, set()
                await self._claim([a for a in wanted if a not in self.hosts])
            if not (self._wanted or self._sweep_now):
                with anyio.move_on_after(max(0.0, next_sweep - anyio.current_time())):
                    await self._kick.wait()
                self._kick = anyio.Event()

    async def _housekeep(self) -> None:
        # Housekeeping is tidying: its failure (a slow DELETE, a dropped connection) must never
        # cost the worker anything but a log line.
        try:
            await housekeep(
                self.pool,
                dedupe_retention=self.settings.dedupe_retention_seconds,
                token_keep_for=self.settings.token_keep_for,
            )
        except Exception:
            log.warning("housekeeping failed; will try again later", exc_info=True)

    async def _claim(self, only: list[str] | None) -> None:
        if only is not None and not only:
            return
        room = self.settings.max_actors - len(self.hosts)
        if room <= 0:
            # At the cap: idle actors make way for actors with mail (they passivate early).
            demand = await waiting(
                self.pool,
                self.worker_id,
                limit=8,
                kinds=actor_kinds(),
                hosted=self.hosts.claimed_ids(),
                only=only,
                routes=self.hosts.agents.served_routes(),
            )
            if demand and self.hosts.evict_idle(demand):
                log.debug(
                    "at cap (%d): evicting idle actors for %d waiting", len(self.hosts), demand
                )
            return
        claims = await claim(
            self.pool,
            self.worker_id,
            limit=room,
            lease=self.settings.lease_seconds,
            kinds=actor_kinds(),
            hosted=self.hosts.claimed_ids(),
            only=only,
            routes=self.hosts.agents.served_routes(),
        )
        self._failures = 0
        for c in claims:
            log.debug("claimed %s at epoch %d", c.actor_id, c.epoch)
            await self.start_host(c)
