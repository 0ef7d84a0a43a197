"""``toren jobs restore``: a pruned run shown from its archive, or written back as a live run."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

import click

from toren._cli.common import database_url, out, run_async, toren_command
from toren._core.errors import ConfigError
from toren._core.terminal import plain

if TYPE_CHECKING:
    from toren._core.client import Client
    from toren._core.journal import JournalEntry
    from toren._settings import Settings
    from toren.runs import RunState


def add_restore(jobs: click.Group) -> None:
    """Add ``restore`` to the ``toren jobs`` group."""

    @jobs.command("restore")
    @click.argument("run_id")
    @click.option(
        "--into-journal",
        is_flag=True,
        help="Write the run back into the database (its row and journal, ended as it was), "
        "so that it can be forked; without it, nothing is written.",
    )
    @click.option("--json", "as_json", is_flag=True, help="Print the run and its events as JSON.")
    @click.pass_context
    @run_async
    async def jobs_restore(
        ctx: click.Context, run_id: str, into_journal: bool, as_json: bool
    ) -> None:
        """Show a pruned run from its archive.

        Its timeline and receipt as `toren jobs show` gave them before it was pruned, read
        from the archive store (`archive_store`), checked against its audit record's checksum
        and folded by the run's own fold. Read-only: nothing is written, unless
        --into-journal. A damaged or missing archive is an error
        naming what is wrong (exit 1); a run that was not pruned, or pruned without an
        archive, exits 2."""
        from toren._core.archive import open_archive_store
        from toren.runs.restore import NotRestorable, restore_into_journal, restored_run

        settings: Settings = ctx.obj["settings"]
        run_id = _whole_id(run_id)
        client = await _client(settings)
        store = open_archive_store(settings)
        try:
            if into_journal:
                state = await restore_into_journal(client, run_id, store=store)
                events = None
            else:
                state, events = await restored_run(client, run_id, store=store)
        except NotRestorable as exc:
            why = f"run {run_id} cannot be restored: {exc.why}"
            raise ConfigError(why, hint=exc.hint) from None
        finally:
            await store.close()
            await client.close()
        if events is None:
            _print_written(run_id, state, as_json)
        else:
            _print_restored(run_id, state, events, as_json)


def _whole_id(text: str) -> str:
    """The run id ``text`` gives in whole (``run/<uuid>`` or the uuid): a pruned run has no
    row to find a prefix in."""
    from toren.runs.ids import NotARunId, id_range

    try:
        _, lowest, highest = id_range(text)
    except NotARunId as exc:
        raise ConfigError(str(exc), hint="Give the run's whole id, run/<uuid>.") from None
    if lowest != highest:
        raise ConfigError(
            f"{text!r} is a part of a run id; a pruned run is named by its whole id",
            hint="Give the run's whole id, run/<uuid> (as its audit record shows it).",
        )
    return lowest


async def _client(settings: Settings) -> Client:
    from toren._core.client import Client

    return await Client.connect(database_url(settings), pool_size=2)


def _print_restored(
    run_id: str, state: RunState, events: list[JournalEntry], as_json: bool
) -> None:
    from toren._cli.receipts import receipt_line
    from toren._cli.timeline import describe, event_record, record
    from toren.runs.receipt import receipt

    if as_json:
        shown = record(run_id, state) | {
            "restored": True,
            "events": [event_record(e) for e in events],
        }
        click.echo(json.dumps(shown, indent=2, ensure_ascii=True))
        return
    out.print(plain(f"restored from its archive (read-only): {len(events)} events"))
    for entry in events:
        out.print(plain(f"{entry.seq:>4}  {describe(entry.type, entry.data)}"))
    if state.parent:
        out.print(plain(f"\nstarted by run {state.parent} (a cross-agent call)"))
    for call_id, child in state.children.items():
        ended = state.finished.get(child.run_id)
        how = f"{ended.status}, ${ended.usd_paid}" if ended else "running"
        out.print(plain(f"child run {child.run_id}: {child.agent}, call {call_id} ({how})"))
    out.print(plain(f"\nstatus {state.status}. {receipt_line(receipt(state))}"))


def _print_written(run_id: str, state: RunState, as_json: bool) -> None:
    if as_json:
        click.echo(json.dumps({"id": run_id, "status": state.status, "restored": "journal"}))
        return
    out.print(plain(f"{run_id} is back in the journal ({state.status})"))
    out.print(plain(f"  show it: {toren_command()} jobs show {run_id}"))
    out.print(plain(f"  fork it: {toren_command()} jobs fork {run_id} --at STEP"))
