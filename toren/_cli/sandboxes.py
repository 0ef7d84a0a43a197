"""``toren sandboxes list | reap | sweep``: the runs' sandboxes, removing their containers,
deleting the checkpoints nothing names any more; and how ``toren jobs show`` prints a run's
sandboxed calls.

``reap`` sends ``sandbox.reap`` to sandbox actors, as a run does when it ends; a worker with
Docker handles it (removes the container; the workspace's checkpoints stay, so a retried or
continued run gets its files back). ``sweep`` runs the workers' checkpoint sweep now
(:mod:`toren.sandboxes.sweep`). Exit codes: 0 sent (or nothing to send), swept; 1 a run named
has no sandbox, or its sandbox takes no message (nothing is sent then), a sweep is already
running, or another Toren error at run time; 2 configuration.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

import click
from rich.table import Table

from toren._cli.common import database_url, err, out, run_async
from toren._cli.run_ids import resolve
from toren._core.errors import ConfigError
from toren._core.terminal import plain, printable

if TYPE_CHECKING:
    from toren._core.client import Client
    from toren._settings import Settings
    from toren.sandboxes.listing import SandboxedCall, SandboxRow

OUTPUT_LINES = 5
"""Lines of a call's output ``toren jobs show`` prints (``--json`` has all of it)."""
LINE_WIDTH = 160


def size(n: int) -> str:
    """Bytes for people: ``512 B``, ``1.5 KiB``, ``3.0 MiB``."""
    if n < 1024:
        return f"{n} B"
    value, unit = n / 1024, "KiB"
    for bigger in ("MiB", "GiB"):
        if value < 1024:
            break
        value, unit = value / 1024, bigger
    return f"{value:.1f} {unit}"


def short(checkpoint: str | None) -> str:
    return checkpoint[:12] if checkpoint else "-"


def described(row: SandboxRow) -> str:
    """One line about a sandbox (``toren jobs show``)."""
    container = row.name or (row.container_id or "")[:12] or "no container"
    return (
        f"sandbox {row.id}: {row.status}, {container}, {row.commands} command(s), checkpoint "
        f"{short(row.checkpoint)} ({row.checkpoints} made, {size(row.uploaded_bytes)} uploaded)"
        + ("" if row.live else "; the kernel gave up on it")
    )


def call_lines(calls: list[SandboxedCall], run_id: str) -> list[str]:
    """How ``toren jobs show`` prints a run's sandboxed calls: a line per call (the tool, the
    command or path, where, how it ended, how long), then the first lines of its output, each
    behind ``|`` so that no output can pass for a line of Toren's. Every line is
    :func:`~toren._core.terminal.printable`."""
    lines = []
    for call in calls:
        what = f"$ {call.command}" if call.command is not None else (call.path or "")
        facts = [f"in {call.cwd}", call.outcome]
        if call.seconds is not None:
            facts.append(f"{call.seconds:.2f} s")
        head = f"  {call.call_id}  {call.tool}  {what}  ({'; '.join(facts)})"
        lines.append(_cut(printable(head).replace("\n", "\\n"), LINE_WIDTH * 2))
        output = printable(call.output).split("\n") if call.output else []
        if output and output[-1] == "":
            output.pop()  # the newline that ends the last line
        lines.extend(f"      | {_cut(line, LINE_WIDTH)}" for line in output[:OUTPUT_LINES])
        if len(output) > OUTPUT_LINES:
            lines.append(
                f"      ... {len(output) - OUTPUT_LINES} more line(s) "
                f"(all of them: toren jobs show {run_id} --json)"
            )
        if call.truncated_from:
            lines.append(f"      (the run cut this result: it was {call.truncated_from} bytes)")
    return lines


def _cut(line: str, width: int) -> str:
    return line if len(line) <= width else line[: width - 3] + "..."


def register(main: click.Group) -> None:
    """Add ``sandboxes`` to the ``toren`` command group."""

    @main.group()
    def sandboxes() -> None:
        """List the runs' sandboxes; reap (remove) their containers."""

    @sandboxes.command("list")
    @click.option("--all", "everything", is_flag=True, help="Reaped sandboxes too.")
    @click.option("--limit", default=200, show_default=True, type=click.IntRange(1, 100_000))
    @click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
    @click.pass_context
    @run_async
    async def list_cmd(ctx: click.Context, everything: bool, limit: int, as_json: bool) -> None:
        """Sandboxes, newest first. By default those whose container may exist (not reaped)."""
        from toren.sandboxes.listing import list_sandboxes

        async with await _client(ctx.obj["settings"]) as client:
            rows = await list_sandboxes(client.pool, reaped=everything, limit=limit)
        if as_json:
            click.echo(json.dumps([r.to_json() for r in rows], indent=2, ensure_ascii=True))
            return
        which = "" if everything else " whose container may exist"
        table = Table(title=f"{len(rows)} sandbox(es){which}")
        for col in ("run", "agent", "run status", "sandbox", "container", "commands"):
            table.add_column(col)
        table.add_column("checkpoint")
        table.add_column("uploaded", justify="right")
        for r in rows:
            running = r.commands - r.finished
            table.add_row(
                plain(r.run),
                plain(r.agent),
                plain(r.run_status or "gone"),
                plain(r.status + _aside(r)),
                plain(r.name or (r.container_id or "")[:12] or "-"),
                str(r.commands) + (f" ({running} running)" if running > 0 else ""),
                plain(short(r.checkpoint)),
                size(r.uploaded_bytes),
            )
        out.print(table)

    @sandboxes.command("reap")
    @click.argument("runs", nargs=-1)
    @click.option("--dry-run", is_flag=True, help="Say what would be sent; send nothing.")
    @click.pass_context
    @run_async
    async def reap_cmd(ctx: click.Context, runs: tuple[str, ...], dry_run: bool) -> None:
        """Remove sandbox containers. Without RUNs, those of every ended run (completed or
        failed) not reaped yet; with RUNs, those runs' whatever their status (a forced reap: a
        running run's next command starts a new container from its last checkpoint).

        Exit 0 when sent (or nothing to send); 1 if a RUN has no sandbox, or its sandbox takes
        no message (nothing is sent then)."""
        from toren.sandboxes import Reap
        from toren.sandboxes.listing import reapable

        async with await _client(ctx.obj["settings"]) as client:
            if runs:
                targets = await _named(client, runs)
            else:
                targets = _ended(await reapable(client.pool))
            verb = "would send" if dry_run else "sent"
            for row, note in targets:
                if not dry_run:
                    await client.send(row.id, Reap())
                out.print(plain(f"{verb} reap to {row.id} (run {row.run}, {note})"))
        if not targets:
            every = "every ended run's sandbox is reaped or has a reap queued"
            out.print("nothing sent" if runs else f"nothing to reap: {every}")
        elif dry_run:
            out.print(plain(f"dry run: {len(targets)} sandbox(es) would be reaped; nothing sent"))
        else:
            out.print(
                plain(
                    f"{len(targets)} sandbox(es) told to reap; a worker with Docker removes "
                    "their containers (their checkpoints stay)"
                )
            )

    @sandboxes.command("sweep")
    @click.option("--dry-run", is_flag=True, help="Say what would be deleted; delete nothing.")
    @click.pass_context
    @run_async
    async def sweep_cmd(ctx: click.Context, dry_run: bool) -> None:
        """Delete the checkpoints nothing kept needs.

        From the workspace store: the checkpoints no kept run, fork or sandbox names and that
        were written more than `checkpoint_grace` ago (what the workers' sweep does every
        `checkpoint_sweep_every`). Exit 1 if a worker is sweeping this store now."""
        from toren._core.singletons import singleton
        from toren.sandboxes.files import open_store
        from toren.sandboxes.sweep import lock_name, sweep_checkpoints

        settings = ctx.obj["settings"]
        store = open_store(settings)
        try:
            async with (
                await _client(settings) as client,
                singleton(client.pool, lock_name(store)) as conn,
            ):
                if conn is None:
                    err.print("error: a sweep of this store is running now; try again later")
                    sys.exit(1)
                stats = await sweep_checkpoints(
                    conn, store, grace=settings.checkpoint_grace, dry_run=dry_run
                )
        finally:
            await store.close()
        verb = "would delete" if dry_run else "deleted"
        out.print(
            plain(
                f"{verb} {stats.manifests_deleted} checkpoint(s) and {stats.blobs_deleted} "
                f"blob(s), {size(stats.bytes_deleted)}; {stats.kept} older than the grace "
                f"period kept (a kept actor names them); {stats.manifests} checkpoint(s) and "
                f"{stats.blobs} blob(s) were in the store"
            )
        )
        if stats.blobs_held:
            err.print(
                "a checkpoint's manifest could not be read: no blob was deleted (see the log)"
            )


async def _client(settings: Settings) -> Client:
    from toren._core.client import Client

    return await Client.connect(database_url(settings), pool_size=2)


def _ended(rows: list[SandboxRow]) -> list[tuple[SandboxRow, str]]:
    """The sandboxes of ended runs to send a reap to, each with what to say of it; those the
    kernel gave up on are named and skipped (they take no message)."""
    targets = []
    for row in rows:
        if not row.live:
            err.print(
                plain(
                    f"skipped {row.id} (run {row.run}): the kernel gave up on it and it takes "
                    "no message; the orphan reaper of a worker with Docker removes its container"
                )
            )
            continue
        if not _queued(row):
            targets.append((row, f"{row.run_status or 'gone'}; {_container(row)}"))
    return targets


async def _named(client: Client, names: Sequence[str]) -> list[tuple[SandboxRow, str]]:
    """The sandboxes of the runs named (each by its id, its uuid or a unique prefix), each
    with what to say of it. Every run is checked before anything is sent: one not found, one
    without a sandbox (or whose sandbox takes no message) is an error naming it, and nothing
    is sent (exit 1)."""
    from toren.sandboxes import WORKSPACE
    from toren.sandboxes.listing import sandbox_of

    targets, errors = [], []
    found = []
    for text in names:
        try:
            found.append(await resolve(client, text))
        except ConfigError as exc:
            errors.append(str(exc))
    for run_id in dict.fromkeys(found):
        row = await sandbox_of(client.pool, run_id)
        if row is None:
            errors.append(f"{run_id} has no sandbox (its agent has none, or it ran no command)")
        elif not row.live:
            errors.append(
                f"{run_id}'s sandbox {row.id} takes no message (the kernel gave up on it); the "
                "orphan reaper of a worker with Docker removes its container once the run ended"
            )
        elif row.status == "reaped":
            out.print(plain(f"{row.id} (run {run_id}) is reaped already; nothing to send"))
        elif _queued(row):
            continue
        elif row.run_ended:
            targets.append((row, f"{row.run_status or 'gone'}; {_container(row)}"))
        else:
            targets.append(
                (
                    row,
                    f"{row.run_status}; {_container(row)}; forced: the run has not ended. Its "
                    "container is removed once the command in hand (if any) is done; its next "
                    f"command starts a new one from the last checkpoint (files outside "
                    f"{WORKSPACE} are lost)",
                )
            )
    if errors:
        for error in errors:
            err.print(plain("error:", style="red"), plain(error))
        err.print(plain("nothing was sent"))
        sys.exit(1)
    return targets


def _queued(row: SandboxRow) -> bool:
    """Whether a reap waits in the sandbox's mailbox already (said so if it does): another
    one would only wait behind it."""
    if row.reap_queued:
        out.print(
            plain(
                f"{row.id} (run {row.run}) has a reap queued already, waiting for a worker with "
                "Docker; nothing more to send"
            )
        )
    return row.reap_queued


def _aside(row: SandboxRow) -> str:
    if not row.live:
        return " (given up)"
    return " (reap queued)" if row.reap_queued and row.status != "reaped" else ""


def _container(row: SandboxRow) -> str:
    if row.name:
        return f"container {row.name}"
    return "no container recorded" if row.status == "new" else f"sandbox {row.status}"
