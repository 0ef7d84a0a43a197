"""``toren jobs fork``: a new run from a step of another, its prefix replayed by value."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

import click

from toren._cli.common import database_url, err, out, run_async
from toren._cli.run_ids import console_link, resolve
from toren._core.errors import ConfigError
from toren._core.terminal import plain

if TYPE_CHECKING:
    from toren._core.client import Client
    from toren._settings import Settings
    from toren.runs.forked import ForkedFrom

# The highest step a fork may name: a bound, so that 2**70 is a usage error, not an overflow.
STEP_MAX = 2**31 - 1


def add_fork(jobs: click.Group) -> None:
    """Add ``fork`` to the ``toren jobs`` group."""

    @jobs.command("fork")
    @click.argument("run_id")
    @click.option(
        "--at",
        "step",
        required=True,
        type=click.IntRange(min=1, max=STEP_MAX),
        help="The step to go back to: model call STEP (as `toren jobs show` numbers them) is "
        "made again; the calls before it are replayed from RUN's journal, not paid again.",
    )
    @click.option(
        "--upgrade",
        is_flag=True,
        help="Run the rest on the agent's current version (without it, on RUN's).",
    )
    @click.option(
        "--message",
        help="Replace the last human message before STEP with this text.",
    )
    @click.option("--input", "new_input", help="Start from this input instead of RUN's.")
    @click.option(
        "--json", "as_json", is_flag=True, help="Print the new run and its origin as JSON."
    )
    @click.pass_context
    @run_async
    async def jobs_fork(
        ctx: click.Context,
        run_id: str,
        step: int,
        upgrade: bool,
        message: str | None,
        new_input: str | None,
        as_json: bool,
    ) -> None:
        """A new run from step STEP of RUN.

        What RUN did before the step is copied and replayed free; the step and what follows
        run live. RUN is left as it is. Prints the new run's id (with --json, its origin and
        what was replayed). Tool calls after the step run again and ask their approvals
        again."""
        if message is not None and new_input is not None:
            raise click.UsageError("give --message or --input, not both", ctx=ctx)
        settings: Settings = ctx.obj["settings"]
        client = await _client(settings)
        try:
            source = await resolve(client, run_id)
            forked = await _fork(
                client,
                source,
                step,
                upgrade=upgrade,
                message=message,
                new_input=new_input,
                cap=settings.max_message_bytes,
            )
            made = await origin(client, forked)
        finally:
            await client.close()
        if as_json:
            shown = {"id": forked, "forked_from": made.to_json() if made else None}
            click.echo(json.dumps(shown, indent=2, ensure_ascii=True))
            return
        out.print(plain(forked))
        if made is not None:  # on stderr: `RUN=$(toren jobs fork ...)` gets the id alone
            err.print(plain(made.line()))
        link = console_link(settings, forked)
        if link:
            err.print(plain(f"console: {link}"))


async def _client(settings: Settings) -> Client:
    from toren._core.client import Client

    return await Client.connect(database_url(settings), pool_size=2)


async def _fork(
    client: Client,
    source: str,
    step: int,
    *,
    upgrade: bool,
    message: str | None,
    new_input: str | None,
    cap: int,
) -> str:
    """Fork ``source`` at ``step``; a fork it refuses is a usage error (exit 2, nothing stored).

    Raises:
        ConfigError: the fork is refused (the step, the text), or ``source`` is gone.
    """
    from toren._agent.principal import Principal
    from toren._core.errors import UnknownActor
    from toren.runs.fork import InvalidFork, fork_run

    try:
        return await fork_run(
            client,
            source,
            at=step,
            upgrade=upgrade,
            message=message,
            input=new_input,
            by=Principal.os_user("cli"),  # as every write of the CLI (toren._cli.runs.who)
            cap=cap,
        )
    except InvalidFork as exc:
        raise ConfigError(
            str(exc), hint=f"See its steps with `toren jobs show {source}`."
        ) from None
    except UnknownActor:
        raise ConfigError(f"no run {source!r}", hint="List runs with `toren jobs list`.") from None


async def origin(client: Client, run_id: str) -> ForkedFrom | None:
    """Where run ``run_id`` was forked from, and what its prefix saved; ``None`` if it is not
    a fork."""
    from toren.runs import read_run
    from toren.runs.forked import forked_from

    return forked_from(await read_run(client, run_id))
