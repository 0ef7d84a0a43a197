"""Log setup for the command line: one line per record on stderr, UTC timestamps."""

from __future__ import annotations

import contextlib
import logging
import re
import sys
import time

_BOT_TOKEN = re.compile(r"\d{3,}:[A-Za-z0-9_-]{10,}")
_DATE = "%Y-%m-%dT%H:%M:%S"
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


class TorenHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Toren's handler (:func:`configure`): a stream handler that also takes lines formatted
    elsewhere in the same shape (the access log's, written in batches).

    Attributes:
        chosen: the level chosen for every logger (``--log-level``), if one was.
    """

    chosen: str | None = None

    def write(self, text: str) -> None:
        """Write ``text`` (whole lines, already formatted and redacted) as :meth:`emit` would."""
        with self.lock or contextlib.nullcontext():
            try:
                self.stream.write(text)
                self.flush()
            except (OSError, ValueError):  # a closed or broken stream: as emit, stop nothing
                self.handleError(logging.makeLogRecord({"msg": "access log lines"}))


def line_prefix(at: float) -> str:
    """What :func:`configure`'s format puts before a record's level, for a record made at
    ``at`` (seconds since the epoch): ``2026-12-03T19:47:47.123Z ``."""
    return f"{time.strftime(_DATE, time.gmtime(at))}.{int((at - int(at)) * 1000):03d}Z "


# Toren's own loggers: its package, and the names its worker packages log under when imported
# as top-level packages (`actors`, `supervisors`).
OWN_LOGGERS = ("toren", "actors", "supervisors")
LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def configure(level: str | None = None) -> None:
    """Send every log record to stderr, one line each, UTC timestamps, bot tokens redacted.

    Without ``level``, Toren's own loggers (:data:`OWN_LOGGERS`, and an app's package named
    with :func:`show_info_from`) log from INFO and every other library's from WARNING: the
    embedded Postgres's start-up, an HTTP client's line per request and the like stay out of
    sight unless something goes wrong. With ``level`` (``--log-level``), every logger logs
    from it.

    Raises:
        ValueError: ``level`` is not one of :data:`LEVELS`.
    """
    if level is not None and level.upper() not in LEVELS:
        raise ValueError(f"unknown log level {level!r}: use one of {', '.join(LEVELS)}")
    handler = TorenHandler(sys.stderr)
    handler.chosen = level.upper() if level else None
    formatter = _Redacting("%(asctime)s.%(msecs)03dZ %(levelname)s %(name)s: %(message)s")
    formatter.datefmt = _DATE
    formatter.converter = time.gmtime
    handler.setFormatter(formatter)
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(handler.chosen or logging.WARNING)
    for name in OWN_LOGGERS:
        show_info_from(name)


def show_info_from(name: str) -> None:
    """Let logger ``name`` (an app's package) log from INFO, as Toren's own do, unless a level
    was chosen for all (then it follows that).

    The choice is read from the root logger's handler that :func:`configure` installed:
    the logging configuration is the process's, and Toren keeps no copy of it. If that
    handler is gone (the app configured logging itself), the logger is left as it is.
    """
    ours = [h for h in logging.getLogger().handlers if isinstance(h, TorenHandler)]
    if not ours:  # the app configured logging itself (after configure): its levels are its own
        return
    chosen = any(h.chosen for h in ours)
    logging.getLogger(name).setLevel(logging.NOTSET if chosen else logging.INFO)
