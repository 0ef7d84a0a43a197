"""A worker's settings for schedules, one of the parts ``toren.Settings`` is composed of.

A module of its own, light to import: every CLI command reads settings. Schedules have no
worker-wide setting yet; this part names how ``[agents.NAME.schedules.SLOT]`` tables are read.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, ClassVar

import attrs

from toren._core.config import Env

if TYPE_CHECKING:
    from toren._agent.parts import AgentPart


def _part() -> AgentPart:
    """``[agents.NAME.schedules]``'s part, loaded when a file has agent tables (it brings the
    cron library and the schedules' declarations, which a CLI command does without)."""
    from toren.schedules._declaration import SCHEDULES_PART

    return SCHEDULES_PART


@attrs.frozen(kw_only=True, slots=False)  # one of several bases of toren.Settings
class ScheduleWorkerSettings:
    """A worker's settings for schedules (an agent's own are :class:`Schedule`)."""

    ENV: ClassVar[Env] = {}
    TABLES: ClassVar[Mapping[str, str]] = {}
    AGENT_PARTS: ClassVar[Mapping[str, Callable[[], AgentPart]]] = {"schedules": _part}
