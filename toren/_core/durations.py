"""Durations as settings and agents write them: ``"30m"``, ``"1h30m"``, ``"30d"``, or seconds.

The kernel's settings read them (how long dead letters and revoked tokens are kept), and so does
every floor above (an agent's timeouts, a schedule's period): one parser for all.
"""

from __future__ import annotations

import contextlib
import re

from toren._core.errors import ConfigError

KEEP_MAX = 1000 * 365 * 86400.0
"""The longest period data is kept for (a thousand years: "for ever"). Longer ones are refused:
Postgres subtracts them from now (``now() - make_interval(...)``), and its timestamps begin in
4713 BC."""

# At most 15 digits a part: a longer one is over the largest duration anyway, and Python refuses
# to read an integer of more than 4,300 digits (a ValueError, not the ConfigError said here).
_DURATION = re.compile(
    r"^\s*(?:(\d{1,15})d)?\s*(?:(\d{1,15})h)?\s*(?:(\d{1,15})m)?\s*(?:(\d{1,15})s)?\s*$"
)


def parse_duration(text: str | float) -> float:
    """Seconds in ``"30m"``, ``"1h30m"``, ``"45s"``, ``"30d"`` or a number of seconds.

    Raises:
        ConfigError: the text is not a duration, or it is not a positive, finite one.
    """
    if isinstance(text, bool) or not isinstance(text, int | float | str):
        raise ConfigError("not a duration (a number or text)", hint="Write it like '30m' or 1800.")
    if isinstance(text, int | float):
        try:
            seconds = float(text)
        except OverflowError:
            seconds = float("inf")
        if not 0 < seconds < float("inf"):  # also false for NaN
            raise ConfigError(f"duration must be positive and finite, got {text!r}")
        return seconds
    match = _DURATION.match(text)
    if not match or not any(match.groups()):
        # The text is not shown: a setting's value that does not parse may be a misplaced secret.
        raise ConfigError(
            "not a duration (the text is not shown)",
            hint="Write it like '30m', '1h30m', '45s', '30d'.",
        )
    days, hours, minutes, seconds = (int(g) if g else 0 for g in match.groups())
    total = days * 86400 + hours * 3600 + minutes * 60 + seconds
    if not 0 < total < 10**15:
        raise ConfigError("duration must be positive and finite")
    return float(total)


def setting_duration(name: str, value: str | float) -> float:
    """The value of the duration setting ``name``: :func:`parse_duration`'s forms, or a number
    of seconds as text (what an environment variable gives).

    Raises:
        ConfigError: it is none of these, or not positive and finite, or longer than
            :data:`KEEP_MAX`; the message names the setting, never its value.
    """
    if isinstance(value, str):
        with contextlib.suppress(ValueError):
            value = float(value)
    try:
        seconds = parse_duration(value)
    except ConfigError:
        raise ConfigError(
            f"{name} is not a positive duration (the value is not shown)",
            hint="Write it like '30d', '12h', '1h30m' or a number of seconds.",
        ) from None
    return kept_for(name, seconds)


def kept_for(name: str, seconds: float) -> float:
    """``seconds``, the period ``name`` keeps something for, checked.

    Raises:
        ConfigError: it is longer than :data:`KEEP_MAX`.
    """
    if seconds > KEEP_MAX:
        raise ConfigError(
            f"{name} must be at most {KEEP_MAX / 86400 / 365:.0f} years",
            hint="Postgres subtracts it from now, and its timestamps begin in 4713 BC.",
        )
    return seconds
