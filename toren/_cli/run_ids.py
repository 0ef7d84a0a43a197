"""Runs on the command line: what a person types resolved to one run (``run/<uuid>``, the uuid,
or a prefix of it that only one run's id starts with), and the console link printed beside a
run when the console's address is known."""

from __future__ import annotations

from typing import TYPE_CHECKING

from toren._cli.dev_state import read_record
from toren._core.errors import ConfigError

if TYPE_CHECKING:
    from toren._core.client import Client
    from toren._settings import Settings


async def resolve(client: Client, text: str) -> str:
    """The id of the run ``text`` names.

    Raises:
        ConfigError: it names no run, or several (they are listed); the hint says what to do.
    """
    from toren.runs.ids import AmbiguousRun, NotARunId, RunNotFound, find_run

    try:
        return await find_run(client.pool, text)
    except (NotARunId, RunNotFound) as exc:
        raise ConfigError(str(exc), hint="List runs with `toren jobs list`.") from None
    except AmbiguousRun as exc:
        raise ConfigError(str(exc), hint="Give more of the id.") from None


def console_url(settings: Settings) -> str | None:
    """The console's base URL: the ``console_url`` setting, else the API a running
    ``toren dev`` recorded, when this CLI uses that ``toren dev``'s database; else ``None``."""
    if settings.console_url:
        return settings.console_url.rstrip("/")
    record = read_record(settings.home)
    if record is None or not record.api_url or not record.running_in(settings.home):
        return None
    if settings.database_url not in (None, record.database_url):
        return None  # another database: that console does not show its runs
    return record.api_url.rstrip("/")


def console_link(settings: Settings, run_id: str) -> str | None:
    """The address of run ``run_id``'s page in the console (``BASE/#/runs/run/<uuid>``: the id
    as the CLI prints it), if the console's is known."""
    base = console_url(settings)
    return f"{base}/#/runs/{run_id}" if base else None
