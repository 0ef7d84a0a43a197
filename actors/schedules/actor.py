"""The schedule actor: starts its agent's runs on a clock, one run per slot at most.

Each wake (its timer, a declaration, a resume) it reads the worker's clock, counts the slots
that came while no worker ran and are older than its catch-up window as missed, deals with
the others in order under its overlap policy, and sets its timer for the next slot (plus its
jitter). A slot's run is spawned, sent its start and recorded on the schedule's journal in
one step: the run's id derives from the agent and the idempotency key
``schedule/<name>/<slot>``, so whatever is retried, killed or run on another worker, a slot
starts one run. The runs it starts tell it of their ends (``watcher``), which is how it knows
what is in flight.
"""

from __future__ import annotations

import logging
from typing import Any

from toren import Actor, ChildFailed, Context, Principal
from toren.actors.schedules.runtime import Schedules
from toren.kernel import Clock, actor_row
from toren.runs import RUN_KIND, Cancel, ChildEnded, StartRun, agent_route, agents_of
from toren.runs.audit import audit_record
from toren.runs.client import MessageTooLarge, check_message, keyed_run_id, start_args
from toren.runs.limits import child_limits, key_limit
from toren.schedules import Schedule, ScheduleError, render_input, slot_key
from toren.schedules.client import OVERLAPS
from toren.schedules.events import (
    SCHEDULE_PREFIX,
    Backfill,
    Declare,
    Declared,
    Delete,
    Deleted,
    How,
    Pause,
    Paused,
    Resume,
    Resumed,
    ScheduledRunEnded,
    SlotBuffered,
    SlotSkipped,
    SlotsMissed,
    SlotStarted,
    Tick,
    Trigger,
    slot_idempotency_key,
)
from toren.schedules.state import ScheduleState, fold, summary

log = logging.getLogger("toren.schedules")

GRACE = 60.0
"""Seconds a slot's timer may come late and the slot still fire as on time (a worker's
takeover, a busy database); later than that and its catch-up window, it is missed."""

MISSED_COUNTED = 10_000
"""Missed slots counted one by one per wake; past that the count says "more than"."""

FIRED_PER_STEP = 50
"""Slots one step starts at most; the rest are dealt with by the next (the timer set at once)."""

TIMER = "tick"


class ScheduleActor(Actor[ScheduleState]):
    kind = "schedule"
    idle_seconds = 1.0  # it sleeps on its timer: no reason to stay in memory
    snapshot_every = 500
    state_type = ScheduleState

    def initial_state(self) -> ScheduleState:
        return ScheduleState()

    def apply(self, state: ScheduleState, event: Any) -> ScheduleState:
        return fold(state, event)

    def summarize(self, state: ScheduleState) -> dict[str, Any]:
        return summary(state)

    @property
    def name(self) -> str:
        return self.actor_id.removeprefix(SCHEDULE_PREFIX)

    async def handle(self, ctx: Context[ScheduleState], msg: Any) -> None:
        clock = ctx.resources.find(Clock) or Clock()
        now = clock.now()
        if isinstance(msg, Declare):
            await self._declare(ctx, msg, now)
        elif isinstance(msg, Tick):
            await self._advance(ctx, now)
        elif isinstance(msg, ChildEnded | ChildFailed):
            await self._ended(ctx, msg, now)
        elif isinstance(msg, Pause):
            if not ctx.state.paused and not ctx.state.deleted:
                ctx.emit(Paused(reason=msg.reason, by=msg.by, at=now))
                ctx.cancel_timer(TIMER)
        elif isinstance(msg, Resume):
            if ctx.state.paused and not ctx.state.deleted:
                ctx.emit(Resumed(by=msg.by, at=now))
                await self._drain(ctx, now)
                await self._advance(ctx, now)
        elif isinstance(msg, Trigger):
            schedule = self._schedule(ctx)
            if schedule is not None:
                key = f"manual-{msg.id}"
                await self._start(ctx, schedule, now, key, "manual", now, by=msg.by)
        elif isinstance(msg, Backfill):
            await self._backfill(ctx, msg, now)
        elif isinstance(msg, Delete) and not ctx.state.deleted and ctx.state.schedule:
            ctx.emit(Deleted(by=msg.by, at=now))
            ctx.cancel_timer(TIMER)

    # -- declarations and the clock --------------------------------------------------------------

    def _schedule(self, ctx: Context[ScheduleState]) -> Schedule | None:
        state = ctx.state
        if state.schedule is None or state.deleted:
            return None
        # Leniently: a declaration a newer version recorded may hold fields this one lacks.
        return Schedule.from_json(state.schedule, strict=False)

    async def _declare(self, ctx: Context[ScheduleState], msg: Declare, now: float) -> None:
        try:
            Schedule.from_json(msg.schedule)
        except (ScheduleError, TypeError, ValueError) as exc:
            # Checked where it was declared: one that is not valid here came from elsewhere.
            log.warning("%s: a declaration that is not valid was ignored: %s", ctx.actor_id, exc)
            return
        state = ctx.state
        same = (state.schedule, state.agent, state.source) == (msg.schedule, msg.agent, msg.source)
        if not same or state.deleted:
            ctx.emit(
                Declared(
                    agent=msg.agent, schedule=msg.schedule, source=msg.source, by=msg.by, at=now
                )
            )
        await self._advance(ctx, now)

    async def _advance(self, ctx: Context[ScheduleState], now: float) -> None:
        """Deal with the slots due by ``now`` and set the timer for the next."""
        schedule = self._schedule(ctx)
        if schedule is None or ctx.state.paused:
            ctx.cancel_timer(TIMER)
            return
        spec = schedule.spec
        late = GRACE + spec.jitter
        horizon = now - max(schedule.catch_up, late)
        cursor = ctx.state.cursor if ctx.state.cursor is not None else now
        if cursor < horizon:
            missed = spec.slots(cursor, horizon, MISSED_COUNTED + 1)
            if missed:
                more = len(missed) > MISSED_COUNTED
                counted = missed[:MISSED_COUNTED]
                last = horizon if more else counted[-1]
                ctx.emit(
                    SlotsMissed(count=len(counted), first=counted[0], last=last, more=more, at=now)
                )
        cursor = ctx.state.cursor if ctx.state.cursor is not None else now
        due = spec.slots(cursor, now, FIRED_PER_STEP)
        for slot in due:
            how: How = "on_time" if now - slot <= late else "catch_up"
            await self._fire(ctx, schedule, slot, how, schedule.overlap, now)
        if len(due) == FIRED_PER_STEP:
            ctx.set_timer(TIMER, 0.0, Tick())  # more are due: the next step takes them
            return
        following = spec.next_slot(ctx.state.cursor if ctx.state.cursor is not None else now)
        if following is None:
            ctx.cancel_timer(TIMER)  # past its end
            return
        delay = max(0.0, following - now) + spec.delay_for(following, self.name)
        ctx.set_timer(TIMER, delay, Tick())

    # -- slots -----------------------------------------------------------------------------------

    async def _fire(
        self,
        ctx: Context[ScheduleState],
        schedule: Schedule,
        slot: float,
        how: How,
        overlap: str,
        now: float,
        by: Principal | None = None,
    ) -> None:
        """Start ``slot``'s run, or skip or buffer it, as ``overlap`` says."""
        key = slot_key(slot)
        if any(b[1] == key for b in ctx.state.buffered):
            return  # waiting already (a second backfill over it): one place in line is enough
        in_flight = ctx.state.in_flight
        if in_flight and overlap != "allow_all":
            if overlap == "skip":
                reason = f"{in_flight[-1]} was still in flight (overlap: skip)"
                ctx.emit(SlotSkipped(slot=slot, key=key, reason=reason, at=now))
                return
            if overlap == "buffer_one" and ctx.state.buffered:
                reason = "a slot was waiting already (overlap: buffer_one)"
                ctx.emit(SlotSkipped(slot=slot, key=key, reason=reason, at=now))
                return
            if overlap in ("buffer_one", "buffer_all"):
                ctx.emit(SlotBuffered(slot=slot, key=key, how=how, at=now))
                return
            if overlap == "cancel_other":
                for run in in_flight:
                    reason = f"schedule {self.name}: slot {key} replaces it (overlap: cancel_other)"
                    cancel = Cancel(by=self._principal(), who=self.name, reason=reason)
                    # On the user lane, behind the run's start: a run started in this same step
                    # must start before it is cancelled (a run takes its system lane first).
                    ctx.send(run, cancel)
        await self._start(ctx, schedule, slot, key, how, now, by=by)

    async def _start(
        self,
        ctx: Context[ScheduleState],
        schedule: Schedule,
        slot: float,
        key: str,
        how: How,
        now: float,
        *,
        by: Principal | None = None,
    ) -> None:
        """Spawn the slot's run and send it its start, in this step (see the module)."""
        agent = ctx.state.agent
        run = keyed_run_id(agent, slot_idempotency_key(self.name, key))
        # A run under the slot's key exists already (a backfill over a slot that fired, a run
        # started by hand with the key): it is not this slot's to start, nor to wait for.
        # (A run pruned since, by its agent's retention, was started too: its audit record says.)
        known = any(r.run == run for r in ctx.state.recent)
        pool = ctx.resources.get(Schedules).pool
        if known or await actor_row(pool, run) is not None or await audit_record(pool, run):
            reason = f"its run {run} was started already"
            ctx.emit(SlotSkipped(slot=slot, key=key, reason=reason, at=now))
            return
        text = render_input(schedule.input, slot, schedule.timezone, self.name)
        try:
            check_message(text, what="input")
        except MessageTooLarge as exc:  # a template near the cap, its placeholders filled
            ctx.emit(SlotSkipped(slot=slot, key=key, reason=f"not started: {exc}", at=now))
            return
        args: dict[str, Any] = {**start_args(agent, text), "schedule": self.name, "slot": key}
        # Under its agent's cap and, with a concurrency key, that key's (taken first, as a run
        # started through the API takes them): it waits, queued, while they are full.
        limits = list(child_limits(agents_of(ctx).named(agent), agent))
        if schedule.concurrency_key is not None:
            args["concurrency_key"] = schedule.concurrency_key
            limits.insert(0, key_limit(agent, schedule.concurrency_key))
        ctx.spawn(RUN_KIND, run, args, route=agent_route(agent), limits=limits)
        start = StartRun(agent=agent, input=text, by=by or self._principal(), watcher=ctx.actor_id)
        ctx.send(run, start, dedupe_key="start")
        ctx.emit(SlotStarted(slot=slot, key=key, run=run, how=how, at=now, by=by))

    def _principal(self) -> Principal:
        return Principal(kind="schedule", id=self.actor_id, name=self.name, via="schedule")

    async def _ended(
        self, ctx: Context[ScheduleState], msg: ChildEnded | ChildFailed, now: float
    ) -> None:
        run = msg.run_id if isinstance(msg, ChildEnded) else msg.actor_id
        if run not in ctx.state.in_flight:
            return  # an end heard before (a run retried by hand ends again)
        if isinstance(msg, ChildEnded):
            status, error_class = msg.status, msg.error_class
        else:
            status, error_class = "failed", "crashloop"
        ctx.emit(ScheduledRunEnded(run=run, status=status, error_class=error_class, at=now))
        schedule = self._schedule(ctx)
        if schedule is None:
            return
        if schedule.pause_on_failure and status == "failed" and not ctx.state.paused:
            reason = f"its run {run} failed ({error_class}): paused on failure"
            ctx.emit(Paused(reason=reason, at=now))
            ctx.cancel_timer(TIMER)
            return
        await self._drain(ctx, now)

    async def _drain(self, ctx: Context[ScheduleState], now: float) -> None:
        """Start the oldest buffered slot if nothing is in flight."""
        schedule = self._schedule(ctx)
        state = ctx.state
        if schedule is None or state.paused or state.in_flight or not state.buffered:
            return
        slot, key, _ = state.buffered[0]
        await self._start(ctx, schedule, slot, key, "buffered", now)

    async def _backfill(self, ctx: Context[ScheduleState], msg: Backfill, now: float) -> None:
        schedule = self._schedule(ctx)
        if schedule is None:
            return
        # Checked where it was sent (toren.schedules.client.backfill): one that is not valid
        # here came from elsewhere, and is ignored rather than retried into a dead letter.
        try:
            slots = (
                schedule.spec.slots(msg.start, min(msg.end, now), FIRED_PER_STEP * 20)
                if msg.overlap in OVERLAPS and msg.start < msg.end
                else None
            )
        except ScheduleError:
            slots = None
        if slots is None:
            log.warning("%s: a backfill that is not valid was ignored: %r", ctx.actor_id, msg)
            return
        for slot in slots:
            await self._fire(ctx, schedule, slot, "backfill", msg.overlap, now, by=msg.by)
