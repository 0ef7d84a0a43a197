"""A schedule's input: a template the slot's time is written into.

A template is text with a few fixed placeholders; ``{{`` and ``}}`` stand for ``{`` and ``}``:

- ``{slot}``: the slot's local time, ISO-8601 with its offset (``2026-03-29T03:00:00+02:00``);
- ``{slot_utc}``: the slot's instant in UTC (``2026-03-29T01:00:00Z``, its key);
- ``{date}``: the slot's local date (``2026-03-29``);
- ``{time}``: the slot's local time of day (``03:00``);
- ``{weekday}``: the slot's local day of the week, in English (``Sunday``);
- ``{timezone}``: the schedule's time zone (``Europe/Berlin``);
- ``{schedule}``: the schedule's name.

Anything else in braces is refused when the template is checked (:func:`check_template`),
before a schedule is stored. The template is never given to ``str.format``: no attribute or
index of any object can be reached from it.
"""

from __future__ import annotations

import math
import re
from datetime import datetime

from toren.schedules.spec import TIMEZONE_CAP, ScheduleError, check_text, slot_key, zone

INPUT_CAP = 64 * 1024
"""UTF-8 bytes a template may hold: a run's input cap by default (``max_message_bytes``)."""

PLACEHOLDERS = ("slot", "slot_utc", "date", "time", "weekday", "timezone", "schedule")
"""The names a template may hold in braces."""

_LONGEST = {
    "slot": len("2026-03-29T03:00:00+00:53:28"),  # an offset in seconds: a zone's early years
    "slot_utc": len("2026-03-29T01:00:00Z"),
    "date": len("2026-03-29"),
    "time": len("03:00"),
    "weekday": len("Wednesday"),
    "timezone": TIMEZONE_CAP,
    "schedule": 100 + 1 + 63,  # AGENT/SLOT, each at its longest
}
"""The most bytes each placeholder is filled in with (all of them ASCII)."""

_TOKEN = re.compile(r"\{\{|\}\}|\{([^{}]*)\}|[{}]")
_WEEKDAYS = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday")
_HINT = (
    f"Placeholders: {', '.join('{' + name + '}' for name in PLACEHOLDERS)}; "
    "write {{ and }} for a brace."
)


def _pieces(template: str) -> list[str | tuple[str]]:
    """The template as literal text and ``(placeholder,)`` items.

    Raises:
        ScheduleError: a placeholder is unknown, or a brace is unmatched.
    """
    pieces: list[str | tuple[str]] = []
    position = 0
    for match in _TOKEN.finditer(template):
        pieces.append(template[position : match.start()])
        position = match.end()
        token = match.group(0)
        if token in ("{{", "}}"):
            pieces.append(token[0])
        elif match.group(1) is None:
            raise ScheduleError(
                "input", f"unmatched {token!r} at character {match.start() + 1}", hint=_HINT
            )
        elif match.group(1) not in PLACEHOLDERS:
            name = match.group(1)
            shown = name if len(name) <= 40 else name[:37] + "..."
            raise ScheduleError("input", f"unknown placeholder {{{shown}}}", hint=_HINT)
        else:
            pieces.append((match.group(1),))
    pieces.append(template[position:])
    return pieces


def check_template(template: object) -> str:
    """``template`` if it is a valid input template: text of at most :data:`INPUT_CAP`
    bytes, also once its placeholders are filled in at their longest, no NUL or lone
    surrogate, known placeholders only, and not empty (a run needs an input).

    Raises:
        ScheduleError: it is not (``field`` is ``input``).
    """
    text = check_text("input", template, INPUT_CAP, what="a text")
    if not text.strip():
        raise ScheduleError("input", "must not be empty: it is the run's input", hint=_HINT)
    pieces = _pieces(text)
    if "{" in text:  # filled in, it must still fit a run's input, whatever the slot
        longest = sum(len(p.encode()) if isinstance(p, str) else _LONGEST[p[0]] for p in pieces)
        if longest > INPUT_CAP:
            raise ScheduleError(
                "input",
                f"filled in, it may reach {longest} bytes; a run's input holds at most {INPUT_CAP}",
            )
    return text


def render_input(template: str, slot: float, timezone: str, schedule: str) -> str:
    """The input of the run for ``slot`` (epoch seconds): ``template`` with its placeholders
    filled in for the slot's time in ``timezone``.

    Raises:
        ScheduleError: the template is invalid (:func:`check_template`), or the time zone
            is unknown.
    """
    pieces = _pieces(check_template(template))
    key = slot_key(slot)
    local = datetime.fromtimestamp(math.floor(slot), zone(timezone))
    values = {
        "slot": local.isoformat(timespec="seconds"),
        "slot_utc": key,
        "date": local.date().isoformat(),
        "time": f"{local.hour:02d}:{local.minute:02d}",
        "weekday": _WEEKDAYS[local.weekday()],
        "timezone": timezone,
        "schedule": schedule,
    }
    return "".join(values[p[0]] if isinstance(p, tuple) else p for p in pieces)
