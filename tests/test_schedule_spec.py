"""A schedule's time math: cron slots in time zones through DST transitions, intervals, jitter,
start and end, the input template, and the errors bad values get (toren.schedules)."""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator
from datetime import datetime, timedelta
from zoneinfo import ZoneInfo

import pytest

from toren._core.errors import ConfigError
from toren.schedules import ScheduleError, Spec, check_template, render_input, slot_key

BERLIN = "Europe/Berlin"
SAO_PAULO = "America/Sao_Paulo"


def at(text: str) -> float:
    """Epoch seconds of an ISO-8601 time with an offset."""
    return datetime.fromisoformat(text).timestamp()


def keys(spec: Spec, after: str, until: str, limit: int = 1000) -> list[str]:
    return [slot_key(s) for s in spec.slots(at(after), at(until), limit)]


# A reading of the documented rule written without the library: every UTC minute of a window is
# looked at, so it is slow and obviously right.


def _field(text: str, low: int, high: int) -> set[int]:
    values: set[int] = set()
    for term in text.split(","):
        body, _, step = term.partition("/")
        if body == "*":
            first, last = low, high
        elif "-" in body:
            first, last = map(int, body.split("-"))
        else:
            first = last = int(body)
            if step:
                last = high
        values.update(range(first, last + 1, int(step or 1)))
    return values


def _matches(expr: str, local: datetime) -> bool:
    minute, hour, dom, month, dow = expr.split()
    days = _field(dom, 1, 31)
    weekdays = {d % 7 for d in _field(dow, 0, 7)}
    day_in = local.day in days
    weekday_in = (local.weekday() + 1) % 7 in weekdays
    both = not dom.startswith("*") and not dow.startswith("*")
    return (
        local.minute in _field(minute, 0, 59)
        and local.hour in _field(hour, 0, 23)
        and local.month in _field(month, 1, 12)
        and ((day_in or weekday_in) if both else (day_in and weekday_in))
    )


def _minutes(first: float, last: float) -> Iterator[float]:
    t = math.floor(first / 60) * 60 + 60.0
    while t <= last:
        yield t
        t += 60


def first_wall(t: float, zone: ZoneInfo) -> datetime:
    return datetime.fromtimestamp(t, zone).replace(tzinfo=None)


def reference(expr: str, tz: str, after: float, until: float) -> list[str]:
    zone = ZoneInfo(tz)
    # Each matching local time once, at its first instant, or (skipped) at the first instant
    # after it.
    minutes = list(_minutes(after - 2 * 86400, until + 2 * 86400))
    first: dict[datetime, float] = {}
    for t in minutes:
        first.setdefault(datetime.fromtimestamp(t, zone).replace(tzinfo=None), t)
    found: set[float] = set()
    day = datetime.fromtimestamp(after, zone).date() - timedelta(days=1)
    while day <= datetime.fromtimestamp(until, zone).date() + timedelta(days=1):
        for h in range(24):
            for m in range(60):
                local = datetime(day.year, day.month, day.day, h, m)
                if not _matches(expr, local):
                    continue
                instant = first.get(local)
                if instant is None:  # skipped: the first instant whose local time is later
                    instant = next(t for t in minutes if first_wall(t, zone) > local)
                if after < instant <= until:
                    found.add(instant)
        day += timedelta(days=1)
    return [slot_key(t) for t in sorted(found)]


# DST: Europe/Berlin 2026 (spring forward 2026-03-29 02:00 -> 03:00 CEST at 01:00Z; fall back
# 2026-10-25 03:00 -> 02:00 CET at 01:00Z), America/Sao_Paulo 2018-11-04 (00:00 -> 01:00 at 03:00Z).


def test_a_skipped_time_of_day_fires_once_at_the_transition() -> None:
    spec = Spec(cron="30 2 * * *", timezone=BERLIN)
    assert keys(spec, "2026-03-27T12:00:00Z", "2026-03-31T12:00:00Z") == [
        "2026-03-28T01:30:00Z",  # 02:30 CET
        "2026-03-29T01:00:00Z",  # 02:30 does not exist: 03:00 CEST, the transition
        "2026-03-30T00:30:00Z",  # 02:30 CEST
        "2026-03-31T00:30:00Z",
    ]


def test_a_skipped_midnight_fires_once_at_the_transition_in_sao_paulo() -> None:
    spec = Spec(cron="0 0 * * *", timezone=SAO_PAULO)
    assert keys(spec, "2018-11-02T12:00:00Z", "2018-11-05T12:00:00Z") == [
        "2018-11-03T03:00:00Z",  # 00:00 -03
        "2018-11-04T03:00:00Z",  # 00:00 does not exist: 01:00 -02
        "2018-11-05T02:00:00Z",  # 00:00 -02
    ]
    local = datetime.fromtimestamp(at("2018-11-04T03:00:00Z"), ZoneInfo(SAO_PAULO))
    assert local.isoformat() == "2018-11-04T01:00:00-02:00"


def test_a_repeated_time_of_day_fires_once_at_its_first_occurrence() -> None:
    spec = Spec(cron="30 2 * * *", timezone=BERLIN)
    assert keys(spec, "2026-10-24T12:00:00Z", "2026-10-26T12:00:00Z") == [
        "2026-10-25T00:30:00Z",  # 02:30 CEST; not again at 02:30 CET (01:30Z)
        "2026-10-26T01:30:00Z",
    ]


def test_a_repeated_time_is_not_fired_again_when_asked_from_inside_the_repeat() -> None:
    spec = Spec(cron="45 2 * * *", timezone=BERLIN)
    # 02:10 CET (the second 02:10): 02:45 CEST is past, 02:45 CET is its repeat.
    assert slot_key(spec.next_slot(at("2026-10-25T01:10:00Z")) or 0) == "2026-10-26T01:45:00Z"
    # 02:10 CEST (the first): 02:45 CEST is ahead.
    assert slot_key(spec.next_slot(at("2026-10-25T00:10:00Z")) or 0) == "2026-10-25T00:45:00Z"


def test_two_local_times_that_fall_into_one_gap_give_one_slot() -> None:
    spec = Spec(cron="0,30 2,3 * * *", timezone=BERLIN)
    assert keys(spec, "2026-03-28T23:00:00Z", "2026-03-29T03:00:00Z") == [
        "2026-03-29T01:00:00Z",  # 02:00, 02:30 and 03:00 CEST: one instant
        "2026-03-29T01:30:00Z",  # 03:30 CEST
    ]


def test_every_half_hour_through_spring_forward_fires_once_at_the_transition() -> None:
    zone = ZoneInfo(BERLIN)
    spec = Spec(cron="*/30 * * * *", timezone=BERLIN)
    local = [
        datetime.fromtimestamp(s, zone).isoformat()[11:]
        for s in spec.slots(at("2026-03-28T23:45:00Z"), at("2026-03-29T02:00:00Z"), 100)
    ]
    # 02:00 and 02:30 do not exist: both fire at the transition, which is also 03:00
    assert local == ["01:00:00+01:00", "01:30:00+01:00", "03:00:00+02:00", "03:30:00+02:00",
                     "04:00:00+02:00"]  # fmt: skip


def test_every_half_hour_through_fall_back_fires_the_repeated_hour_once() -> None:
    zone = ZoneInfo(BERLIN)
    spec = Spec(cron="*/30 * * * *", timezone=BERLIN)
    local = [
        datetime.fromtimestamp(s, zone).isoformat()[11:]
        for s in spec.slots(at("2026-10-24T23:45:00Z"), at("2026-10-25T02:00:00Z"), 100)
    ]
    # 02:00 and 02:30 come twice on the wall clock: each fires at its first occurrence only
    assert local == ["02:00:00+02:00", "02:30:00+02:00", "03:00:00+01:00"]


def test_hourly_through_both_transitions_fires_each_local_hour_once() -> None:
    spec = Spec(cron="0 * * * *", timezone=BERLIN)
    spring = spec.slots(at("2026-03-28T23:00:00Z"), at("2026-03-29T22:00:00Z"), 100)
    autumn = spec.slots(at("2026-10-24T22:00:00Z"), at("2026-10-25T23:00:00Z"), 100)
    assert len(spring) == 23  # 02:00 does not exist that day: it is the transition, 03:00
    assert len(autumn) == 24  # 02:00 comes twice that day: it fires once
    assert len(set(spring)) == len(spring)
    assert spring == sorted(spring)


@pytest.mark.parametrize(
    ("expr", "tz", "after", "until"),
    [
        ("30 2 * * *", BERLIN, "2026-03-27T00:00:00Z", "2026-03-31T00:00:00Z"),
        ("30 2 * * *", BERLIN, "2026-10-23T00:00:00Z", "2026-10-27T00:00:00Z"),
        ("*/30 * * * *", BERLIN, "2026-03-28T20:00:00Z", "2026-03-29T06:00:00Z"),
        ("*/30 * * * *", BERLIN, "2026-10-24T20:00:00Z", "2026-10-25T06:00:00Z"),
        ("15 * * * *", BERLIN, "2026-03-28T20:00:00Z", "2026-03-29T06:00:00Z"),
        ("0 */2 * * *", BERLIN, "2026-10-24T18:00:00Z", "2026-10-25T08:00:00Z"),
        ("* 2 * * *", BERLIN, "2026-03-28T23:30:00Z", "2026-03-29T02:30:00Z"),
        ("* 2 * * *", BERLIN, "2026-10-24T23:30:00Z", "2026-10-25T02:30:00Z"),
        ("0,30 1-3 * * *", BERLIN, "2026-03-28T20:00:00Z", "2026-03-29T06:00:00Z"),
        ("0,30 1-3 * * *", BERLIN, "2026-10-24T20:00:00Z", "2026-10-25T06:00:00Z"),
        ("0 0 * * *", SAO_PAULO, "2018-11-02T00:00:00Z", "2018-11-06T00:00:00Z"),
        ("*/20 * * * *", SAO_PAULO, "2018-11-03T22:00:00Z", "2018-11-04T08:00:00Z"),
        ("30 23,0 * * *", SAO_PAULO, "2019-02-15T00:00:00Z", "2019-02-18T00:00:00Z"),
        ("*/15 * * * *", "Australia/Lord_Howe", "2026-04-04T12:00:00Z", "2026-04-04T18:00:00Z"),
        ("45 1 * * *", "Australia/Lord_Howe", "2026-10-02T00:00:00Z", "2026-10-06T00:00:00Z"),
        ("0 9 * * 1-5", BERLIN, "2026-03-25T00:00:00Z", "2026-04-02T00:00:00Z"),
    ],
)
def test_slots_are_those_of_the_rule(expr: str, tz: str, after: str, until: str) -> None:
    spec = Spec(cron=expr, timezone=tz)
    assert keys(spec, after, until) == reference(expr, tz, at(after), at(until))


def test_weekdays_at_nine_in_berlin() -> None:
    spec = Spec(cron="0 9 * * 1-5", timezone=BERLIN)
    zone = ZoneInfo(BERLIN)
    slots = spec.slots(at("2026-03-26T12:00:00Z"), at("2026-04-03T12:00:00Z"), 100)
    local = [datetime.fromtimestamp(s, zone) for s in slots]
    assert [d.strftime("%a %d %H:%M%z") for d in local] == [
        "Fri 27 09:00+0100",
        "Mon 30 09:00+0200",  # after the spring forward: 07:00Z instead of 08:00Z
        "Tue 31 09:00+0200",
        "Wed 01 09:00+0200",
        "Thu 02 09:00+0200",
        "Fri 03 09:00+0200",
    ]


def test_next_slot_is_strictly_after_and_slots_are_increasing() -> None:
    spec = Spec(cron="0 9 * * *", timezone=BERLIN)
    nine = at("2026-06-01T09:00:00+02:00")
    assert spec.next_slot(nine - 0.5) == nine
    assert spec.next_slot(nine) == nine + 86400
    assert spec.next_slot(math.nextafter(nine, 0)) == nine


def test_day_of_month_and_day_of_week_together_mean_either_as_in_cron() -> None:
    spec = Spec(cron="0 0 10 * 5")  # the 10th (a Tuesday in March 2026), and every Friday
    days = [
        datetime.fromtimestamp(s, ZoneInfo("UTC")).strftime("%a %d")
        for s in spec.slots(at("2026-03-01T12:00:00Z"), at("2026-03-21T00:00:00Z"), 10)
    ]
    assert days == ["Fri 06", "Tue 10", "Fri 13", "Fri 20"]
    assert Spec(cron="@yearly").next_slot(at("2026-06-01T00:00:00Z")) == at("2027-01-01T00:00Z")


def test_cron_nicknames_and_names_are_spelled_out() -> None:
    assert Spec(cron="@daily").cron == "0 0 * * *"
    assert Spec(cron="  0  9 * * MON-FRI ").cron == "0 9 * * MON-FRI"
    weekdays = Spec(cron="0 9 * * MON-FRI")
    friday_to_tuesday = weekdays.slots(at("2026-06-05T10:00Z"), at("2026-06-09T10:00Z"), 9)
    assert [slot_key(s) for s in friday_to_tuesday] == [
        "2026-06-08T09:00:00Z",
        "2026-06-09T09:00:00Z",
    ]


# Intervals, start, end, limits, jitter.


def test_intervals_are_anchored_at_the_epoch_so_every_worker_agrees() -> None:
    spec = Spec(every=3600)
    assert spec.next_slot(at("2026-06-01T10:17:03Z")) == at("2026-06-01T11:00:00Z")
    assert spec.next_slot(at("2026-06-01T11:00:00Z")) == at("2026-06-01T12:00:00Z")
    assert Spec(every=7).next_slot(0.0) == 7.0


def test_intervals_are_anchored_at_start_when_given() -> None:
    spec = Spec(every=1800, start=datetime.fromisoformat("2026-06-01T10:10:00+00:00"))
    assert keys(spec, "2026-05-01T00:00:00Z", "2026-06-01T11:30:00Z") == [
        "2026-06-01T10:10:00Z",
        "2026-06-01T10:40:00Z",
        "2026-06-01T11:10:00Z",
    ]


def test_intervals_ignore_daylight_saving() -> None:
    spec = Spec(every=1800, timezone=BERLIN)
    slots = spec.slots(at("2026-10-24T23:00:00Z"), at("2026-10-25T03:00:00Z"), 100)
    assert [b - a for a, b in itertools.pairwise(slots)] == [1800.0] * 7


def test_start_and_end_bound_the_slots() -> None:
    spec = Spec(
        cron="0 * * * *",
        start=datetime.fromisoformat("2026-06-01T10:00:00+00:00"),
        end=datetime.fromisoformat("2026-06-01T13:00:00+00:00"),
    )
    assert keys(spec, "2026-06-01T00:00:00Z", "2026-06-02T00:00:00Z") == [
        "2026-06-01T10:00:00Z",  # a slot at start is one
        "2026-06-01T11:00:00Z",
        "2026-06-01T12:00:00Z",
        "2026-06-01T13:00:00Z",  # so is one at end
    ]
    assert spec.next_slot(at("2026-06-01T13:00:00Z")) is None


def test_slots_stops_at_its_limit_and_at_until() -> None:
    spec = Spec(cron="* * * * *")
    assert len(spec.slots(0.0, 1e9, 5)) == 5
    assert spec.slots(0.0, 1e9, 0) == []
    assert spec.slots(0.0, 120.0, 100) == [60.0, 120.0]
    with pytest.raises(ScheduleError, match="limit"):
        spec.slots(0.0, 1.0, -1)


def test_jitter_is_deterministic_bounded_and_spread() -> None:
    spec = Spec(every=60, jitter=30)
    slots = spec.slots(0.0, 60.0 * 1000, 1000)
    delays = [spec.delay_for(s, "schedule/digest") for s in slots]
    assert delays == [spec.delay_for(s, "schedule/digest") for s in slots]
    assert all(0 <= d < 30 for d in delays)
    assert min(delays) < 3  # spread over the range
    assert max(delays) > 27
    assert delays != [spec.delay_for(s, "schedule/other") for s in slots]
    assert Spec(every=60).delay_for(60.0, "x") == 0.0


def test_slot_keys_are_utc_to_the_second() -> None:
    assert slot_key(at("2026-03-29T03:00:00+02:00")) == "2026-03-29T01:00:00Z"
    assert slot_key(at("2026-03-29T03:00:00+02:00") + 0.9) == "2026-03-29T01:00:00Z"
    assert slot_key(0.0) == "1970-01-01T00:00:00Z"


# The input template.


def test_a_template_fills_its_placeholders_in_the_slots_zone() -> None:
    slot = at("2026-03-29T01:00:00Z")
    text = render_input(
        "{schedule}: {slot} ({slot_utc}) on {weekday} {date} at {time} in {timezone}",
        slot,
        BERLIN,
        "digest",
    )
    assert text == (
        "digest: 2026-03-29T03:00:00+02:00 (2026-03-29T01:00:00Z) on Sunday 2026-03-29 "
        "at 03:00 in Europe/Berlin"
    )


def test_double_braces_are_braces() -> None:
    assert render_input('{{"date": "{date}"}}', 0.0, "UTC", "s") == '{"date": "1970-01-01"}'
    assert render_input("{{slot}}", 0.0, "UTC", "s") == "{slot}"


@pytest.mark.parametrize(
    ("template", "message"),
    [
        ("{nope}", r"unknown placeholder \{nope\}"),
        ("{slot.__class__}", "unknown placeholder"),
        ("{slot!r}", "unknown placeholder"),
        ("{slot:>10}", "unknown placeholder"),
        ("{0}", "unknown placeholder"),
        ("{}", "unknown placeholder"),
        ("{schedule.__init__.__globals__}", "unknown placeholder"),
        ("a { b", "unmatched '{'"),
        ("a } b", "unmatched '}'"),
        ("", "must not be empty"),
        ("   ", "must not be empty"),
        ("a\x00b", "NUL"),
        ("a\ud800b", "lone surrogate"),
        ("x" * 100_000, "at most 65536 bytes"),
    ],
)
def test_a_bad_template_is_refused_naming_input(template: str, message: str) -> None:
    with pytest.raises(ScheduleError, match=message) as caught:
        check_template(template)
    assert caught.value.field == "input"
    with pytest.raises(ScheduleError):
        render_input(template, 0.0, "UTC", "s")


# Bad values: each a ScheduleError (a ConfigError: CLI exit 2, HTTP 422) naming the field.


@pytest.mark.parametrize(
    ("values", "field", "message"),
    [
        ({"cron": "0 9 * *"}, "cron", "needs 5 fields, got 4"),
        ({"cron": "0 9 * * * *"}, "cron", "needs 5 fields, got 6"),
        ({"cron": "61 9 * * *"}, "cron", "Bad minute"),
        ({"cron": "0 25 * * *"}, "cron", "Bad hour"),
        ({"cron": "0 0 31 2 *"}, "cron", "Bad day-of-month"),
        ({"cron": "0 9 * * FUNDAY"}, "cron", "Bad day-of-week"),
        ({"cron": "0 9 * * *\x00"}, "cron", "NUL"),
        ({"cron": "0 9 * * \ud800"}, "cron", "lone surrogate"),
        ({"cron": "0 9 * * 1," * 20_000}, "cron", "at most 200 bytes"),
        ({"cron": 5}, "cron", "must be a cron expression"),
        ({"cron": "0 9 * * *", "timezone": "Mars/Olympus"}, "timezone", "unknown time zone"),
        ({"cron": "0 9 * * *", "timezone": "../../etc/passwd"}, "timezone", "unknown time zone"),
        ({"cron": "0 9 * * *", "timezone": "localtime"}, "timezone", "unknown time zone"),
        ({"cron": "0 9 * * *", "timezone": "Europe/Berlin\x00"}, "timezone", "NUL"),
        ({"cron": "0 9 * * *", "timezone": "E" * 100_000}, "timezone", "at most 64 bytes"),
        ({}, "cron", "exactly one of cron and every"),
        ({"cron": "0 9 * * *", "every": 60}, "cron", "exactly one of cron and every"),
        ({"every": 0}, "every", "more than 0"),
        ({"every": -5}, "every", "more than 0"),
        ({"every": 0.5}, "every", "at least 1 second"),
        ({"every": math.nan}, "every", "finite"),
        ({"every": math.inf}, "every", "finite"),
        ({"every": True}, "every", "number of seconds"),
        ({"every": 60, "jitter": -1}, "jitter", "0 or more"),
        ({"every": 60, "jitter": math.nan}, "jitter", "finite"),
        ({"every": 60, "start": datetime(2026, 1, 1)}, "start", "needs a UTC offset"),
        ({"every": 60, "start": "yesterday"}, "start", "ISO-8601"),
        (
            {"every": 60, "start": "2026-06-02T00:00Z", "end": "2026-06-01T00:00Z"},
            "end",
            "must be after start",
        ),
    ],
)
def test_bad_values_are_refused_naming_the_field(
    values: dict[str, object], field: str, message: str
) -> None:
    with pytest.raises(ScheduleError, match=message) as caught:
        Spec(**values)  # type: ignore[arg-type]
    assert caught.value.field == field
    assert isinstance(caught.value, ConfigError)
    assert str(caught.value).startswith(f"{field}: ")
    assert len(str(caught.value)) < 500  # a huge value is never echoed


def test_after_must_be_a_time() -> None:
    spec = Spec(every=60)
    for bad in (math.nan, math.inf, 1e300):
        with pytest.raises(ScheduleError, match="after"):
            spec.next_slot(bad)


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"every": 1e300}, "every"),
        ({"every": 11 * 365 * 86400}, "every"),
        ({"cron": "* * * * *", "jitter": 1e12}, "jitter"),
        ({"every": 60, "start": "9999-12-31T23:59:00+00:00"}, "start"),
        ({"cron": "* * * * *", "end": "1960-01-01T00:00:00+00:00"}, "end"),
    ],
)
def test_values_whose_slots_would_leave_the_calendar_are_refused(
    fields: dict[str, object], field: str
) -> None:
    with pytest.raises(ScheduleError) as refused:
        Spec(**fields)
    assert refused.value.field == field
