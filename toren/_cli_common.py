"""What every ``toren`` command shares: consoles, the database URL, running async bodies."""

from __future__ import annotations

import functools
import sys
from collections.abc import Awaitable, Callable
from typing import ParamSpec, TypeVar

import anyio
from rich.console import Console

from toren._config import Settings
from toren._db import recorded_dev_url
from toren._errors import ConfigError, TorenError
from toren._terminal import plain

P = ParamSpec("P")
R = TypeVar("R")

# Piped output is read by programs and people alike: wide enough that ids are never cut.
out = Console(width=None if sys.stdout.isatty() else 200)
err = Console(stderr=True, soft_wrap=True)


def database_url(settings: Settings) -> str:
    """The URL to use: configured, else the one a running ``toren dev`` recorded.

    Raises:
        ConfigError: neither exists.
    """
    url = settings.database_url or recorded_dev_url(settings.home)
    if url is None:
        raise ConfigError(
            "no database: TOREN_DATABASE_URL is not set and no `toren dev` is running",
            hint="Set TOREN_DATABASE_URL=postgresql://..., or start `toren dev` in another "
            "terminal.",
        )
    return url


def run_async(fn: Callable[P, Awaitable[R]]) -> Callable[P, R]:
    """Run an async command body, turning Toren errors into a message and an exit code."""

    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        async def main() -> R:
            return await fn(*args, **kwargs)

        return run_reporting(main)

    return wrapper


def run_reporting(main: Callable[[], Awaitable[R]]) -> R:
    """``anyio.run(main)``; a Toren error (also inside an exception group) becomes a message on
    stderr and exit code 2 (configuration) or 1 (anything else)."""
    try:
        return anyio.run(main)
    except (TorenError, BaseExceptionGroup) as exc:
        error = _toren_error(exc)
        if error is None:
            raise
        print_error(error)
        sys.exit(2 if isinstance(error, ConfigError) else 1)


def print_error(error: Exception) -> None:
    """``error: <message>`` on stderr, the message printed inert (it can carry run text)."""
    err.print(plain("error:", style="red"), plain(str(error)))


def _toren_error(exc: BaseException) -> TorenError | None:
    """The Toren error at the root of ``exc``, looking through exception groups."""
    if isinstance(exc, TorenError):
        return exc
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            found = _toren_error(inner)
            if found is not None:
                return found
    return None
