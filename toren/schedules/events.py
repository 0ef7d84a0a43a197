"""What a schedule actor (``schedule/<name>``) is sent and what it records.

Its journal is the schedule's whole story: the declaration it runs (``schedule.declared``,
again at each change), each slot it dealt with (started a run, skipped, buffered, or missed
while no worker ran), the ends of the runs it started, and what people did to it (paused,
resumed, triggered, backfilled, deleted). A slot is named by its nominal instant
(:func:`toren.schedules.spec.slot_key`); the run a slot starts has the idempotency key
``schedule/<name>/<slot key>`` (:func:`slot_run_id`), in the commit that records the slot.

Their wire names are the journal's format: recorded journals fold with them as they are.
"""

from __future__ import annotations

from typing import Any, Literal

import attrs

from toren._agent.principal import Principal
from toren._core.codec import message

SCHEDULE_KIND = "schedule"
SCHEDULE_PREFIX = f"{SCHEDULE_KIND}/"

Source = Literal["declared", "api"]  # in code or the settings file; at run time
How = Literal["on_time", "catch_up", "buffered", "manual", "backfill"]


def schedule_id(name: str) -> str:
    """The schedule actor's id: ``schedule/<name>``."""
    return f"{SCHEDULE_PREFIX}{name}"


def slot_idempotency_key(name: str, key: str) -> str:
    """The idempotency key of the run slot ``key`` of schedule ``name`` starts."""
    return f"{SCHEDULE_PREFIX}{name}/{key}"


# --- messages a schedule receives --------------------------------------------------------------


@message("schedule.declare")
@attrs.frozen(kw_only=True)
class Declare:
    """Run this declaration (a new schedule, or a changed one): ``schedule`` is a
    :class:`toren.schedules.Schedule` as JSON."""

    agent: str
    schedule: dict[str, Any]
    source: Source
    by: Principal


@message("schedule.tick")
@attrs.frozen
class Tick:
    """The schedule's timer: look at the clock, deal with the slots that are due."""


@message("schedule.pause")
@attrs.frozen(kw_only=True)
class Pause:
    by: Principal
    reason: str = ""


@message("schedule.resume")
@attrs.frozen(kw_only=True)
class Resume:
    by: Principal


@message("schedule.trigger")
@attrs.frozen(kw_only=True)
class Trigger:
    """Start a run now, outside the slots (``id`` names the trigger: its run's key)."""

    by: Principal
    id: str


@message("schedule.backfill")
@attrs.frozen(kw_only=True)
class Backfill:
    """Start the slots in ``(start, end]`` (unix seconds) under ``overlap``."""

    by: Principal
    start: float
    end: float
    overlap: str


@message("schedule.delete")
@attrs.frozen(kw_only=True)
class Delete:
    by: Principal


# --- events a schedule records -------------------------------------------------------------


@message("schedule.declared")
@attrs.frozen(kw_only=True)
class Declared:
    agent: str
    schedule: dict[str, Any]
    source: Source
    by: Principal
    at: float


@message("schedule.slot_started")
@attrs.frozen(kw_only=True)
class SlotStarted:
    """A slot started ``run`` (``how``: on time, caught up, out of the buffer, by hand)."""

    slot: float
    key: str
    run: str
    how: How
    at: float
    by: Principal | None = None  # who, for a trigger or a backfill


@message("schedule.slot_skipped")
@attrs.frozen(kw_only=True)
class SlotSkipped:
    """A slot that started nothing, and why (its overlap policy, a pause, its run existed)."""

    slot: float
    key: str
    reason: str
    at: float


@message("schedule.slot_buffered")
@attrs.frozen(kw_only=True)
class SlotBuffered:
    """A slot waiting for the runs in flight to end (``buffer_one``, ``buffer_all``)."""

    slot: float
    key: str
    how: How
    at: float


@message("schedule.slots_missed")
@attrs.frozen(kw_only=True)
class SlotsMissed:
    """Slots that came while no worker ran and are older than the catch-up window:
    ``count`` of them, the first and the last (nominal instants). ``more``: counting stopped
    at ``count`` (there were more)."""

    count: int
    first: float
    last: float
    at: float
    more: bool = False


@message("schedule.run_ended")
@attrs.frozen(kw_only=True)
class ScheduledRunEnded:
    run: str
    status: str
    error_class: str | None
    at: float


@message("schedule.paused")
@attrs.frozen(kw_only=True)
class Paused:
    reason: str
    at: float
    by: Principal | None = None  # None: the schedule paused itself (pause on failure)


@message("schedule.resumed")
@attrs.frozen(kw_only=True)
class Resumed:
    by: Principal
    at: float


@message("schedule.deleted")
@attrs.frozen(kw_only=True)
class Deleted:
    by: Principal
    at: float
