"""Schedules: runs of an agent started on a clock (``schedule/<name>`` actors).

Give an agent ``schedules=[Schedule(name="digest", cron="0 9 * * 1-5",
timezone="Europe/Berlin")]`` (or an ``[agents.NAME.schedules.SLOT]`` table). This package is
the vocabulary: the declaration (:class:`Schedule`), the time math of its slots (:class:`Spec`,
with its daylight-saving rule, in :mod:`toren.schedules.spec`) and the input template
(:mod:`toren.schedules.template`). See ``docs/schedules.md``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from toren._core.exports import lazy_exports

if TYPE_CHECKING:  # what the names below are, for type checkers (imported lazily at run time)
    from toren.schedules._declaration import (
        FIELDS,
        KEY_CAP,
        OVERLAPS,
        SLOT_NAME,
        TABLE_KEYS,
        Overlap,
        Schedule,
        configured,
        read_table,
    )
    from toren.schedules.spec import (
        CRON_CAP,
        EVERY_MIN,
        ScheduleError,
        Spec,
        slot_key,
        zone,
    )
    from toren.schedules.template import (
        INPUT_CAP,
        PLACEHOLDERS,
        check_template,
        render_input,
    )

__all__ = [
    "CRON_CAP",
    "EVERY_MIN",
    "FIELDS",
    "INPUT_CAP",
    "KEY_CAP",
    "OVERLAPS",
    "PLACEHOLDERS",
    "SLOT_NAME",
    "TABLE_KEYS",
    "Overlap",
    "Schedule",
    "ScheduleError",
    "Spec",
    "check_template",
    "configured",
    "read_table",
    "render_input",
    "slot_key",
    "zone",
]

# Each public name's module, imported on first use by ``__getattr__``: the declaration brings
# the agent layer (and pydantic), the spec the cron library.
_HOMES: dict[str, tuple[str, ...]] = {
    "toren.schedules._declaration": (
        "FIELDS",
        "KEY_CAP",
        "OVERLAPS",
        "SLOT_NAME",
        "TABLE_KEYS",
        "Overlap",
        "Schedule",
        "configured",
        "read_table",
    ),
    "toren.schedules.spec": (
        "CRON_CAP",
        "EVERY_MIN",
        "ScheduleError",
        "Spec",
        "slot_key",
        "zone",
    ),
    "toren.schedules.template": (
        "INPUT_CAP",
        "PLACEHOLDERS",
        "check_template",
        "render_input",
    ),
}


__getattr__, __dir__ = lazy_exports(__name__, _HOMES)
