"""Log setup for the command line: one line per record on stderr, UTC timestamps."""

from __future__ import annotations

import logging
import re
import sys
import time

_BOT_TOKEN = re.compile(r"\d{3,}:[A-Za-z0-9_-]{10,}")
_SECRET_TOKEN = re.compile(r"""(secret_token['"]?\s*[:=]\s*['"]?)[A-Za-z0-9_-]+""")


def redact(text: str) -> str:
    """``text`` with anything shaped like a Telegram bot token (``123456:ABC...``) replaced,
    and a webhook's ``secret_token`` value (python-telegram-bot logs a call's parameters)."""
    return _SECRET_TOKEN.sub(r"\1<secret>", _BOT_TOKEN.sub("<bot token>", text))


class _Redacting(logging.Formatter):
    """Every line as formatted, bot tokens removed: python-telegram-bot logs its API URL, which
    holds the token, at DEBUG, and an error's text may quote a URL."""

    def format(self, record: logging.LogRecord) -> str:
        return redact(super().format(record))


def configure(level: str = "INFO") -> None:
    """Send Toren's logs (and the root logger's) to stderr, bot tokens redacted."""
    handler = logging.StreamHandler(sys.stderr)
    formatter = _Redacting("%(asctime)s.%(msecs)03dZ %(levelname)s %(name)s: %(message)s")
    formatter.datefmt = "%Y-%m-%dT%H:%M:%S"
    formatter.converter = time.gmtime
    handler.setFormatter(formatter)
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
