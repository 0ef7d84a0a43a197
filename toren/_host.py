"""The actor host: runs one claimed actor until it passivates, is fenced out, or is stopped.

The loop: rebuild the state from the journal, then claim a message, hand it to the actor, and
commit the step (one fenced statement). A handler exception is charged to the message, which is
retried with backoff and dead-lettered past its limit; the dead letter then surfaces as
:class:`MessageDeadLettered` so that the supervisor counts one restart of the actor. When the
mailbox stays empty for ``idle_seconds`` the host releases the lease and returns: no task and no
object of the actor remain.
"""

from __future__ import annotations

import logging
import traceback
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import asyncpg
import attrs

from toren._actor import Actor, Context, Envelope, actor_class, actor_kinds
from toren._errors import FencedOut, TorenError, UnknownActorKind
from toren._journal import rebuild, save_snapshot
from toren._leases import Claim, release, release_if_idle
from toren._mailbox import claim_next, commit_step, dead_letter, open_envelope, record_failure

log = logging.getLogger("toren.host")

_RETRY_CAP = 30.0


class MessageDeadLettered(TorenError):
    """A message was dead-lettered; raised out of the host so one restart is counted."""

    def __init__(self, actor_id: str, message_id: int, error: str) -> None:
        self.actor_id = actor_id
        self.message_id = message_id
        self.error = error
        super().__init__(f"{actor_id}: message {message_id} dead-lettered: {error}")


class ActorHost:
    """Hosts one actor claimed by this worker at one epoch."""

    def __init__(
        self,
        pool: asyncpg.Pool,
        worker_id: uuid.UUID,
        claim: Claim,
        *,
        poll_seconds: float,
        sleep: Callable[[float], Awaitable[None]] = anyio.sleep,
    ) -> None:
        cls = actor_class(claim.kind)
        if cls is None:
            raise UnknownActorKind(claim.kind, actor_kinds())
        self.pool = pool
        self.worker_id = worker_id
        self.claim = claim
        self.actor_id = claim.actor_id
        self.epoch = claim.epoch
        self._cls = cls
        self._poll = poll_seconds
        self._sleep = sleep
        self._wake = anyio.Event()
        self.fenced = False
        self.in_hand: int | None = None
        self._stop_requested = False
        self.idle = False

    def wake(self) -> None:
        """Mail arrived for this actor (a notification); stop waiting."""
        self._wake.set()

    def request_stop(self) -> None:
        """Graceful stop from outside: finish the message in hand, release, return."""
        self._stop_requested = True
        self._wake.set()

    async def run(self, started: Callable[[], None], stopping: anyio.Event) -> None:
        """Run the actor until it passivates, is fenced out, or ``stopping`` is set.

        On ``stopping`` the message in hand is finished and the lease released, so another worker
        can claim the actor at once. Cancellation (a brutal stop) leaves the lease to expire or to
        be taken from a dead worker.

        Raises:
            MessageDeadLettered: a message was dead-lettered (counts one restart).
            Exception: the actor failed to start (its state could not be rebuilt, or ``on_start``
                raised); counts one restart.
        """
        actor = self._cls(self.actor_id, self.claim.args)
        try:
            await self._run(actor, started, stopping)
        except FencedOut:
            self.fenced = True
            log.info("%s: fenced out at epoch %d; it runs elsewhere now", self.actor_id, self.epoch)

    async def _run(
        self, actor: Actor[Any], started: Callable[[], None], stopping: anyio.Event
    ) -> None:
        state, seq = await rebuild(self.pool, actor)
        snapshot_seq = seq
        await actor.on_start(Context(actor, state, seq, self.epoch, None))
        started()
        idle_since = anyio.current_time()
        while not (stopping.is_set() or self._stop_requested):
            envelope = await claim_next(self.pool, self.actor_id, self.worker_id, self.epoch)
            if envelope is None:
                if await self._idle(actor, stopping, idle_since):
                    return
                continue
            # A graceful stop (``stopping``) lets this step finish; only the supervisor's
            # cancellation after the grace period cuts it.
            self.in_hand = envelope.id
            try:
                state, seq = await self._step(actor, envelope, state, seq)
            finally:
                self.in_hand = None
            idle_since = anyio.current_time()
            every = self._cls.snapshot_every
            if every and self._cls.state_type is not None and seq - snapshot_seq >= every:
                await save_snapshot(self.pool, actor, state, seq)
                snapshot_seq = seq
        # Graceful stop: hand the actor back so another worker can claim it without waiting.
        await release(self.pool, self.worker_id, [self.actor_id])
        log.info("%s: stopping; lease released", self.actor_id)

    async def _idle(self, actor: Actor[Any], stopping: anyio.Event, idle_since: float) -> bool:
        """Wait for mail; True once the actor has passivated."""
        remaining = idle_since + self._cls.idle_seconds - anyio.current_time()
        if self._stop_requested:
            return False
        if remaining <= 0:
            return await release_if_idle(self.pool, self.actor_id, self.worker_id, self.epoch)
        self._wake = anyio.Event()
        self.idle = True
        try:
            with anyio.move_on_after(min(remaining, self._poll)):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(_set_when, stopping, self._wake)
                    await self._wake.wait()
                    tg.cancel_scope.cancel()
        finally:
            self.idle = False
        return False

    async def _step(
        self, actor: Actor[Any], envelope: Envelope, state: Any, seq: int
    ) -> tuple[Any, int]:
        cls = self._cls
        if envelope.deliveries > cls.max_deliveries:
            error = f"claimed {envelope.deliveries - 1} times without completing (worker crashes?)"
            await self._dead_letter(envelope, error)
        try:
            opened = open_envelope(envelope)
            ctx = Context(actor, state, seq, self.epoch, opened)
            await actor.handle(ctx, opened.payload)
            await commit_step(self.pool, self.worker_id, opened, ctx)
        except FencedOut:
            raise
        # Whatever the handler raised is charged to the message, not to the worker.
        except Exception as exc:  # noqa: BLE001
            error = "".join(traceback.format_exception_only(exc)).strip()
            log.warning("%s: message %d failed: %s", self.actor_id, envelope.id, error)
            attempts = await record_failure(
                self.pool, self.actor_id, self.worker_id, self.epoch, envelope.id, error
            )
            if attempts >= cls.max_attempts:
                await self._dead_letter(envelope, error, attempts=attempts)
            await self._sleep(min(_RETRY_CAP, cls.retry_base_seconds * 2 ** (attempts - 1)))
            return state, seq
        return ctx.state, ctx.seq

    async def _dead_letter(self, envelope: Envelope, error: str, *, attempts: int = 0) -> None:
        if attempts:
            envelope = attrs.evolve(envelope, attempts=attempts)
        await dead_letter(self.pool, self.actor_id, self.worker_id, self.epoch, envelope, error)
        log.error("%s: message %d dead-lettered: %s", self.actor_id, envelope.id, error)
        raise MessageDeadLettered(self.actor_id, envelope.id, error)


async def _set_when(source: anyio.Event, target: anyio.Event) -> None:
    await source.wait()
    target.set()
