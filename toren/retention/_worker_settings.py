"""A worker's settings for retention, one of the parts ``toren.Settings`` is composed of.

A module of its own, light to import: every CLI command reads settings. An agent's own policy is
:class:`toren.Retention` (``[agents.NAME.retention]``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import attrs

from toren._core.actor import MAX_DELAY
from toren._core.config import Env
from toren._core.durations import parse_duration
from toren._core.errors import ConfigError


def seconds(value: Any) -> float:
    """``0.2``, ``"200ms"``, ``"10m"``, ``"1h30m"`` as seconds.

    Raises:
        ConfigError: not a positive, finite duration, or longer than a timer's longest delay
            (ten years).
    """
    if isinstance(value, str) and value.strip().endswith("ms"):
        try:
            ms = float(value.strip()[:-2])
        except ValueError:
            raise ConfigError(
                "not a duration (the text is not shown)", hint="Write it like '200ms' or 0.2."
            ) from None
        if not 0 < ms < float("inf"):
            raise ConfigError("duration must be positive and finite")
        return ms / 1000
    period = parse_duration(value)
    if period > MAX_DELAY:  # a pruner's timer is set that far ahead
        raise ConfigError(f"duration must be at most {MAX_DELAY / 86400 / 365:.0f} years")
    return period


def _batch(inst: Any, attribute: attrs.Attribute[Any], value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 10_000:
        raise ConfigError("prune_batch must be a whole number from 1 to 10000")


def _lock_timeout(inst: Any, attribute: attrs.Attribute[Any], value: float) -> None:
    if not 0.001 <= value <= 60:
        raise ConfigError("prune_lock_timeout must be from 1ms to 60s")


@attrs.frozen(kw_only=True, slots=False)  # one of several bases of toren.Settings
class RetentionWorkerSettings:
    """A worker's settings for pruning its agents' ended runs.

    Attributes:
        prune_batch: Run trees (a root run and the runs below it) one batch prunes at most
            (default 100): the rows one transaction deletes.
        prune_lock_timeout: How long a batch's transaction waits for a lock at most (default
            200 ms; ``"200ms"`` or seconds). Its rows are taken ``SKIP LOCKED``: a row a step
            holds is skipped, not waited for.
        prune_every: How often each agent's pruner wakes (default 10 minutes).
    """

    ENV: ClassVar[Env] = {
        "prune_batch": ("TOREN_PRUNE_BATCH", int),
        "prune_lock_timeout": ("TOREN_PRUNE_LOCK_TIMEOUT", str),
        "prune_every": ("TOREN_PRUNE_EVERY", str),
    }
    TABLES: ClassVar[Mapping[str, str]] = {}

    prune_batch: int = attrs.field(default=100, validator=_batch)
    prune_lock_timeout: float = attrs.field(default=0.2, converter=seconds, validator=_lock_timeout)
    prune_every: float = attrs.field(default=600.0, converter=seconds)
