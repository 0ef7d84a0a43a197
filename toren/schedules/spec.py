"""When a schedule fires: the pure time math of a cron expression or an interval.

A :class:`Spec` is a cron expression in an IANA time zone, or an interval, with optional
jitter, start and end. It answers one question, deterministically on every worker: which
instants (epoch seconds, UTC) are its slots. Nothing here reads a clock; callers pass the time.

**The cron library.** Cron expressions are parsed and matched by ``cronsim`` (by the author of
Healthchecks.io, which runs it against millions of checks). It was chosen over ``croniter``
(declared abandoned in 2025, since adopted by pallets-eco; its DST handling has a long history
of bug reports) and APScheduler's ``CronTrigger`` (a whole scheduler to get one function, and
its 4.x is still a pre-release): cronsim is small, typed, has no dependencies, works on
``zoneinfo`` time zones, and follows Debian's cron, DST transitions included. Its source was
read for this: with an aware datetime it steps through real (UTC) time and matches the local
wall clock, and walks an expression naming fixed times of day on the naive local clock. This
module does not rely on either at a transition: it walks every expression on the naive local
clock itself and resolves each local time by the rule below, and it filters every result
(strictly after the asked instant, strictly increasing), so the rule holds whatever the library
does; ``tests/test_schedule_spec.py`` checks it against a brute-force reading of the rule.

**Daylight saving: the rule.** A cron expression is read on the local clock of its time zone,
and each local time it names fires once:

- a local time skipped by a spring-forward fires once, at the transition instant (the first
  instant after the gap: ``30 2 * * *`` in Europe/Berlin on 2026-03-29 fires at 03:00 CEST);
- a local time repeated by a fall-back fires once, at its first occurrence (``30 2 * * *`` on
  2026-10-25 fires at 02:30 CEST, not again at 02:30 CET).

The rule is the same for every expression: ``*/30 * * * *`` fires at 02:00 and 02:30 CEST on
2026-10-25 and not again at 02:00 and 02:30 CET (its next slot is 03:00 CET, 90 minutes after
the last), and on 2026-03-29 its 02:00 and 02:30 both fall at the transition, which is also
its 03:00: one slot. Local times that resolve to one instant give one slot. (Debian's cron
fires an expression with a wildcard minute or hour at every real instant whose local time
matches, so twice in a repeated hour; Toren does not: a local time is one slot.)

An interval (``every``) is real time: slots are ``anchor + k * every``, the anchor being
``start`` if given, else the Unix epoch, so every worker computes the same slots.

A slot's identity is its instant, written by :func:`slot_key` (UTC, whole seconds).
"""

from __future__ import annotations

import hashlib
import math
import re
import zoneinfo
from collections.abc import Iterator
from datetime import UTC, datetime, tzinfo

import attrs
from cronsim import CronSim, CronSimError

from toren._core.errors import ConfigError

CRON_CAP = 200
"""Characters a cron expression may hold."""

TIMEZONE_CAP = 64
"""Characters a time zone's name may hold (the longest IANA name has 32)."""

SECONDS_CAP = 10 * 365 * 86400.0
"""The longest interval, jitter or catch-up window: ten years (a durable timer's longest delay)."""

YEAR_CAP = 9000
"""Dates (``start``, ``end``) before this year: a slot ten years on still has a key."""

EVERY_MIN = 1.0
"""The shortest interval, in seconds: slots are told apart by whole seconds."""

_ZONE_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_+-]*(?:/[A-Za-z0-9_+-]+)*")
_NICKNAMES = {
    "@yearly": "0 0 1 1 *",
    "@annually": "0 0 1 1 *",
    "@monthly": "0 0 1 * *",
    "@weekly": "0 0 * * 0",
    "@daily": "0 0 * * *",
    "@midnight": "0 0 * * *",
    "@hourly": "0 * * * *",
}


class ScheduleError(ConfigError, ValueError):
    """A schedule's value is invalid: ``field`` names which, ``detail`` says what is wrong.

    A :class:`~toren.ConfigError`, so the CLI exits 2 on it and the settings file's readers
    name the table it came from; surfaces answer it with HTTP 422. ``where`` is the schedule
    or table it was found in, when known.
    """

    def __init__(self, field: str, detail: str, *, hint: str = "", where: str = "") -> None:
        self.field = field
        self.detail = detail
        self.where = where
        prefix = f"{where}: " if where else ""
        super().__init__(f"{prefix}{field}: {detail}", hint=hint)

    def located(self, where: str) -> ScheduleError:
        """The same error, said to be found in ``where`` (a schedule, a table)."""
        return ScheduleError(self.field, self.detail, hint=self.hint, where=where)


def check_text(field: str, value: object, cap: int, *, what: str = "a string") -> str:
    """``value`` if it is a string of at most ``cap`` UTF-8 bytes with no NUL and no lone
    surrogate.

    Raises:
        ScheduleError: it is not (naming ``field``; the value is not shown).
    """
    if not isinstance(value, str):
        raise ScheduleError(field, f"must be {what}, got {type(value).__name__}")
    if "\x00" in value:
        raise ScheduleError(field, "must not hold a NUL character")
    try:
        size = len(value.encode("utf-8"))
    except UnicodeEncodeError:
        raise ScheduleError(field, "must not hold a lone surrogate (not valid Unicode)") from None
    if size > cap:
        raise ScheduleError(field, f"must be at most {cap} bytes, got {size}")
    return value


def zone(name: object) -> zoneinfo.ZoneInfo:
    """The IANA time zone called ``name`` (``"Europe/Berlin"``, ``"UTC"``).

    Raises:
        ScheduleError: it is not the name of a time zone known here.
    """
    text = check_text("timezone", name, TIMEZONE_CAP, what="an IANA time zone name")
    hint = "Use an IANA name such as 'Europe/Berlin', 'America/Sao_Paulo' or 'UTC'."
    if not _ZONE_NAME.fullmatch(text) or text in ("localtime", "posixrules", "Factory"):
        raise ScheduleError("timezone", f"unknown time zone {text!r}", hint=hint)
    try:
        return zoneinfo.ZoneInfo(text)
    except (zoneinfo.ZoneInfoNotFoundError, ValueError, OSError):
        raise ScheduleError("timezone", f"unknown time zone {text!r}", hint=hint) from None


def cron_expression(value: object) -> str:
    """``value`` as a five-field cron expression (``@daily`` and the other nicknames spelled
    out), checked.

    Raises:
        ScheduleError: it is not one (the message says which field is wrong).
    """
    text = check_text("cron", value, CRON_CAP, what="a cron expression")
    hint = "Five fields: minute hour day-of-month month day-of-week, e.g. '0 9 * * 1-5'."
    expr = _NICKNAMES.get(text.strip().lower(), text.strip())
    if not expr.isascii() or not expr.isprintable():
        raise ScheduleError("cron", "must be printable ASCII", hint=hint)
    fields = expr.split()
    if len(fields) != 5:
        shown = expr if len(expr) <= 80 else expr[:77] + "..."
        raise ScheduleError("cron", f"needs 5 fields, got {len(fields)} in {shown!r}", hint=hint)
    try:
        CronSim(expr, datetime(2000, 1, 1))
    except (CronSimError, ValueError, IndexError) as exc:  # "Bad day-of-month", ...
        raise ScheduleError("cron", f"{str(exc) or 'invalid'} in {expr!r}", hint=hint) from None
    return " ".join(fields)


def seconds(field: str, value: object, *, positive: bool = False) -> float:
    """``value`` (a number) as finite seconds, at least 0 (more than 0 if ``positive``).

    Raises:
        ScheduleError: it is not a number, or not finite, or out of range.
    """
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ScheduleError(field, f"must be a number of seconds, got {type(value).__name__}")
    try:
        number = float(value)
    except OverflowError:
        number = math.inf
    if not math.isfinite(number):
        raise ScheduleError(field, f"must be finite, got {value!r}")
    if positive and not number > 0:
        raise ScheduleError(field, f"must be more than 0, got {value!r}")
    if number < 0:
        raise ScheduleError(field, f"must be 0 or more, got {value!r}")
    if number > SECONDS_CAP:
        raise ScheduleError(field, f"must be at most ten years ({SECONDS_CAP:g} s), got {value!r}")
    return number


def aware(field: str, value: object) -> datetime:
    """``value`` (a datetime or ISO-8601 text) as a datetime with a UTC offset.

    Raises:
        ScheduleError: it is neither, or it has no offset.
    """
    if isinstance(value, str):
        check_text(field, value, 64, what="an ISO-8601 date and time")
        try:
            value = datetime.fromisoformat(value)
        except ValueError:
            raise ScheduleError(field, "must be an ISO-8601 date and time") from None
    if not isinstance(value, datetime):
        raise ScheduleError(field, f"must be a date and time, got {type(value).__name__}")
    if value.tzinfo is None or value.utcoffset() is None:
        raise ScheduleError(
            field,
            "needs a UTC offset",
            hint="Write it like 2026-01-05T09:00:00+01:00 (or ...Z for UTC).",
        )
    if not 1970 <= value.year < YEAR_CAP:
        raise ScheduleError(field, f"must be from 1970 to before the year {YEAR_CAP}")
    return value


def slot_key(slot: float) -> str:
    """A slot's identity: its instant in UTC, ISO-8601 to the second (``2026-03-29T01:00:00Z``).

    Raises:
        ScheduleError: ``slot`` is not a finite time between years 1 and 9999.
    """
    moment = _utc(slot, "slot")
    return (
        f"{moment.year:04d}-{moment.month:02d}-{moment.day:02d}T"
        f"{moment.hour:02d}:{moment.minute:02d}:{moment.second:02d}Z"
    )


def _utc(epoch: float, field: str) -> datetime:
    try:
        return datetime.fromtimestamp(math.floor(epoch), UTC)
    except (OverflowError, ValueError, OSError):
        raise ScheduleError(field, f"not a time: {epoch!r}") from None


def _cron(value: str | None) -> str | None:
    return None if value is None else cron_expression(value)


def _every(value: float | None) -> float | None:
    return None if value is None else seconds("every", value, positive=True)


def _jitter(value: float) -> float:
    return seconds("jitter", value)


def _start(value: datetime | str | None) -> datetime | None:
    return None if value is None else aware("start", value)


def _end(value: datetime | str | None) -> datetime | None:
    return None if value is None else aware("end", value)


@attrs.frozen(kw_only=True)
class Spec:
    """When a schedule fires. Exactly one of ``cron`` and ``every``.

    Attributes:
        cron: A five-field cron expression, read in ``timezone``.
        every: An interval in seconds (at least 1), anchored at ``start`` if given, else at
            the Unix epoch.
        timezone: An IANA time zone name; cron expressions are read in it.
        jitter: The most a slot's run may be delayed, in seconds (:meth:`delay_for`).
        start: No slot before it (aware).
        end: No slot after it (aware, after ``start``).

    Raises:
        ScheduleError: a value is invalid (see the field's converter), both or neither of
            ``cron`` and ``every`` are given, or ``end`` is not after ``start``.
    """

    cron: str | None = attrs.field(default=None, converter=_cron)
    every: float | None = attrs.field(default=None, converter=_every)
    timezone: str = "UTC"
    jitter: float = attrs.field(default=0.0, converter=_jitter)
    start: datetime | None = attrs.field(default=None, converter=_start)
    end: datetime | None = attrs.field(default=None, converter=_end)
    _zone: tzinfo = attrs.field(init=False, eq=False, repr=False)

    def __attrs_post_init__(self) -> None:
        object.__setattr__(self, "_zone", zone(self.timezone))
        if (self.cron is None) == (self.every is None):
            raise ScheduleError(
                "cron",
                "give exactly one of cron and every",
                hint="cron = '0 9 * * 1-5' or every = '30m'.",
            )
        if self.every is not None and self.every < EVERY_MIN:
            raise ScheduleError("every", f"must be at least {EVERY_MIN:g} second, got {self.every}")
        if self.start is not None and self.end is not None and not self.end > self.start:
            raise ScheduleError("end", "must be after start")

    def next_slot(self, after: float) -> float | None:
        """The first slot strictly after ``after`` (epoch seconds), or ``None`` when there is
        none (past ``end``, or a cron expression that matches no date in 50 years).

        Raises:
            ScheduleError: ``after`` is not a finite time.
        """
        _utc(after, "after")
        lower = after
        if self.start is not None:
            lower = max(lower, math.nextafter(self.start.timestamp(), -math.inf))
        slot = self._interval_after(lower) if self.every is not None else self._cron_after(lower)
        if slot is None or (self.end is not None and slot > self.end.timestamp()):
            return None
        return slot

    def slots(self, after: float, until: float, limit: int) -> list[float]:
        """The slots in ``(after, until]``, in order, at most ``limit`` of them.

        Raises:
            ScheduleError: ``after`` or ``until`` is not a finite time, or ``limit`` is
                negative.
        """
        _utc(until, "until")
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
            raise ScheduleError("limit", f"must be a whole number, 0 or more, got {limit!r}")
        found: list[float] = []
        slot = self.next_slot(after)
        while slot is not None and slot <= until and len(found) < limit:
            found.append(slot)
            slot = self.next_slot(slot)
        return found

    def delay_for(self, slot: float, seed: str) -> float:
        """How long after ``slot`` its run starts: in ``[0, jitter)``, from a hash of ``seed``
        (a schedule's name, say) and the slot, so every worker and every retry agree."""
        if self.jitter == 0:
            return 0.0
        digest = hashlib.sha256(
            f"{seed}\x00{slot_key(slot)}".encode("utf-8", "surrogatepass")
        ).digest()
        fraction = (int.from_bytes(digest[:8], "big") >> 11) / float(1 << 53)  # [0, 1)
        return min(fraction * self.jitter, math.nextafter(self.jitter, 0.0))

    def _interval_after(self, lower: float) -> float:
        every = self.every
        if every is None:  # callers check
            raise ConfigError("an interval schedule without an interval")
        anchor = self.start.timestamp() if self.start is not None else 0.0
        k = math.floor((lower - anchor) / every) + 1
        slot = anchor + k * every
        while slot <= lower:  # float rounding at the boundary
            k += 1
            slot = anchor + k * every
        return slot

    def _cron_after(self, lower: float) -> float | None:
        for slot in self._cron_candidates(math.floor(lower)):
            if slot > lower:
                return slot
        return None

    def _cron_candidates(self, since: int) -> Iterator[float]:
        """Slots from about ``since`` on, increasing (some may be at or before ``since``
        when a fall-back repeats the local clock)."""
        expr = self.cron or ""
        moment = datetime.fromtimestamp(since, self._zone)
        try:
            # Walk the local clock; each local time becomes one instant by the rule.
            for local in CronSim(expr, moment.replace(tzinfo=None)):
                yield _resolve(local, self._zone)
        except StopIteration:  # cronsim gives up after 50 years without a match
            return


def _resolve(local: datetime, tz: tzinfo) -> float:
    """The instant of the naive local time ``local`` in ``tz``: its first occurrence if a
    fall-back repeats it, the end of the gap (the transition) if a spring-forward skips it."""
    first = local.replace(tzinfo=tz, fold=0).timestamp()
    if datetime.fromtimestamp(first, tz).replace(tzinfo=None) == local:
        return first
    # In a gap: fold=1 reads it with the offset after the transition (an instant before the
    # gap), fold=0 with the offset before (an instant after it); the transition lies between.
    low = math.floor(local.replace(tzinfo=tz, fold=1).timestamp())
    high = math.ceil(first)
    after = datetime.fromtimestamp(high, tz).utcoffset()
    while high - low > 1:  # the first whole second that has the later offset
        middle = (low + high) // 2
        if datetime.fromtimestamp(middle, tz).utcoffset() == after:
            high = middle
        else:
            low = middle
    return float(high)
