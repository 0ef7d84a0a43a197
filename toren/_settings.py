"""``toren.Settings``: every floor's settings in one value, as a worker or a client reads them.

Each floor declares its own fields, the variables it reads and the tables it parses; this module
only composes them: the kernel's :class:`~toren._core.config.WorkerSettings` (the database,
leases, the worker), the agent layer's :class:`~toren._agent.settings.AgentSettings`
(``[agents.NAME]`` and ``[rate_limits.NAME]`` tables, the message cap), the kinds'
:class:`~toren.sandboxes._worker_settings.SandboxWorkerSettings` and
:class:`~toren.channels._worker_settings.TelegramWorkerSettings` and
:class:`~toren.schedules._worker_settings.ScheduleWorkerSettings`, and the HTTP surface's
:class:`~toren._surfaces.http_settings.HttpSettings`.
"""

from __future__ import annotations

import attrs

from toren._agent.settings import AgentSettings
from toren._surfaces.http_settings import HttpSettings
from toren.channels._worker_settings import TelegramWorkerSettings
from toren.retention._worker_settings import RetentionWorkerSettings
from toren.sandboxes._worker_settings import SandboxWorkerSettings
from toren.schedules._worker_settings import ScheduleWorkerSettings


@attrs.frozen(kw_only=True)
class Settings(
    AgentSettings,
    HttpSettings,
    SandboxWorkerSettings,
    TelegramWorkerSettings,
    ScheduleWorkerSettings,
    RetentionWorkerSettings,
):
    """Runtime settings of a worker or a client.

    Read with :meth:`Settings.load` from the TOML file (``toren.toml`` or ``TOREN_CONFIG``), the
    ``TOREN_*`` variables and explicit overrides, in that order of precedence. The fields are
    documented where each layer declares them: the kernel's
    (:class:`~toren._core.config.WorkerSettings`: ``database_url``, ``home``, leases, polling,
    ``max_actors``, ``pool_size``, ``worker_name``, ``deploy_label``, restart limits, dedupe
    retention, ``snapshot_every``, ``config_file``), the agent layer's
    (:class:`~toren._agent.settings.AgentSettings`: ``max_message_bytes``, ``agents``,
    ``rate_limits``), the
    HTTP surface's (:class:`~toren._surfaces.http_settings.HttpSettings`: cookies, trusted
    proxies, streams, failed sign-ins, ``console_url``), sandboxes'
    (:class:`~toren.sandboxes._worker_settings.SandboxWorkerSettings`), Telegram's
    (:class:`~toren.channels._worker_settings.TelegramWorkerSettings`) and schedules'
    (:class:`~toren.schedules._worker_settings.ScheduleWorkerSettings`: their
    ``[agents.NAME.schedules.SLOT]`` tables) and retention's
    (:class:`~toren.retention._worker_settings.RetentionWorkerSettings`: ``prune_batch``,
    ``prune_lock_timeout``, ``prune_every``).
    """
