"""The pruner: prunes its agent's ended runs on a timer, batch by batch (``retention/<agent>``).

Each wake (its timer every ``prune_every``, a worker's start, ``toren jobs prune``) it runs
batches (:func:`toren.runs.prune.prune_batch`) while they come back full, at most
``BATCHES_PER_STEP`` in one step (then it wakes itself again at once, so that a long backlog
never holds one message for long), and sets its timer. A batch is idempotent: a pruner killed
in the middle of one runs it again, and two pruners of one agent at once (a lease taken over
while the old worker still ran) skip each other's rows. So it needs no fencing of its own, and
it records no events (see :mod:`toren.retention.messages`).
"""

from __future__ import annotations

import logging
from datetime import datetime
from typing import Any

import attrs

from toren import Actor, Context, Retention
from toren.retention.messages import PRUNER_KIND, PRUNER_PREFIX, PruneNow, PruneTick
from toren.retention.runtime import Pruners
from toren.runs.prune import prune_batch

log = logging.getLogger("toren.retention")

BATCHES_PER_STEP = 10
"""Full batches one step runs at most before it lets its mailbox in again."""

TIMER = "prune"

RETRY_AFTER = 10.0
"""Seconds before a pruner whose batch failed unexpectedly tries again (a connection cut, a
store down): sooner than its ``prune_every``, never in a loop."""


@attrs.frozen
class PrunerState:
    """Nothing: a pruner's work is in the prune log and the audit records."""


class Pruner(Actor[PrunerState]):
    kind = PRUNER_KIND
    idle_seconds = 1.0  # it sleeps on its timer
    state_type = PrunerState

    # Where the wake's batches go on from (a root's created_at and id): past the trees the
    # batch before left. Kept only while the pruner is awake: a wake starts from the oldest.
    _after: tuple[datetime, str] | None = None

    def initial_state(self) -> PrunerState:
        return PrunerState()

    def apply(self, state: PrunerState, event: Any) -> PrunerState:
        return state

    @property
    def agent(self) -> str:
        return self.actor_id.removeprefix(PRUNER_PREFIX)

    async def handle(self, ctx: Context[PrunerState], msg: Any) -> None:
        if not isinstance(msg, PruneTick | PruneNow):
            return
        pruners = ctx.resources.get(Pruners)
        policy = pruners.policy(self.agent)
        if policy is None:
            # No policy here any more (a deploy took it away): it sleeps until a worker that
            # has one starts and wakes it.
            log.info("%s: no retention policy here: not pruning", self.actor_id)
            ctx.cancel_timer(TIMER)
            return
        try:
            more = await self._prune(policy, pruners)
        except Exception:
            # A database or store failure the batch did not expect: the runs stay, and the
            # timer is set all the same, to try again soon (a handler that raised would be
            # retried, then dead-lettered with no timer left to wake the pruner again).
            log.warning("%s: prune failed; trying again in %.0f s", self.actor_id,
                        min(RETRY_AFTER, pruners.every), exc_info=True)  # fmt: skip
            self._after = None
            ctx.set_timer(TIMER, min(RETRY_AFTER, pruners.every), PruneTick())
            return
        ctx.set_timer(TIMER, 0.0 if more else pruners.every, PruneTick())

    async def _prune(self, policy: Retention, pruners: Pruners) -> bool:
        """Up to ``BATCHES_PER_STEP`` batches; whether more are due at once (every batch came
        back full)."""
        if not policy.prunes_runs:
            # A policy with only conversation_keep_for prunes no ended runs: its wakes are for
            # bounding the conversations' journals.
            return False
        store = await pruners.store() if policy.archive else None
        for _ in range(BATCHES_PER_STEP):
            result = await prune_batch(
                pruners.pool,
                self.agent,
                policy,
                batch=pruners.batch,
                lock_timeout=pruners.lock_timeout,
                store=store,
                after=self._after,
            )
            if result.found < pruners.batch:
                self._after = None  # the newest reached: the next wake starts from the oldest
                return False
            # Past the trees this batch pruned or left (one whose journal is not folded here
            # may be left for good: from the oldest again, it would fill every batch).
            self._after = result.last
        return True
