"""The hosted actors of one worker incarnation: who runs here, waking them, stopping them.

Each claimed actor runs as a child of the worker's dynamic supervisor (simple_one_for_one), inside
a cancel scope of its own kept here, so that the worker can stop all of its actors at once the
moment it learns its claim on them may be gone (lock connection lost, or renewals failing
until the leases could have expired).
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Awaitable, Callable

import anyio
import asyncpg

from toren import Settings
from toren.directory import Directory
from toren.kernel import (
    ActorHost,
    Claim,
    GroupCommit,
    LeaseClock,
    Resources,
    mark_failed,
    release_claim,
)
from toren.runs import PROCESS_AGENTS, Agents

log = logging.getLogger("toren.worker")


class HostRegistry:
    """The actors this worker incarnation hosts, by id."""

    def __init__(
        self,
        pool: asyncpg.Pool,
        worker_id: uuid.UUID,
        settings: Settings,
        resources: Resources | None = None,
    ) -> None:
        self.pool = pool
        self.resources = resources if resources is not None else Resources()
        # A registry made alone (a test) runs the process's agents; a worker gives its own.
        if Agents not in self.resources:
            self.resources.put(PROCESS_AGENTS, as_type=Agents)
        self.agents = self.resources.get(Agents)
        if Directory not in self.resources:
            # Cross-agent calls check consent against live workers' cards.
            self.resources.put(Directory(self.agents, pool))
        self.directory = self.resources.get(Directory)
        self.worker_id = worker_id
        self.settings = settings
        # One per worker incarnation: its hosts' steps are committed together under load.
        self.commits = GroupCommit(
            pool,
            lanes=max(1, min(settings.commit_lanes, settings.pool_size - 1)),
            max_batch=settings.commit_batch,
        )
        self.hosts: dict[str, ActorHost] = {}
        self._scopes: dict[str, anyio.CancelScope] = {}
        self._claims: dict[str, Claim] = {}
        self._clocks: dict[str, LeaseClock] = {}
        self.on_exit: Callable[[str], None] = lambda _actor_id: None

    def __len__(self) -> int:
        return len(self.hosts)

    def __contains__(self, actor_id: object) -> bool:
        return actor_id in self._claims

    def wake(self, actor_id: str) -> bool:
        """Tell a hosted actor that mail arrived; False if it is not hosted here."""
        host = self.hosts.get(actor_id)
        if host is None:
            return False
        host.wake()
        return True

    def adopt(self, claim: Claim) -> Callable[[Callable[[], None], anyio.Event], Awaitable[None]]:
        """Register a claim; returns the coroutine function its supervisor child runs.

        The child may be restarted by its supervisor: each run builds a fresh host (a fresh actor
        object, state rebuilt from the journal) for the same claim.
        """
        self._claims[claim.actor_id] = claim
        clock = self._clocks[claim.actor_id] = LeaseClock(
            claim.actor_id,
            lease=self.settings.lease_seconds,
            # The lease keeper gives up on its leases one renewal interval before they lapse;
            # an effect needs at least that much left.
            margin=self.settings.renew_seconds,
            sent_at=claim.sent_at,
        )

        async def run(started: Callable[[], None], stopping: anyio.Event) -> None:
            host = ActorHost(
                self.pool,
                self.worker_id,
                claim,
                poll_seconds=self.settings.poll_seconds,
                lease=clock,
                snapshot_every=self.settings.snapshot_every,
                resources=self.resources,
                commits=self.commits,
            )
            scope = anyio.CancelScope()
            self.hosts[claim.actor_id] = host
            self._scopes[claim.actor_id] = scope
            restarting = False
            try:
                with scope:
                    await host.run(started, stopping)
            except Exception:
                restarting = True  # the supervisor restarts it (same claim) or gives up on it
                raise
            finally:
                if self.hosts.get(claim.actor_id) is host:
                    del self.hosts[claim.actor_id]
                    del self._scopes[claim.actor_id]
                if not restarting and self._claims.get(claim.actor_id) is claim:
                    del self._claims[claim.actor_id]
                    if self._clocks.get(claim.actor_id) is clock:
                        del self._clocks[claim.actor_id]
                if not restarting:
                    self.on_exit(claim.actor_id)

        return run

    def request_stop_all(self) -> None:
        """Ask every hosted actor to finish its message in hand and release its lease.

        All at once, so that a drain takes the longest handling time, not the sum of them.
        """
        for host in self.hosts.values():
            host.request_stop()

    def evict_idle(self, count: int) -> int:
        """Passivate up to ``count`` idle actors early, oldest claim first, to make room.

        Returns:
            How many were asked to leave.
        """
        evicted = 0
        for host in list(self.hosts.values()):
            if evicted >= count:
                break
            if host.idle:
                host.request_stop()
                evicted += 1
        return evicted

    def claimed_ids(self) -> list[str]:
        """Ids of every actor claimed here (hosted, or restarting under its supervisor)."""
        return list(self._claims)

    def claims(self) -> list[tuple[str, int]]:
        """Every claim held here, as ``(actor_id, epoch)``: what the lease keeper renews."""
        return [(c.actor_id, c.epoch) for c in self._claims.values()]

    def renewed(self, held: set[tuple[str, int]], sent_at: float) -> None:
        """A renewal sent at ``sent_at`` found ``held``: their leases run from then."""
        for actor_id, epoch in held:
            claim = self._claims.get(actor_id)
            clock = self._clocks.get(actor_id)
            if claim is not None and clock is not None and claim.epoch == epoch:
                clock.renewed(sent_at)

    def stop_lost(self, judged: list[tuple[str, int]], held: set[tuple[str, int]]) -> list[str]:
        """Cancel every actor whose claim was ``judged`` by a renewal and is not ``held`` any
        more (its owner or epoch changed in the database); returns their ids."""
        lost = [
            actor_id
            for actor_id, epoch in judged
            if (actor_id, epoch) not in held
            and (c := self._claims.get(actor_id)) is not None
            and c.epoch == epoch
        ]
        for actor_id in lost:
            self.cancel(actor_id)
        return lost

    def cancel(self, actor_id: str) -> None:
        """Stop one hosted actor at once (no grace: its claim is gone)."""
        clock = self._clocks.pop(actor_id, None)
        if clock is not None:
            clock.lost()
        scope = self._scopes.get(actor_id)
        if scope is not None:
            scope.cancel()
        self._claims.pop(actor_id, None)

    async def abandon(self, claim: Claim) -> None:
        """Give back a claim that could not be started here (fenced release)."""
        if self._claims.get(claim.actor_id) is claim:
            del self._claims[claim.actor_id]
            self._clocks.pop(claim.actor_id, None)
        await release_claim(self.pool, claim.actor_id, self.worker_id, claim.epoch)

    def cancel_all(self) -> int:
        """Stop every hosted actor at once; returns how many were running."""
        count = len(self._scopes)
        for clock in self._clocks.values():
            clock.lost()
        self._clocks.clear()
        for scope in list(self._scopes.values()):
            scope.cancel()
        self._claims.clear()
        return count

    async def give_up(self, actor_id: str, exc: BaseException) -> None:
        """Escalation: the actor exceeded its restart intensity; mark it failed, tell its parent."""
        claim = self._claims.pop(actor_id, None)
        self._clocks.pop(actor_id, None)
        if claim is None:
            return
        cause = exc.__cause__
        error = f"{exc}; last error: {type(cause).__name__}: {cause}" if cause else str(exc)
        failed = await mark_failed(
            self.pool, actor_id, claim.kind, self.worker_id, claim.epoch, error
        )
        if failed:
            log.error("%s: restart intensity exceeded, marked failed: %s", actor_id, error)
