"""Retention: each agent's ended runs pruned by its :class:`toren.Retention`, one pruner actor
per agent (``retention/<agent>``, kind ``toren.retention``), an audit record kept of each run.

This package is the pruner's vocabulary: its messages, its runtime on a worker, its client, the
worker settings of its batches. What a batch does is :mod:`toren.runs.prune`; what stays of a
pruned run, :mod:`toren.runs.audit`; the costs surface, :mod:`toren.runs.costs`. See the
"Retention" section of ``docs/operations.md``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from toren._core.exports import lazy_exports

if TYPE_CHECKING:
    from toren.retention.client import NoPruner, ensure_pruners, prune_now
    from toren.retention.messages import PRUNER_KIND, PRUNER_PREFIX, PruneNow, PruneTick, pruner_id

__all__ = [
    "PRUNER_KIND",
    "PRUNER_PREFIX",
    "NoPruner",
    "PruneNow",
    "PruneTick",
    "ensure_pruners",
    "prune_now",
    "pruner_id",
]

_HOMES: dict[str, tuple[str, ...]] = {
    "toren.retention.client": ("NoPruner", "ensure_pruners", "prune_now"),
    "toren.retention.messages": (
        "PRUNER_KIND",
        "PRUNER_PREFIX",
        "PruneNow",
        "PruneTick",
        "pruner_id",
    ),
}

__getattr__, __dir__ = lazy_exports(__name__, _HOMES)
