"""A worker's settings for Telegram channels, one of the parts ``toren.Settings`` is composed of.

A module of its own, light to import: every CLI command reads settings.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, ClassVar

import attrs

from toren._core.config import Env

if TYPE_CHECKING:
    from toren._agent.parts import AgentPart


def _part() -> AgentPart:
    """``[agents.NAME.telegram]``'s part, loaded when a file has agent tables (it brings the
    channel's settings, heavier than a CLI command needs)."""
    from toren.channels._settings import TELEGRAM_PART

    return TELEGRAM_PART


@attrs.frozen(kw_only=True, slots=False)  # one of several bases of toren.Settings
class TelegramWorkerSettings:
    """A worker's settings for Telegram channels (an agent's own are :class:`Telegram`).

    Attributes:
        telegram_api_url: The Bot API's address (default ``https://api.telegram.org``): a
            self-hosted Bot API server, or a local test server.
    """

    ENV: ClassVar[Env] = {"telegram_api_url": ("TOREN_TELEGRAM_API_URL", str)}
    TABLES: ClassVar[Mapping[str, str]] = {}
    AGENT_PARTS: ClassVar[Mapping[str, Callable[[], AgentPart]]] = {"telegram": _part}

    telegram_api_url: str | None = None
