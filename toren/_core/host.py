"""The actor host: runs one claimed actor until it passivates, is fenced out, or is stopped.

The loop: rebuild the state from the journal, then claim a message, hand it to the actor, and
commit the step (one fenced statement, which also claims the next message: a busy actor costs
one round trip per step). A handler exception is charged to the message, which is
retried with backoff and dead-lettered past its limit; the dead letter then surfaces as
:class:`MessageDeadLettered` so that the supervisor counts one restart of the actor. When the
mailbox stays empty for ``idle_seconds`` the host releases the lease and returns: no task and no
object of the actor remain.
"""

from __future__ import annotations

import asyncio
import logging
import random
import traceback
import uuid
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import anyio
import asyncpg
import attrs

from toren._core.actor import Actor, Context, Envelope, actor_class, actor_kinds
from toren._core.codec import decode
from toren._core.db import TRANSIENT_DB_ERRORS
from toren._core.errors import (
    ActorAlreadyExists,
    FencedOut,
    LeaseExpired,
    OverLimit,
    TorenError,
    UnknownActor,
    UnknownActorKind,
)
from toren._core.group_commit import BatchOutcomeUnknown, GroupCommit
from toren._core.journal import rebuild, save_snapshot, snapshot_spec
from toren._core.killpoints import kill_point, kill_points_for
from toren._core.leases import Claim, LeaseClock, release_claim, release_if_idle
from toren._core.logs import redact
from toren._core.mailbox import claim_next, commit_step, dead_letter, open_envelope, record_failure
from toren._core.resources import Resources
from toren._core.truncation import Archives, TruncationRefused, truncate_journal

log = logging.getLogger("toren.host")

_RETRY_CAP = 30.0
# A commit whose outcome is unknown (its answer lost): committed again, with ``retry``.
_COMMIT_AGAIN: tuple[type[BaseException], ...] = (*TRANSIENT_DB_ERRORS, BatchOutcomeUnknown)


def _jittered(delay: float) -> float:
    """``delay`` spread by +-20 % so that retries of many actors do not move in step."""
    return delay * (0.8 + 0.4 * random.random())


class ActorStartFailed(TorenError):
    """``on_start`` or the fold of the journal (``apply``) raised: a failed start."""

    def __init__(self, actor_id: str, cause: BaseException) -> None:
        self.actor_id = actor_id
        self.cause = cause
        super().__init__(f"{actor_id}: failed to start: {type(cause).__name__}: {cause}")


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
        lease: LeaseClock | None = None,
        snapshot_every: int | None = None,
        resources: Resources | None = None,
        commits: GroupCommit | None = None,
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
        # Events between two snapshots: the worker's setting if given, else the class's own;
        # never for a class that keeps none.
        self._snapshot_every = (snapshot_every or cls.snapshot_every) if snapshot_spec(cls) else 0
        self._poll = poll_seconds
        self._commits = commits
        self._sleep = sleep
        self._lease = lease
        self.resources = resources if resources is not None else Resources()
        self._wake = anyio.Event()
        self._stop = anyio.Event()
        self.idle = False
        self.steps = 0  # messages handled by this host, committed or charged
        self._leaving = False  # the last step re-routed the actor away from this worker
        self._next: Envelope | None = None  # claimed by the last step's commit
        self._refused = False  # a truncation was refused (said once)

    def wake(self) -> None:
        """Mail arrived for this actor (a notification); stop waiting."""
        self._wake.set()

    def request_stop(self) -> None:
        """Graceful stop from outside: finish the message in hand, release, return."""
        self._stop.set()
        self._wake.set()

    async def run(self, started: Callable[[], None], stopping: anyio.Event) -> None:
        """Run the actor until it passivates, is fenced out, or is asked to stop.

        On ``stopping`` (or :meth:`request_stop`) the message in hand is finished and the lease
        released, so another worker can claim the actor at once. A database error is not the
        actor's: the host waits and rebuilds, charging nothing. Whenever the host ends without
        handing the claim on (cancelled, or returning early), it releases the claim if it is
        still its own, so an actor is never left owned by a live worker that does not run it.

        Raises:
            MessageDeadLettered: a message was dead-lettered (counts one restart; the claim is
                kept for the restart).
            Exception: the actor failed to start (its state could not be rebuilt, or ``on_start``
                raised); counts one restart, the claim is kept.
        """
        settled = False  # the claim was handed on (released) or taken (fenced)
        error: Exception | None = None
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(_set_when, stopping, self._stop)
                try:
                    settled = await self._run_until_settled(started)
                except Exception as exc:  # noqa: BLE001  (re-raised below, outside the group)
                    error = exc
                    settled = True  # the supervisor restarts or gives up; the claim stays
                tg.cancel_scope.cancel()
            if error is not None:
                raise error
        finally:
            if not settled:
                with anyio.move_on_after(2, shield=True):
                    try:
                        await release_claim(self.pool, self.actor_id, self.worker_id, self.epoch)
                    except TRANSIENT_DB_ERRORS:
                        log.warning(
                            "%s: could not release its claim; it will expire", self.actor_id
                        )

    async def _run_until_settled(self, started: Callable[[], None]) -> bool:
        failures = 0
        steps_at_failure = -1
        while True:
            actor = self._cls(self.actor_id, self.claim.args)
            try:
                await self._run(actor, started)
                return True
            except FencedOut:
                log.info(
                    "%s: fenced out at epoch %d; it runs elsewhere now", self.actor_id, self.epoch
                )
                return True
            except LeaseExpired as exc:
                # Nothing of the step was done or recorded; the message stays queued. The claim
                # is released if it is still ours, so the actor goes on at once where a lease
                # holds (here again, under a new claim, or at another worker).
                log.warning("%s", exc)
                return False
            except _COMMIT_AGAIN as exc:
                # Not the actor's fault (a commit cut while stopping included: a batch's too):
                # no restart is charged. The state is rebuilt afresh once
                # the database answers again (the claim still holds, or the next write fences).
                # Back off on consecutive failures; progress since the last one starts afresh.
                failures = 1 if self.steps != steps_at_failure else failures + 1
                steps_at_failure = self.steps
                delay = _jittered(min(_RETRY_CAP, 0.05 * 2**failures))
                log.warning(
                    "%s: database error (%s); rebuilding in %.1fs", self.actor_id, exc, delay
                )
                del actor
                if await self._pause(delay):
                    return False

    async def _run(self, actor: Actor[Any], started: Callable[[], None]) -> None:
        archives = self.resources.find(Archives)
        rebuilt = await rebuild(self.pool, actor, archives=archives)
        kill_point("actor.rebuilt")
        state, seq, snapshot_seq = rebuilt.state, rebuilt.seq, rebuilt.snapshot_seq
        if rebuilt.archived and self._snapshot_every:
            # Folded from archives: a snapshot now, so that the next activation, and readers
            # that have no archive store (the API, the CLI), start from it.
            state = await self._snapshot(actor, state, seq)
            snapshot_seq = seq
        try:
            await actor.on_start(
                Context(
                    actor, state, seq, self.epoch, None, read_only=True, resources=self.resources
                )
            )
        except Exception as exc:
            # User code: whatever it raised (an OSError included) is a failed start, counted
            # against the actor's restart intensity, never mistaken for a database error.
            raise ActorStartFailed(self.actor_id, exc) from exc
        started()
        idle_since = anyio.current_time()
        self._next = None
        # A message claimed by the last commit is in hand: it is handled even after a stop.
        while not self._stop.is_set() or self._next is not None:
            # Re-armed before looking, so a notification that arrives meanwhile is not lost.
            self._wake = anyio.Event()
            envelope, self._next = self._next, None
            if envelope is None:
                try:
                    envelope = await claim_next(
                        self.pool, self.actor_id, self.worker_id, self.epoch
                    )
                except OverLimit:
                    # It waits in a limit's queue: it holds no worker meanwhile. The permit,
                    # when handed to it, wakes a worker to claim it.
                    if await release_claim(self.pool, self.actor_id, self.worker_id, self.epoch):
                        log.debug("%s: queued on a concurrency limit", self.actor_id)
                        return
                    raise FencedOut(self.actor_id, self.epoch) from None
            if envelope is None:
                if await self._idle(idle_since):
                    return
                continue
            kill_point("message.claimed")
            if envelope.is_timer:
                kill_point("timer.fired")
            # A graceful stop lets this step finish; only the supervisor's cancellation after
            # the grace period cuts it.
            state, seq = await self._step(actor, envelope, state, seq)
            self.steps += 1
            idle_since = anyio.current_time()
            if self._snapshot_every and seq - snapshot_seq >= self._snapshot_every:
                state = await self._snapshot(actor, state, seq)
                snapshot_seq = seq  # written or not: tried again after as many events
                await self._truncate(actor, state)
            if self._leaving:
                # Re-routed where this worker does not serve: handed to a worker that does.
                if await release_claim(self.pool, self.actor_id, self.worker_id, self.epoch):
                    log.info("%s: re-routed; handed over", self.actor_id)
                    return
                raise FencedOut(self.actor_id, self.epoch)
        # Graceful stop: hand the actor back so another worker can claim it without waiting.
        if await release_claim(self.pool, self.actor_id, self.worker_id, self.epoch):
            log.info("%s: stopping; lease released", self.actor_id)
        else:
            raise FencedOut(self.actor_id, self.epoch)

    async def _snapshot(self, actor: Actor[Any], state: Any, seq: int) -> Any:
        """Store a snapshot of ``state``; the state to go on with.

        A snapshot is derived data: one that cannot be written (a state the converter cannot
        write, a database error) is logged, and the actor goes on without it; its step is
        committed already, so nothing is charged or done again."""
        try:
            return await save_snapshot(self.pool, actor, state, seq)
        except Exception as exc:
            log.warning(
                "%s: no snapshot at seq %d (%s: %s); the actor goes on without it",
                self.actor_id,
                seq,
                type(exc).__name__,
                exc,
                exc_info=not isinstance(exc, TRANSIENT_DB_ERRORS),
            )
            return state

    async def _truncate(self, actor: Actor[Any], state: Any) -> None:
        """Archive and delete the journal's events before its snapshot that the actor keeps no
        longer (:meth:`Actor.journal_keep_for`). Like a snapshot, never the actor's failure: an
        error is logged and the journal kept whole, to be tried after the next snapshot."""
        try:
            keep_for = actor.journal_keep_for(state, self.resources)
            if keep_for is None:
                return
            archives = self.resources.find(Archives)
            store = archives.store if archives else None
            # A long journal (a retention newly set) is caught up a batch at a time.
            while await truncate_journal(self.pool, store, self.actor_id, keep_for=keep_for):
                pass
        except TruncationRefused as exc:
            if not self._refused:  # once per host: it would say so after every snapshot
                log.warning("%s", exc)
            self._refused = True
        except Exception as exc:  # the step is committed: the journal is kept
            log.warning(
                "%s: its journal was not truncated (%s: %s); kept whole until the next snapshot",
                self.actor_id,
                type(exc).__name__,
                exc,
                exc_info=not isinstance(exc, TRANSIENT_DB_ERRORS),
            )

    async def _idle(self, idle_since: float) -> bool:
        """Wait for mail; True once the actor has passivated."""
        remaining = idle_since + self._cls.idle_seconds - anyio.current_time()
        if remaining <= 0:
            return await release_if_idle(self.pool, self.actor_id, self.worker_id, self.epoch)
        self.idle = True
        try:
            with anyio.move_on_after(min(remaining, self._poll)):
                await self._wake.wait()
        finally:
            self.idle = False
        return False

    async def _pause(self, seconds: float) -> bool:
        """Sleep, but wake early for a stop request; True if a stop was requested."""
        with anyio.move_on_after(seconds):
            await self._stop.wait()
        return self._stop.is_set()

    async def _step(
        self, actor: Actor[Any], envelope: Envelope, state: Any, seq: int
    ) -> tuple[Any, int]:
        cls = self._cls
        if envelope.deliveries > cls.max_deliveries:
            error = f"claimed {envelope.deliveries - 1} times without completing (worker crashes?)"
            await self._dead_letter(actor, envelope, error, state, seq)
        try:
            opened = open_envelope(envelope)
            ctx = Context(
                actor, state, seq, self.epoch, opened, lease=self._lease, resources=self.resources
            )
            await actor.handle(ctx, opened.payload)
            summary = actor.summarize(ctx.state) if ctx.events else None
            release = not actor.runs(ctx.state)
        # Whatever the handler raised is charged to the message, not to the worker.
        except Exception as exc:  # noqa: BLE001
            await self._charge(actor, envelope, exc, state, seq)
            return state, seq
        except asyncio.CancelledError as exc:
            task = asyncio.current_task()
            if task is None or task.cancelling():
                raise  # we are being cancelled: let it through
            # A cancellation that leaked out of the handler (a library cancelled a future it
            # awaited) is the handler's failure, not a stop of the worker's tree.
            await self._charge(actor, envelope, RuntimeError(f"handler raised {exc!r}"), state, seq)
            return state, seq
        kill_point("step.committing")
        kill_points_for("committing:", (e[1] for e in ctx.events))
        try:
            await self._commit(actor, opened, ctx, summary, state, seq, release=release)
        except (UnknownActor, ActorAlreadyExists) as exc:
            # What the handler asked for cannot be committed: its fault, charged likewise.
            await self._charge(actor, envelope, exc, state, seq)
            return state, seq
        kill_point("step.committed")
        kill_points_for("committed:", (e[1] for e in ctx.events))
        if ctx.outgoing:
            kill_point("outbox.inserted")
        if envelope.sender is not None:
            kill_point("outbox.consumed")
        return ctx.state, ctx.seq

    async def _commit(
        self,
        actor: Actor[Any],
        envelope: Envelope,
        ctx: Context[Any],
        summary: Mapping[str, Any] | None,
        state: Any,
        seq: int,
        *,
        release: bool = False,
    ) -> None:
        """Commit the step; on a database error, commit the same step again.

        The handler's work (a model call, a tool run) is not done again for a failed commit:
        after a dropped connection the same step is committed once the database answers (a
        commit whose answer was lost may have landed: the retry then finds the message consumed
        while the actor is still ours, which only our own commit can do). A commit the database
        refuses (any other error) is charged to the message like a handler failure and tried
        again with backoff; past ``max_attempts`` the message is dead-lettered, and the actor's
        :meth:`~toren.Actor.on_dead_letter` records what that means, so that a refused write
        ends visibly instead of running the handler's effects again.

        Raises:
            FencedOut: the actor is no longer ours.
            MessageDeadLettered: the database kept refusing the step.
            Exception: a database error, if a stop is requested while retrying (the message
                stays queued and is handled again).
        """
        failures = 0
        while True:
            try:
                self._next = await commit_step(
                    self.pool,
                    self.worker_id,
                    envelope,
                    ctx,
                    retry=failures > 0,
                    summary=summary,
                    claim=not self._stop.is_set() and not ctx.leaving,
                    release=release,
                    via=self._commits,
                )
                self._leaving = ctx.leaving
                return
            except _COMMIT_AGAIN as exc:
                failures += 1
                delay = _jittered(min(_RETRY_CAP, 0.05 * 2**failures))
                log.warning(
                    "%s: database error committing message %d (%s); committing again in %.2fs",
                    self.actor_id,
                    envelope.id,
                    exc,
                    delay,
                )
                if await self._pause(delay):
                    raise
            except asyncpg.PostgresError as exc:
                failures += 1
                error = f"the database refused the step: {_describe(exc)}"
                attempts = await self._record(envelope, error)
                if attempts == 0:
                    return  # the message is gone: an earlier attempt did land after all
                if attempts >= self._cls.max_attempts:
                    envelope = attrs.evolve(envelope, attempts=attempts)
                    await self._dead_letter(actor, envelope, error, state, seq)
                if await self._pause(self._retry_delay(attempts)):
                    raise

    async def _record(self, envelope: Envelope, error: str) -> int:
        log.warning("%s: message %d failed: %s", self.actor_id, envelope.id, error)
        return await record_failure(
            self.pool, self.actor_id, self.worker_id, self.epoch, envelope.id, error
        )

    def _retry_delay(self, attempts: int) -> float:
        return _jittered(min(_RETRY_CAP, self._cls.retry_base_seconds * 2 ** (attempts - 1)))

    async def _charge(
        self, actor: Actor[Any], envelope: Envelope, exc: Exception, state: Any, seq: int
    ) -> None:
        """Record a failed attempt; dead-letter past the limit; else back off before retrying."""
        attempts = await self._record(envelope, _describe(exc))
        if attempts == 0:
            return  # the message is gone: a commit did land after all
        if attempts >= self._cls.max_attempts:
            envelope = attrs.evolve(envelope, attempts=attempts)
            await self._dead_letter(actor, envelope, _describe(exc), state, seq)
        await self._pause(self._retry_delay(attempts))

    async def _dead_letter(
        self, actor: Actor[Any], envelope: Envelope, error: str, state: Any, seq: int
    ) -> None:
        """Dead-letter the message, with what the actor records about it, and raise.

        Raises:
            MessageDeadLettered: always (the supervisor counts one restart).
            FencedOut: the actor is no longer ours.
        """
        ctx = Context(actor, state, seq, self.epoch, envelope, resources=self.resources)
        try:
            payload = decode(envelope.kind, envelope.body)
        except Exception:  # noqa: BLE001  (an undecodable message is what is being dead-lettered)
            payload = None
        try:
            actor.on_dead_letter(ctx, payload, error)
            summary = actor.summarize(ctx.state) if ctx.events else None
            release = not actor.runs(ctx.state)
        except Exception:
            log.exception("%s: on_dead_letter raised; dead-lettering without it", self.actor_id)
            ctx = Context(actor, state, seq, self.epoch, envelope, resources=self.resources)
            summary = None
            release = False
        try:
            missing = await dead_letter(
                self.pool, self.worker_id, envelope, ctx, error, summary=summary, release=release
            )
        except (UnknownActor, ActorAlreadyExists):
            # What on_dead_letter sent or spawned cannot be: its events go without them.
            log.exception(
                "%s: on_dead_letter's sends refused; dead-lettering with its events only",
                self.actor_id,
            )
            ctx.outgoing.clear()
            ctx.spawns.clear()
            ctx.cancelled_timers.clear()
            missing = await dead_letter(
                self.pool, self.worker_id, envelope, ctx, error, summary=summary, release=release
            )
        if missing:
            log.warning(
                "%s: dead-lettering message %d: nothing sent to %s (no such actor)",
                self.actor_id,
                envelope.id,
                ", ".join(missing),
            )
        log.error("%s: message %d dead-lettered: %s", self.actor_id, envelope.id, error)
        raise MessageDeadLettered(self.actor_id, envelope.id, error)


def _describe(exc: BaseException) -> str:
    """The exception's type and message, at most 2,000 characters (what failure columns and a
    run's ``internal`` failure hold; an exception can carry a hostile, huge message), with
    anything shaped like a bot token removed (an HTTP client's error may quote its URL)."""
    text = redact("".join(traceback.format_exception_only(exc)).strip())
    return text if len(text) <= 2000 else f"{text[:2000]}... ({len(text)} characters)"


async def _set_when(source: anyio.Event, target: anyio.Event) -> None:
    await source.wait()
    target.set()
