"""What every ``toren`` command shares: consoles, the database URL, running async bodies."""

from __future__ import annotations

import functools
import os
import shlex
import shutil
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, ParamSpec, TypeVar

import anyio
import click
from rich.console import Console

from toren._cli.dev_state import RECORD_FILE, read_record
from toren._core.errors import ConfigError, TorenError
from toren._core.terminal import plain
from toren._settings import Settings

P = ParamSpec("P")
R = TypeVar("R")

# Piped output is read by programs and people alike: tables wide enough that ids are never
# cut, and lines never wrapped (a command or an id stays whole on its line).
_piped = not sys.stdout.isatty()
out = Console(width=200 if _piped else None, soft_wrap=_piped)
err = Console(stderr=True, soft_wrap=True)


# click.ParamType is generic from click 8.4 on; subscripting it here would fail on 8.1-8.3.
class Unshown(click.ParamType):  # type: ignore[type-arg]
    """``inner``, refusing a value read from the environment (``TOREN_PORT``,
    ``TOREN_LOG_LEVEL``) without repeating it: the variable may hold a secret set there by
    mistake. The error names the variable and says what form was expected. A value typed on
    the command line is shown as ``inner`` shows it."""

    def __init__(self, inner: click.ParamType[Any], expected: str) -> None:
        self.inner = inner
        self.expected = expected
        self.name = inner.name

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        try:
            return self.inner.convert(value, param, ctx)
        except click.BadParameter:
            source = ctx.get_parameter_source(param.name) if ctx and param and param.name else None
            if source == click.core.ParameterSource.COMMANDLINE:
                raise
            envvar = param.envvar if param is not None and isinstance(param.envvar, str) else ""
            where = f" (from {envvar}; its value is not shown)" if envvar else ""
            self.fail(f"expected {self.expected}{where}", param, ctx)

    def get_metavar(self, *args: Any, **kwargs: Any) -> str | None:
        # click 8.2 on passes (param, ctx), 8.1 (param): hand on what this click passes.
        metavar: str | None = self.inner.get_metavar(*args, **kwargs)
        return metavar


def database_url(settings: Settings) -> str:
    """The URL to use: configured, else the one a running ``toren dev`` recorded.

    Raises:
        ConfigError: neither exists.
    """
    if settings.database_url:
        return settings.database_url
    record = read_record(settings.home)
    if record is not None and record.running_in(settings.home):
        return record.database_url
    hint = (
        "Start `toren dev` in another terminal (with the same TOREN_HOME), or set "
        "TOREN_DATABASE_URL=postgresql://..."
    )
    if record is not None:
        raise ConfigError(
            f"no `toren dev` is running: the one recorded in {settings.home / RECORD_FILE} "
            f"(pid {record.pid}) has exited",
            hint=hint,
        )
    raise ConfigError(
        "no database: TOREN_DATABASE_URL is not set and no `toren dev` is running", hint=hint
    )


def toren_command() -> str:
    """How to run this ``toren`` from another terminal: ``toren`` when that finds this very
    program on the PATH, else its absolute path (``python -m toren`` when there is no script)."""
    script = _own_script()
    if script is None:
        return f"{shlex.quote(sys.executable)} -m toren"
    found = shutil.which("toren")
    if found is not None and _same_file(Path(found), script):
        return "toren"
    return shlex.quote(str(script))


def path_hint() -> str:
    """A line saying how to put ``toren`` on the PATH, when :func:`toren_command` is not plain
    ``toren`` and this Python is a virtualenv's; else nothing."""
    activate = Path(sys.prefix) / "bin" / "activate"
    if toren_command() == "toren" or not activate.is_file():
        return ""
    return (
        f"(`toren` is not on your PATH: the commands above name it in full; or run "
        f"`source {shlex.quote(str(activate))}` in the other terminal first)"
    )


def _own_script() -> Path | None:
    """The ``toren`` script running now (absolute), or this environment's, if there is one."""
    argv0 = Path(sys.argv[0]) if sys.argv and sys.argv[0] else None
    if argv0 is not None and argv0.name == "toren" and argv0.is_file():
        return argv0.absolute()
    beside = Path(sys.executable).parent / "toren"
    return beside.absolute() if beside.is_file() and os.access(beside, os.X_OK) else None


def _same_file(a: Path, b: Path) -> bool:
    try:
        return a.samefile(b)
    except OSError:
        return False


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
