"""A schedule's state, folded from its journal, and the summary kept on its row.

The **cursor** is the newest slot the schedule dealt with (started, skipped, buffered or
missed): the slots after it are the ones still to come. A declaration sets it to when it was
made if it is older (a new or changed schedule fires the slots after its declaration, never
earlier ones), and so does a resume (the slots of a pause are not fired afterwards). A run
started by hand (``trigger``) moves nothing; a backfill moves it only forward.
"""

from __future__ import annotations

from typing import Any

import attrs

from toren.schedules.events import (
    Declared,
    Deleted,
    Paused,
    Resumed,
    ScheduledRunEnded,
    SlotBuffered,
    SlotSkipped,
    SlotsMissed,
    SlotStarted,
)

RECENT = 20
"""Slots a schedule's state remembers (its listing shows the newest of them)."""


@attrs.frozen(kw_only=True)
class SlotRecord:
    """One slot the schedule dealt with: ``outcome`` is ``started``, ``skipped`` or
    ``buffered``; ``status`` the started run's end, once the schedule heard of it."""

    key: str
    slot: float
    outcome: str
    how: str = ""
    run: str | None = None
    reason: str = ""
    status: str | None = None


@attrs.frozen(kw_only=True)
class ScheduleState:
    agent: str = ""
    schedule: dict[str, Any] | None = None  # a Schedule as JSON
    source: str = ""
    declared_at: float = 0.0
    cursor: float | None = None
    paused: bool = False
    paused_reason: str = ""
    deleted: bool = False
    in_flight: tuple[str, ...] = ()  # runs it started that it has not heard end of
    buffered: tuple[tuple[float, str, str], ...] = ()  # (slot, key, how), oldest first
    recent: tuple[SlotRecord, ...] = ()  # oldest first, at most RECENT
    started: int = 0
    skipped: int = 0
    missed: int = 0
    last_reason: str = ""  # why the last slot that did not start did not


def _later(cursor: float | None, slot: float) -> float:
    return slot if cursor is None else max(cursor, slot)


def _remember(state: ScheduleState, record: SlotRecord) -> tuple[SlotRecord, ...]:
    return (*state.recent, record)[-RECENT:]


def fold(state: ScheduleState, event: Any) -> ScheduleState:
    """The state after ``event`` (events of other types leave it as it is)."""
    if isinstance(event, Declared):
        fresh = state.schedule is None or state.deleted
        base = ScheduleState() if fresh else state
        return attrs.evolve(
            base,
            agent=event.agent,
            schedule=event.schedule,
            source=event.source,
            declared_at=event.at,
            cursor=_later(base.cursor, event.at),
        )
    if isinstance(event, SlotStarted):
        moves = event.how in ("on_time", "catch_up", "backfill")
        return attrs.evolve(
            state,
            in_flight=(*state.in_flight, event.run),
            buffered=tuple(b for b in state.buffered if b[1] != event.key),
            recent=_remember(
                state,
                SlotRecord(
                    key=event.key, slot=event.slot, outcome="started", how=event.how, run=event.run
                ),
            ),
            started=state.started + 1,
            cursor=_later(state.cursor, event.slot) if moves else state.cursor,
        )
    if isinstance(event, SlotSkipped):
        record = SlotRecord(key=event.key, slot=event.slot, outcome="skipped", reason=event.reason)
        return attrs.evolve(
            state,
            buffered=tuple(b for b in state.buffered if b[1] != event.key),
            recent=_remember(state, record),
            skipped=state.skipped + 1,
            last_reason=event.reason,
            cursor=_later(state.cursor, event.slot),
        )
    if isinstance(event, SlotBuffered):
        record = SlotRecord(key=event.key, slot=event.slot, outcome="buffered", how=event.how)
        return attrs.evolve(
            state,
            buffered=(*state.buffered, (event.slot, event.key, event.how)),
            recent=_remember(state, record),
            last_reason="waiting for the runs in flight to end",
            cursor=_later(state.cursor, event.slot),
        )
    if isinstance(event, SlotsMissed):
        some = "more than " if event.more else ""
        return attrs.evolve(
            state,
            missed=state.missed + event.count,
            last_reason=f"{some}{event.count} slot(s) missed while no worker ran",
            cursor=_later(state.cursor, event.last),
        )
    if isinstance(event, ScheduledRunEnded):
        recent = tuple(
            attrs.evolve(r, status=event.status) if r.run == event.run else r for r in state.recent
        )
        in_flight = tuple(r for r in state.in_flight if r != event.run)
        return attrs.evolve(state, in_flight=in_flight, recent=recent)
    if isinstance(event, Paused):
        return attrs.evolve(state, paused=True, paused_reason=event.reason)
    if isinstance(event, Resumed):
        return attrs.evolve(
            state, paused=False, paused_reason="", cursor=_later(state.cursor, event.at)
        )
    if isinstance(event, Deleted):
        return attrs.evolve(state, deleted=True, buffered=(), paused=False, paused_reason="")
    return state


def summary(state: ScheduleState) -> dict[str, Any]:
    """What the schedule's row keeps for listings (the next fire times are computed from
    ``schedule`` and ``cursor`` when listed: they move with the clock, the row does not)."""
    return {
        "agent": state.agent,
        "schedule": state.schedule,
        "source": state.source,
        "declared_at": state.declared_at,  # names the state a declaration is sent against
        "cursor": state.cursor,
        "paused": state.paused,
        "paused_reason": state.paused_reason,
        "deleted": state.deleted,
        "in_flight": list(state.in_flight),
        "buffered": len(state.buffered),
        "started": state.started,
        "skipped": state.skipped,
        "missed": state.missed,
        "last_reason": state.last_reason,
        "recent": [attrs.asdict(r) for r in state.recent[-5:]],
    }
