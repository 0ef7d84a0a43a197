"""A worker's settings for Telegram channels, one of the parts ``toren.Settings`` is composed of.

A module of its own, light to import: every CLI command reads settings.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

import attrs

from toren._core.config import Env


@attrs.frozen(kw_only=True, slots=False)  # one of several bases of toren.Settings
class TelegramWorkerSettings:
    """A worker's settings for Telegram channels (an agent's own are :class:`Telegram`).

    Attributes:
        telegram_api_url: The Bot API's address (default ``https://api.telegram.org``): a
            self-hosted Bot API server, or a local test server.
    """

    ENV: ClassVar[Env] = {"telegram_api_url": ("TOREN_TELEGRAM_API_URL", str)}
    TABLES: ClassVar[Mapping[str, str]] = {}

    telegram_api_url: str | None = None
