"""The wall clock that schedules (and, later, limits) read: one object a test can replace.

A worker lends its :class:`Clock` to its actors (``ctx.resources.get(Clock)``); Toren's own is
the system's (:class:`Clock` itself). A test gives the worker a :class:`ShiftedClock`: the same
time, moved by an offset it controls, so a test can be at 08:59:58 in Europe/Berlin on a DST
date, or jump over three hours of "downtime", without waiting for either.

**How it reaches the database.** Durable timers fire on Postgres's ``now()``: a timer is stored
as a delay (``visible_at = now() + delay``), never as an instant. An actor that wants to act at
instant ``t`` of its clock sets a timer of ``t - clock.now()`` seconds; Postgres adds that to its
own ``now()``. A shifted clock therefore needs nothing in the database: the offset cancels out
of every delay, and the timer fires when the shifted clock reads ``t`` (give or take the skew
between the worker's and the database's clocks, as in production). What the offset cannot do
is make a timer that is already set fire early: a test that jumps forward wakes the actor (a
message) so it looks at the clock again.
"""

from __future__ import annotations

import time


class Clock:
    """The wall clock: seconds since the Unix epoch, UTC (the system's)."""

    def now(self) -> float:
        """The time now."""
        return time.time()


class ShiftedClock(Clock):
    """The system's time moved by ``offset`` seconds; :meth:`advance` moves it further (a
    test's clock)."""

    def __init__(self, offset: float = 0.0) -> None:
        self.offset = offset

    @classmethod
    def at(cls, instant: float) -> ShiftedClock:
        """A clock that reads ``instant`` now (and runs on from there)."""
        return cls(instant - time.time())

    def now(self) -> float:
        return time.time() + self.offset

    def advance(self, seconds: float) -> None:
        """Move the clock ``seconds`` later (a jump: nothing between is lived through)."""
        self.offset += seconds
