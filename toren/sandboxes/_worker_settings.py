"""A worker's settings for sandboxes, one of the parts ``toren.Settings`` is composed of.

A module of its own, light to import: every CLI command reads settings.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, ClassVar

import attrs

from toren._core.config import Env, positive
from toren._core.durations import setting_duration

if TYPE_CHECKING:
    from toren._agent.parts import AgentPart


def _checkpoint_sweep_every(value: str | float) -> float:
    return setting_duration("checkpoint_sweep_every", value)


def _checkpoint_grace(value: str | float) -> float:
    return setting_duration("checkpoint_grace", value)


def _part() -> AgentPart:
    """``[agents.NAME.sandbox]``'s part, loaded when a file has agent tables (it brings the
    sandbox's settings, heavier than a CLI command needs)."""
    from toren.sandboxes._settings import SANDBOX_PART

    return SANDBOX_PART


@attrs.frozen(kw_only=True, slots=False)  # one of several bases of toren.Settings
class SandboxWorkerSettings:
    """A worker's settings for sandboxes (an agent's own are :class:`Sandbox`).

    Attributes:
        sandboxes: Whether this worker runs sandboxes when Docker answers (default true);
            false keeps it from serving them even where Docker is.
        workspace_store: Where sandbox workspaces are checkpointed: a directory (or
            ``file:///path``), or ``s3://bucket/prefix`` (endpoint from
            ``TOREN_S3_ENDPOINT_URL`` for MinIO, R2 and the like). Unset: ``HOME/workspaces``,
            which only workers on this machine can read: use S3 across machines.
        sandbox_reap_seconds: How often a worker with Docker looks for sandbox containers
            whose run has ended, and removes them.
        checkpoint_sweep_every: How often the workers' checkpoint sweep deletes from the
            workspace store the checkpoints no kept actor names (one worker at a time; an hour
            by default; ``"6h"``-style or seconds).
        checkpoint_grace: How long a checkpoint's objects are kept after they were written,
            whatever names them (a day by default): longer than any checkpoint takes to write
            and be recorded (see ``toren.sandboxes.sweep``).
    """

    ENV: ClassVar[Env] = {
        "sandboxes": ("TOREN_SANDBOXES", bool),
        "workspace_store": ("TOREN_WORKSPACE_STORE", str),
        "sandbox_reap_seconds": ("TOREN_SANDBOX_REAP_SECONDS", float),
        "checkpoint_sweep_every": ("TOREN_CHECKPOINT_SWEEP_EVERY", str),
        "checkpoint_grace": ("TOREN_CHECKPOINT_GRACE", str),
    }
    TABLES: ClassVar[Mapping[str, str]] = {}
    AGENT_PARTS: ClassVar[Mapping[str, Callable[[], AgentPart]]] = {"sandbox": _part}

    sandboxes: bool = True
    workspace_store: str | None = None
    sandbox_reap_seconds: float = attrs.field(default=30.0, validator=positive)
    checkpoint_sweep_every: float = attrs.field(
        default=3600.0,
        converter=_checkpoint_sweep_every,
        validator=positive,
    )
    checkpoint_grace: float = attrs.field(
        default=86400.0,
        converter=_checkpoint_grace,
        validator=positive,
    )
