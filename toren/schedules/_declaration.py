"""Schedules as users declare them: ``Agent(schedules=[Schedule(...)])`` and the settings file.

::

    [agents.reports.schedules.weekday_digest]
    cron = "0 9 * * 1-5"
    timezone = "Europe/Berlin"
    input = "Write the digest for {date}."
    jitter = "2m"

**Precedence**, as for an agent's other parts: the schedules in code are the defaults; a table
``[agents.NAME.schedules.SLOT]`` for a schedule in code replaces the keys it gives (giving
``cron`` drops the code's ``every``, and the other way round); a table for a slot the code has
not adds a schedule (its agent must be loaded by the process reading the file); ``enabled =
false`` removes the code's schedule of that slot. Schedules are not part of a model request:
adding, changing or removing one never voids a recorded model call.
"""

from __future__ import annotations

import re
import types
from collections.abc import Iterable, Mapping
from datetime import datetime
from typing import TYPE_CHECKING, Any, ClassVar, Literal, cast, get_args

import attrs

from toren._agent.agents import parse_duration
from toren._agent.parts import AgentPart
from toren._core.errors import ConfigError
from toren.schedules.spec import ScheduleError, Spec, aware, check_text, seconds
from toren.schedules.template import check_template

if TYPE_CHECKING:
    from toren._agent.agents import Agent, Tool

Overlap = Literal["skip", "buffer_one", "buffer_all", "cancel_other", "allow_all"]
"""What a slot does while the schedule's previous run is in flight: ``skip`` it (the default),
keep one waiting (``buffer_one``) or all (``buffer_all``), cancel the previous run
(``cancel_other``), or start anyway (``allow_all``)."""

OVERLAPS: tuple[str, ...] = get_args(Overlap)

SLOT_NAME = re.compile(r"[a-z0-9][a-z0-9_-]{0,62}")
"""What a schedule's (slot's) name may be: it is part of its actor's id (``schedule/...``)."""

KEY_CAP = 200
"""UTF-8 bytes a ``concurrency_key`` may hold."""


def _name(value: object) -> str:
    text = check_text("name", value, 63, what="a schedule name")
    if not SLOT_NAME.fullmatch(text):
        raise ScheduleError(
            "name",
            "must be 1 to 63 lowercase letters, digits, '_' or '-', starting with a letter "
            "or digit",
        )
    return text


def _duration(field: str, *, positive: bool = False) -> Any:
    """A converter: seconds as a number or a duration text (``"30m"``, ``"1h30m"``)."""

    def convert(value: object) -> float:
        if isinstance(value, str):
            check_text(field, value, 64, what="a duration")
            try:
                return parse_duration(value)
            except ConfigError as exc:
                raise ScheduleError(field, exc.what, hint=exc.hint) from None
        return seconds(field, value, positive=positive)

    return convert


def _optional(convert: Any) -> Any:
    return lambda value: None if value is None else convert(value)


def _as_given(value: float | str | None) -> Any:
    """Seconds or a duration text, as given: checked (and parsed) once the schedule's name is
    known (``Schedule.__attrs_post_init__``)."""
    return value


def _as_given_time(value: datetime | str | None) -> Any:
    """A datetime or ISO-8601 text, as given: checked likewise."""
    return value


def _overlap(value: object) -> Overlap:
    if value not in OVERLAPS:
        shown = value if isinstance(value, str) and len(value) <= 40 else type(value).__name__
        raise ScheduleError("overlap", f"must be one of {', '.join(OVERLAPS)}, got {shown!r}")
    return cast("Overlap", value)


def _key(value: object) -> str:
    text = check_text("concurrency_key", value, KEY_CAP)
    if not text:
        raise ScheduleError("concurrency_key", "must not be empty (leave it out)")
    return text


def _flag(value: object) -> bool:
    if not isinstance(value, bool):
        raise ScheduleError("pause_on_failure", "must be true or false")
    return value


def _timezone(value: object) -> str:
    return check_text("timezone", value, 64, what="an IANA time zone name")


@attrs.frozen(kw_only=True)
class Schedule:
    """An agent's schedule: when it starts a run, with what input, and what it does when runs
    overlap or slots were missed.

    Attributes:
        name: The slot's name, unique among the agent's schedules (``[a-z0-9][a-z0-9_-]*``, at
            most 63 characters); its table is ``[agents.NAME.schedules.<name>]``.
        cron: A five-field cron expression (or ``@daily``, ``@hourly``...), read in
            ``timezone``. Exactly one of ``cron`` and ``every``.
        every: An interval: seconds, or a duration such as ``"30m"`` (at least 1 second);
            slots are anchored at ``start``, else at the Unix epoch.
        timezone: The IANA time zone the cron expression is read in (default ``UTC``). Its
            daylight-saving rule is in :mod:`toren.schedules.spec`.
        jitter: The most a slot's run is delayed (seconds or a duration), the same delay on
            every worker for a given slot.
        start: No slot before it (a datetime with an offset, or ISO-8601 text).
        end: No slot after it.
        input: The run's input, a template (:mod:`toren.schedules.template`): ``{slot}``,
            ``{date}``, ``{schedule}``... (default ``"{slot}"``).
        concurrency_key: The runs' concurrency key (plain text, at most 200 bytes), if any.
        overlap: What a slot does while the previous run is in flight (:data:`Overlap`).
        catch_up: Slots missed while no worker ran are started if they are at most this many
            seconds old (or a duration); 0 (the default) skips them.
        pause_on_failure: Pause the schedule when one of its runs fails.

    Raises:
        ScheduleError: a value is invalid; the message names the schedule and the field.
    """

    agent_field: ClassVar[str] = "schedules"  # toren._agent.parts: Agent(schedules=[...])

    name: str
    cron: str | None = None
    every: float | None = attrs.field(default=None, converter=_as_given)
    timezone: str = "UTC"
    jitter: float = attrs.field(default=0.0, converter=_as_given)
    start: datetime | None = attrs.field(default=None, converter=_as_given_time)
    end: datetime | None = attrs.field(default=None, converter=_as_given_time)
    input: str = "{slot}"
    concurrency_key: str | None = None
    overlap: Overlap = "skip"
    catch_up: float = attrs.field(default=0.0, converter=_as_given)
    pause_on_failure: bool = False
    _spec: Spec = attrs.field(init=False, eq=False, repr=False)

    def __attrs_post_init__(self) -> None:
        # Checked here rather than by converters, so that every error names the schedule.
        _name(self.name)
        normal = {
            "every": _optional(_duration("every", positive=True)),
            "timezone": _timezone,
            "jitter": _duration("jitter"),
            "start": _optional(lambda v: aware("start", v)),
            "end": _optional(lambda v: aware("end", v)),
            "overlap": _overlap,
            "catch_up": _duration("catch_up"),
            "pause_on_failure": _flag,
        }
        try:
            for field, convert in normal.items():
                object.__setattr__(self, field, convert(getattr(self, field)))
            spec = Spec(
                cron=self.cron,
                every=self.every,
                timezone=self.timezone,
                jitter=self.jitter,
                start=self.start,
                end=self.end,
            )
            check_template(self.input)
            if self.concurrency_key is not None:
                _key(self.concurrency_key)
        except ScheduleError as exc:
            raise exc.located(f"schedule {self.name!r}") from None
        object.__setattr__(self, "_spec", spec)
        if spec.cron is not None:  # the canonical spelling (nicknames spelled out)
            object.__setattr__(self, "cron", spec.cron)

    @property
    def spec(self) -> Spec:
        """When it fires (:class:`~toren.schedules.spec.Spec`)."""
        return self._spec

    def agent_tools(self, agent: Agent) -> tuple[Tool, ...]:
        """None: a schedule gives the model no tools (it is not part of a model request)."""
        return ()

    def to_json(self) -> dict[str, Any]:
        """The schedule as a plain dict of JSON types (datetimes as ISO-8601 text), which
        :meth:`from_json` reads back."""
        data = attrs.asdict(self, recurse=False, filter=lambda a, _: a.init)
        for key in ("start", "end"):
            if data[key] is not None:
                data[key] = data[key].isoformat()
        return data

    @classmethod
    def from_json(cls, data: Mapping[str, Any], *, strict: bool = True) -> Schedule:
        """The schedule :meth:`to_json` gave, or one sent by a user in that form.

        Args:
            data: The dict.
            strict: Refuse keys this version does not know (a user's input); ``False``
                ignores them (stored by a newer version).

        Raises:
            ScheduleError: ``data`` is not a dict, has unknown keys (``strict``), lacks
                ``name``, or a value is invalid.
        """
        if not isinstance(data, Mapping):
            raise ScheduleError("schedule", "must be an object of the schedule's fields")
        known = (*FIELDS, "name")
        unknown = sorted(str(k) for k in data if k not in known)
        if unknown and strict:
            raise ScheduleError(
                "schedule", f"unknown key(s): {', '.join(unknown)[:200]}", hint=_KNOWN
            )
        if "name" not in data:
            raise ScheduleError("name", "is required")
        return cls(**{k: v for k, v in data.items() if k in known})


FIELDS = tuple(f.name for f in attrs.fields(Schedule) if f.init and f.name != "name")
"""The keys a schedule's table may give (its name is the table's)."""

TABLE_KEYS = (*FIELDS, "enabled")
"""The keys of an ``[agents.NAME.schedules.SLOT]`` table."""

_KNOWN = f"Known keys: {', '.join(TABLE_KEYS)}."
_STRINGS = ("cron", "timezone", "input", "concurrency_key", "overlap")


def _slot_where(where: str, slot: str) -> str:
    """``[agents.A.schedules.SLOT] in FILE`` from ``[agents.A.schedules] in FILE``."""
    head, sep, tail = where.partition("] in ")
    return f"{head}.{slot}{sep}{tail}" if sep else f"{where}, schedule {slot!r}"


def read_table(table: Mapping[str, Any], where: str) -> Mapping[str, Any]:
    """``[agents.NAME.schedules]`` as read from the file: each slot's table checked for its
    shape (a table, a valid name, known keys, ``enabled`` true or false, strings where
    strings go), frozen. Values are checked when merged into the agent (:func:`configured`).

    Raises:
        ConfigError: naming the slot's table and the key.
    """
    slots: dict[str, Mapping[str, Any]] = {}
    for slot, keys in table.items():
        slot_where = _slot_where(where, slot)
        if not isinstance(keys, Mapping):
            raise ConfigError(f"{slot_where} must be a table", hint="cron = '0 9 * * *', ...")
        try:
            _name(slot)
        except ScheduleError as exc:
            raise ConfigError(f"{slot_where}: the schedule's name {exc.detail}") from None
        unknown = sorted(set(keys) - set(TABLE_KEYS))
        if unknown:
            raise ConfigError(f"unknown key(s) in {slot_where}: {', '.join(unknown)}", hint=_KNOWN)
        if "enabled" in keys and not isinstance(keys["enabled"], bool):
            raise ConfigError(f"enabled in {slot_where} must be true or false")
        for key in _STRINGS:
            if key in keys and not isinstance(keys[key], str):
                raise ConfigError(f"{key} in {slot_where} must be a string")
        slots[slot] = types.MappingProxyType(dict(keys))
    return types.MappingProxyType(slots)


def configured(
    current: Iterable[Schedule], table: Mapping[str, Any], where: str
) -> tuple[Schedule, ...]:
    """The agent's schedules (``current``, from code) with ``[agents.NAME.schedules]``
    applied: the code's in their order, then the table's new slots in the file's order.

    Raises:
        ConfigError: a slot's table is malformed or gives an invalid value (naming its table
            and the key).
    """
    code = tuple(current)
    slots = read_table(table, where)
    merged: list[Schedule] = []
    for schedule in code:
        keys = slots.get(schedule.name)
        if keys is None:
            merged.append(schedule)
        elif keys.get("enabled", True):
            merged.append(_applied(schedule, keys, _slot_where(where, schedule.name)))
    names = {s.name for s in code}
    for slot, keys in slots.items():
        if slot not in names and keys.get("enabled", True):
            merged.append(_applied(None, keys, _slot_where(where, slot), slot))
    return tuple(merged)


def _applied(
    schedule: Schedule | None, keys: Mapping[str, Any], where: str, name: str = ""
) -> Schedule:
    values = {k: v for k, v in keys.items() if k != "enabled"}
    try:
        if schedule is None:
            return Schedule(name=name, **values)
        if "cron" in values and "every" not in values:  # the table's trigger replaces the code's
            values["every"] = None
        elif "every" in values and "cron" not in values:
            values["cron"] = None
        return attrs.evolve(schedule, **values)
    except ScheduleError as exc:
        raise exc.located(where) from None
    except (TypeError, ValueError) as exc:  # a value of an unexpected type
        raise ConfigError(f"{where}: {exc}") from None


SCHEDULES_PART = AgentPart(field="schedules", settable=None, configured=configured, read=read_table)
"""How ``[agents.NAME.schedules.SLOT]`` tables change (or give) an agent's schedules."""
