"""The pruner's messages: its timer and a prune asked for now (``toren jobs prune``).

A pruner (kind ``toren.retention``, id ``retention/<agent>``) records no events: what it did
is in ``toren.prune_log`` and the audit records, and its own journal stays empty however long
it runs (a pruner whose journal grew with each prune would be the growth it is there to stop).
"""

from __future__ import annotations

import attrs

from toren._agent.principal import Principal
from toren._core.codec import message

PRUNER_KIND = "toren.retention"
PRUNER_PREFIX = "retention/"


def pruner_id(agent: str) -> str:
    """The pruner of ``agent``'s runs."""
    return PRUNER_PREFIX + agent


@message("retention.tick")
@attrs.frozen
class PruneTick:
    """The pruner's timer (every ``prune_every``), and the wake a worker sends at its start."""


@message("retention.prune_now")
@attrs.frozen(kw_only=True)
class PruneNow:
    """Prune now, batch after batch until nothing is left to prune (``toren jobs prune``)."""

    by: Principal | None = None
