"""``toren jobs prune [--agent A] [--dry-run] [--stats]`` and ``toren costs``: pruning ended runs
now, what it removed, the database's table sizes, and what runs cost (pruned or not).

The policies are read from the agent cards live workers publish (``Agent(retention=...)`` and
``[agents.NAME.retention]`` as each worker has them), so the CLI needs no app. Exit codes: 0
done; 1 a Toren error at run time; 2 bad input or configuration (an agent with no published
policy named with ``--agent``, a bad ``--since``).
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import TYPE_CHECKING, Any

import click
from rich.table import Table

from toren._cli.common import database_url, out, run_async
from toren._core.errors import ConfigError
from toren._core.terminal import plain

if TYPE_CHECKING:
    from toren._core.client import Client
    from toren._settings import Settings
    from toren.runs.audit import AuditRecord

# What the commands use (the client, the prune, the costs) is imported in their bodies:
# `toren --help` imports this module to describe its commands.

SHOWN = 20
"""Runs a dry run lists by id, per agent (the count covers them all)."""

DRY_RUN_LIMIT = 10_000
"""Trees a dry run looks at per agent at most."""


async def _client(settings: Settings) -> Client:
    from toren._core.client import Client

    return await Client.connect(database_url(settings), pool_size=2)


def _day(text: str | None, option: str) -> datetime | None:
    """``--since``/``--until``: an ISO-8601 date (``2026-12-01``, UTC) or date and time."""
    if text is None:
        return None
    from datetime import UTC

    try:
        moment = datetime.fromisoformat(text)
        # in UTC, as Postgres takes it: an offset can push year 1 or 9999 past its range
        return moment.astimezone(UTC) if moment.tzinfo is not None else moment.replace(tzinfo=UTC)
    except (ValueError, OverflowError):
        raise ConfigError(
            f"--{option}: {text!r} is not an ISO-8601 date (years 1 to 9999, UTC)",
            hint="Write it like 2026-12-01.",
        ) from None


async def _policies(client: Client, agent: str | None) -> dict[str, Any]:
    """The retention policy each agent's newest published card gives, by agent."""
    from toren._agent.retention import Retention
    from toren._core.workers import newest_cards

    found: dict[str, Any] = {}
    for name, card in (await newest_cards(client.pool)).items():
        value = card.get("retention") if isinstance(card, dict) else None
        if isinstance(value, dict) and (agent is None or name == agent):
            try:
                found[name] = Retention.from_json(value)
            except (ConfigError, TypeError):
                continue  # a card of a later release: not this CLI's to read
    if agent is not None and agent not in found:
        raise ConfigError(
            f"no live worker publishes a retention policy for agent {agent!r}",
            hint="Give it Agent(retention=...) or [agents.NAME.retention] and start a worker.",
        )
    return found


def register(main: click.Group) -> None:
    """Add ``jobs prune`` (to ``toren jobs``) and ``costs`` to the ``toren`` command group."""
    jobs = main.commands.get("jobs")
    if not isinstance(jobs, click.Group):  # the run kind's commands come first
        raise ConfigError("toren jobs is not registered: the retention kind comes after runs")

    @jobs.command("prune")
    @click.option("--agent", help="Only this agent's runs.")
    @click.option("--dry-run", is_flag=True, help="Say what would be pruned; delete nothing.")
    @click.option(
        "--stats", is_flag=True, help="Show the tables' sizes and what the last prunes removed."
    )
    @click.pass_context
    @run_async
    async def jobs_prune(ctx: click.Context, agent: str | None, dry_run: bool, stats: bool) -> None:
        """Prune ended runs now, as retention policies say. Batch after batch, each under
        prune_lock_timeout, as each agent's policy says; an audit record stays of each run."""
        settings: Settings = ctx.obj["settings"]
        client = await _client(settings)
        try:
            if stats:
                await _stats(client)
                return
            policies = await _policies(client, agent)
            if not policies:
                out.print(plain("no live worker publishes a retention policy: nothing to prune"))
                return
            for name, policy in sorted(policies.items()):
                if dry_run:
                    await _dry(client, name, policy)
                else:
                    await _prune(client, settings, name, policy)
        finally:
            await client.close()

    @main.command("costs")
    @click.option(
        "--by", default="agent", show_default=True, help="agent, day, or agent,day (or none: '')."
    )
    @click.option("--since", help="Runs started on or after this date (UTC), e.g. 2026-12-01.")
    @click.option("--until", help="Runs started before this date (UTC).")
    @click.option("--json", "as_json", is_flag=True, help="Print the rows as JSON.")
    @click.pass_context
    @run_async
    async def costs_command(
        ctx: click.Context, by: str, since: str | None, until: str | None, as_json: bool
    ) -> None:
        """What runs cost, by agent and day. Live and pruned runs alike, dollars exact."""
        from toren.runs.costs import InvalidCosts, costs, groups

        try:
            grouping = groups(by)
        except InvalidCosts as exc:
            raise ConfigError(str(exc)) from None
        start, end = _day(since, "since"), _day(until, "until")
        client = await _client(ctx.obj["settings"])
        try:
            rows = await costs(client.pool, grouping, since=start, until=end)
        finally:
            await client.close()
        if as_json:
            click.echo(json.dumps({"costs": [r.to_json() for r in rows]}, indent=2))
            return
        table = Table(show_edge=False)
        for column in [*grouping, "runs", "pruned", "calls", "tokens in", "tokens out", "usd"]:
            table.add_column(column, justify="left" if column in ("agent", "day") else "right")
        for r in rows:
            keys = [r.agent or "" if g == "agent" else str(r.day or "") for g in grouping]
            table.add_row(
                *map(plain, keys),
                str(r.runs),
                str(r.pruned),
                str(r.calls_made),
                str(r.input_tokens),
                str(r.output_tokens),
                f"${r.usd_paid}",
            )
        out.print(table)


async def _dry(client: Client, agent: str, policy: Any) -> None:
    from toren.runs.prune import candidates

    trees = await candidates(client.pool, agent, policy, batch=DRY_RUN_LIMIT)
    runs = sum(k == "toren.run" for t in trees for k in t.kinds)
    more = "+" if len(trees) == DRY_RUN_LIMIT else ""
    out.print(plain(f"{agent}: {runs}{more} runs in {len(trees)}{more} trees would be pruned"))
    for tree in trees[:SHOWN]:
        ended = tree.ended_at.isoformat(timespec="seconds")
        out.print(plain(f"  {tree.root}  {tree.status}, ended {ended}"))
    if len(trees) > SHOWN:
        out.print(plain(f"  ... and {len(trees) - SHOWN} more"))


async def _prune(client: Client, settings: Settings, agent: str, policy: Any) -> None:
    from toren.runs.prune import prune_batch

    store = None
    if policy.archive:
        url = getattr(settings, "archive_store", None)
        if not url:  # as the pruner: the default under home is not a store every worker shares
            out.print(
                plain(
                    f"{agent}: not pruned: its retention archives journals (archive = true) "
                    "and archive_store is not set (TOREN_ARCHIVE_STORE)"
                )
            )
            return
        from toren._core.stores import store_from_url

        store = store_from_url(url, setting="archive_store")
    runs = events = size = archived = skipped = 0
    after = None
    try:
        while True:
            result = await prune_batch(
                client.pool,
                agent,
                policy,
                batch=settings.prune_batch,
                lock_timeout=settings.prune_lock_timeout,
                store=store,
                after=after,
            )
            runs, events, size = runs + result.runs, events + result.events, size + result.bytes
            archived, skipped = archived + result.archived, skipped + result.skipped
            if result.found < settings.prune_batch:
                break
            after = result.last  # past the trees pruned or left (some may be for good)
    finally:
        if store is not None:
            await store.close()
    out.print(
        plain(
            f"{agent}: pruned {runs} runs ({events} events, about {size} bytes; "
            f"{archived} archived)" + (f"; {skipped} left for later" if skipped else "")
        )
    )


async def _stats(client: Client) -> None:
    from toren._core.pruning import table_sizes
    from toren.runs.audit import last_prunes

    sizes = await table_sizes(client.pool)
    table = Table(show_edge=False)
    table.add_column("table")
    table.add_column("bytes", justify="right")
    for name, size in sorted(sizes.items(), key=lambda kv: -kv[1]):
        table.add_row(plain(f"toren.{name}"), f"{size:,}")
    out.print(table)
    prunes = await last_prunes(client.pool)
    if not prunes:
        out.print(plain("no prune has removed anything yet"))
    for p in prunes:
        out.print(
            plain(
                f"last prune of {p['agent']}: {p['at'].isoformat(timespec='seconds')}, "
                f"{p['runs']} runs, {p['events']} events, about {p['bytes']} bytes, "
                f"{p['archived']} archived, in {p['took']:.3f}s"
            )
        )


def pruned_lines(record: AuditRecord) -> list[str]:
    """How ``toren jobs show`` shows a pruned run: from its audit record."""
    r = record.receipt
    when = record.pruned_at.date().isoformat() if record.pruned_at else "?"
    lines = [f"journal pruned on {when}: {record.events} events; its audit record:"]
    by = record.started_by or {}
    lines.append(
        f"  agent {record.agent} (version {record.version or '?'}), started "
        f"{record.created_at.isoformat(timespec='seconds')} by {by.get('name', '?')} "
        f"via {by.get('via', '?')}"
    )
    if record.parent:
        lines.append(f"  started by run {record.parent} (a cross-agent call)")
    for d in record.decisions:
        verdict = "approved" if d.get("approved") else "denied"
        lines.append(
            f"  call {d.get('call_id')} ({d.get('tool')}): {verdict} by {d.get('who')} via "
            f"{d.get('channel')}" + (f": {d.get('reason')}" if d.get("reason") else "")
        )
    where = record.archive.location if record.archive is not None else None
    lines.append(f"  archive: {where}" if where else "  archive: none (not archived)")
    error = f" ({record.error_class}: {record.error})" if record.error_class else ""
    lines.append(
        f"\nstatus {record.status}{error}. receipt: {r.get('calls_made')} calls made, "
        f"{r.get('calls_replayed')} replayed; {r.get('input_tokens')} in / "
        f"{r.get('output_tokens')} out tokens; ${r.get('usd_paid')} paid, "
        f"${r.get('usd_not_repaid')} not re-paid"
    )
    return lines


async def show_pruned(client: Client, run_id: str, as_json: bool) -> bool:
    """Show pruned run ``run_id`` from its audit record, as ``toren jobs show`` does; ``False``
    (nothing shown) if it was not pruned."""
    from toren.runs.audit import audit_record

    record = await audit_record(client.pool, run_id)
    if record is None:
        return False
    if as_json:
        shown = {"id": run_id, "pruned": True, **record.to_json()}
        click.echo(json.dumps(shown, indent=2, ensure_ascii=True))
        return True
    for line in pruned_lines(record):
        out.print(plain(line))
    return True
