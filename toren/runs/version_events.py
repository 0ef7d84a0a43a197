"""What a run records and receives about its agent's version (see
:func:`toren.runs.agent_version`): the move to another version, and the message that asks for it.

A run records the version it started on (``run.started``'s ``version``). It moves to another
only at a boundary its agent's version policy names, recording ``run.upgraded`` with both
versions and how its history was taken: ``replay`` (its recorded calls are checked against the
new version's requests and invalidated forward from the first that differs, as a changed deploy
did before versions) or ``value`` (taken as they are: none is checked again or paid again).
"""

from __future__ import annotations

from typing import Literal

import attrs

from toren._agent.principal import Principal
from toren._core.codec import message
from toren.runs.events import FORMAT

UpgradeHow = Literal["replay", "value"]


@message("run.upgrade")
@attrs.frozen(kw_only=True)
class Upgrade:
    """Move to ``to_version`` (sent by :func:`toren.runs.upgrade_run` with the run's row
    re-routed to it, so that a worker serving that version handles it)."""

    to_version: str
    by: Principal | None = None


@message("run.upgraded")
@attrs.frozen(kw_only=True)
class RunUpgraded:
    """The run moved from one agent version to another (``from_version`` is ``""`` for a run
    started before runs recorded their version).

    Attributes:
        how: ``replay``: the calls recorded are checked against the requests of the new
            version, invalidated forward from the first that differs (a ``steps.invalidated``
            follows if one does); ``value``: the calls recorded are taken as they are
            (``settled_calls`` becomes their count), nothing is checked or paid again.
        by: Who asked for it (``toren jobs upgrade``); ``None`` when the run moved by its
            policy.
    """

    from_version: str
    to_version: str
    how: UpgradeHow
    by: Principal | None = None
    at: float = 0.0
    v: int = FORMAT
