"""Group commit: the steps of many busy actors committed together, one round trip and one flush.

Each step is one statement (:data:`toren._core.step_sql.STEP`). Alone, a step runs it at once,
in a transaction of its own, as it always did. Under load, steps that arrive while every lane
is busy queue; when a lane frees, the oldest waiter leads: it takes the queue (up to
``max_batch`` steps) and sends every step's statement in one pipeline (asyncpg's ``fetchmany``:
one network write, one transaction, one commit and one WAL flush for the batch), then hands each
member its own row. Nothing is acknowledged before the batch's commit returns.

Each statement is fenced on its own: a step whose actor is no longer ours finds no row to fence
and does nothing, in the batch as alone, and its member learns it from its own row while its
batch-mates commit. A statement that raises (a seq written by a newer owner, a recipient that
does not exist, a write the database refuses) aborts the batch's transaction, so nothing of it
commits: each member's step is then committed alone, one after another on the batch's lane, and
the failing one fails alone, with the error it would have had alone. A batch whose outcome the
worker never learned (the connection lost mid-commit, the leader cancelled) is
:class:`BatchOutcomeUnknown` to every member: unknown, never failed or done. The host commits
the step again with ``retry``, which finds it landed by its message being gone while the actor
is still ours.

No task is started here: the waiter that leads is a host's own task, already waiting for its
step.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Sequence
from typing import Any

import anyio
import asyncpg
import attrs

from toren._core.db import TRANSIENT_DB_ERRORS
from toren._core.errors import InternalError, TorenError
from toren._core.killpoints import kill_point

log = logging.getLogger("toren.group_commit")


class BatchOutcomeUnknown(TorenError):
    """The batch holding this step may or may not have committed: commit it again to learn."""


@attrs.define(eq=False)
class _Waiter:
    statement: str
    args: Sequence[Any]
    turn: anyio.Event = attrs.field(factory=anyio.Event)
    lead: bool = False  # woken to lead a batch, not with its row
    row: asyncpg.Record | None = None
    error: BaseException | None = None


@attrs.define(eq=False)
class GroupCommit:
    """Commits step statements for one worker: at once while a lane is free, else in batches.

    Attributes:
        pool: the worker's pool.
        lanes: batches (or lone steps) in flight at once, each on a connection of its own.
        max_batch: the most steps in one batch (a batch's steps share its locks until its
            commit; Postgres keeps up to 64 subtransactions per backend cached, and a batch
            holds none, but locks held longer delay other workers' claims).
    """

    pool: asyncpg.Pool
    lanes: int = 2
    max_batch: int = 32
    batches: int = 0  # batches of more than one step sent (for the benchmark and tests)
    batched: int = 0  # steps sent in them
    _busy: int = 0
    _queue: collections.deque[_Waiter] = attrs.field(factory=collections.deque)

    async def fetchrow(self, statement: str, args: Sequence[Any]) -> asyncpg.Record | None:
        """Run ``statement`` with ``args``, alone or in a batch; its row once committed.

        Raises:
            BatchOutcomeUnknown: the batch's commit was sent and its answer lost.
            asyncpg.PostgresError: the statement failed (alone, as without batching).
            InternalError: the batch committed, but ``statement`` did not answer exactly one row
                for each of its steps (the step statement always does), so no step can be told
                its row.
        """
        if self._busy < self.lanes and not self._queue:
            self._busy += 1
            try:
                return await self.pool.fetchrow(statement, *args)
            finally:
                self._free()
        waiter = _Waiter(statement, args)
        self._queue.append(waiter)
        try:
            await waiter.turn.wait()
        except BaseException:
            if waiter in self._queue:
                self._queue.remove(waiter)
            elif waiter.lead:
                self._free()  # woken to lead, and cancelled before it could
            raise
        if waiter.lead and await self._lead(statement, waiter):
            try:
                return await self.pool.fetchrow(statement, *args)
            finally:
                self._free()
        if waiter.error is not None:
            raise waiter.error
        return waiter.row

    async def _lead(self, statement: str, leader: _Waiter) -> bool:
        """Send the queue's oldest steps (``leader``'s first) as a batch, holding the lane.

        Returns:
            True: ``leader`` is alone in the queue (it runs its step itself, holding the lane).
        """
        batch = [leader]
        while self._queue and len(batch) < self.max_batch and self._queue[0].statement == statement:
            batch.append(self._queue.popleft())
        if len(batch) == 1:
            return True
        try:
            self.batches += 1
            self.batched += len(batch)
            if log.isEnabledFor(logging.DEBUG):  # a chaos cell reads its members from here
                log.debug("sending a batch of %d steps: %s", len(batch), [w.args[0] for w in batch])
            kill_point("batch.sending")
            # Sent in actor id order (each statement fences its actor's row, share-locked to
            # the commit), the order in which the worker's lease renewal locks those rows: in
            # any other, a batch holding one row and waiting for another can deadlock with it.
            batch.sort(key=lambda w: w.args[0])
            try:
                rows = await self.pool.fetchmany(statement, [w.args for w in batch])
            except TRANSIENT_DB_ERRORS as exc:
                self._settle(batch, error=BatchOutcomeUnknown(f"a batch's commit was cut: {exc}"))
                return False
            except asyncpg.PostgresError:
                await self._one_by_one(batch)
                return False
            except BaseException:
                self._settle(batch, error=BatchOutcomeUnknown("a batch's leader was stopped"))
                raise
            kill_point("batch.committed")
            log.debug("a batch of %d steps committed", len(batch))
            if len(rows) != len(batch):
                # Its rows come as one list: which belongs to which step cannot be told.
                what = f"a batch of {len(batch)} steps committed with {len(rows)} rows"
                self._settle(batch, error=InternalError(f"{what}, not one each"))
                return False
            for waiter, row in zip(batch, rows, strict=True):
                waiter.row = row
                waiter.turn.set()
            return False
        finally:
            self._free()

    async def _one_by_one(self, batch: list[_Waiter]) -> None:
        """The batch failed and nothing of it committed: commit each step alone, one after
        another on the lane the batch held (retried at once, a failed batch's steps would take
        the pool's connections from the claims and the lease renewals), each told its own row
        or error, as if it had never been batched."""
        for done, waiter in enumerate(batch):
            try:
                waiter.row = await self.pool.fetchrow(waiter.statement, *waiter.args)
            except Exception as exc:  # noqa: BLE001 (its own step's error, raised by its host)
                waiter.error = exc
            except BaseException:
                self._settle(
                    batch[done:], error=BatchOutcomeUnknown("a batch's leader was stopped")
                )
                raise
            waiter.turn.set()

    @staticmethod
    def _settle(batch: list[_Waiter], *, error: BaseException) -> None:
        for waiter in batch:
            waiter.error = error
            waiter.turn.set()

    def _free(self) -> None:
        """A lane is free: the oldest waiter leads the next batch with it."""
        self._busy -= 1
        if self._queue:
            self._busy += 1
            leader = self._queue.popleft()
            leader.lead = True
            leader.turn.set()
