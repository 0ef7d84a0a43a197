"""The ``toren`` command line.

Exit codes: 0 success; 1 a Toren error at run time (database unreachable, unknown actor, ...);
2 bad usage or configuration (click's own usage errors use 2 as well).

The CLI talks to Postgres directly: ``TOREN_DATABASE_URL``, else the URL a running ``toren dev``
recorded under ``~/.toren/``.
"""

from __future__ import annotations

import functools
import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click
from rich.table import Table

from toren._cli.common import Unshown, database_url, out, print_error, run_async, run_reporting
from toren._cli.init import register as register_init_command
from toren._cli.serve import register as register_serve_commands
from toren._cli.up import register as register_up_command
from toren._cli.versions import register_agents as register_version_commands
from toren._core.errors import ConfigError
from toren._core.killpoints import arm as arm_kill_points
from toren._core.logs import LEVELS, configure
from toren._core.secret_files import read_secret_files
from toren._core.surfaces import resolved
from toren._core.terminal import plain
from toren._settings import Settings
from toren._surfaces.kinds import SURFACES

if TYPE_CHECKING:
    from toren._agent.tables import ConsentFinding

# Each command imports what it uses in its body, not here: every command (`--help` too) imports
# this module and those its commands are defined in, and should not pay for the others' needs.


def _settings(ctx: click.Context) -> Settings:
    settings: Settings = ctx.obj["settings"]
    return settings


@click.group()
@click.option("--config", type=click.Path(dir_okay=False, path_type=Path), help="TOML settings.")
@click.option(
    "--log-level",
    envvar="TOREN_LOG_LEVEL",
    type=Unshown(click.Choice(LEVELS, case_sensitive=False), f"one of {', '.join(LEVELS)}"),
    help="Log every library from this level. Default: Toren's own logs from INFO, other "
    "libraries' from WARNING.",
)
@click.version_option(package_name="toren")
@click.pass_context
def main(ctx: click.Context, config: Path | None, log_level: str | None) -> None:
    """Toren: a durable runtime for LLM agents on Postgres."""
    configure(log_level)
    try:
        if "TOREN_LOG_LEVEL" in read_secret_files() and log_level is None:  # X_FILE -> X
            configure(_level_from_file(os.environ["TOREN_LOG_LEVEL"]))
        ctx.obj = {"settings": Settings.load(config_file=config)}
    except ConfigError as exc:
        print_error(exc)
        sys.exit(2)


def _level_from_file(level: str) -> str:
    """TOREN_LOG_LEVEL as TOREN_LOG_LEVEL_FILE gave it (read after --log-level was parsed)."""
    if level.strip().upper() not in LEVELS:
        raise ConfigError(
            "TOREN_LOG_LEVEL_FILE does not hold a log level",
            hint=f"Use one of {', '.join(LEVELS)}.",
        )
    return level.strip()


@main.command()
@click.pass_context
@run_async
async def migrate(ctx: click.Context) -> None:
    """Bring the database schema up to date. Safe to run from several processes at once."""
    from toren._core.db import connect
    from toren._core.migrate import migrate as apply_migrations

    url = database_url(_settings(ctx))
    conn = await connect(url)
    try:
        applied = await apply_migrations(conn)
    finally:
        await conn.close()
    out.print(f"applied {len(applied)} migration(s)" if applied else "schema is up to date")


@main.command()
@click.option("--app", envvar="TOREN_APP", help="Module defining your actors (MODULE[:ATTR]).")
@click.option("--migrate/--no-migrate", default=False, help="Apply migrations first.")
@click.option("--max-actors", type=int, help="Cap on actors run at once by this worker.")
@click.option("--lease-seconds", type=float, help="Lease length (default 15).")
@click.option("--renew-seconds", type=float, help="Lease renewal interval (default 5).")
@click.option("--poll-seconds", type=float, help="Polling fallback interval (default 1).")
@click.option("--grace-seconds", type=float, help="Shutdown grace period (default 30).")
@click.option("--deploy-label", help="Added to the version shown by `toren workers`.")
@click.pass_context
@run_async
async def worker(ctx: click.Context, /, app: str | None, migrate: bool, **overrides: Any) -> None:
    """Run a worker until SIGTERM. It claims actors with mail and runs them."""
    from toren._cli.boot import boot_app
    from toren.supervisors.worker import run_worker  # the entry point that boots a worker

    try:
        arm_kill_points()
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
    settings = Settings.load(
        config_file=ctx.parent.params.get("config") if ctx.parent else None, **overrides
    )
    boot_app(app, settings)
    await run_worker(settings, database_url(settings), migrate=migrate)


@main.command()
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
@click.pass_context
@run_async
async def workers(ctx: click.Context, as_json: bool) -> None:
    """List live workers with their versions and statistics. Then the agent versions that
    still have runs not ended, flagged when no live worker serves one (its runs are parked)."""
    from toren._cli.versions import version_lines
    from toren._core.db import connect
    from toren._core.workers import live_workers
    from toren.runs.version_listing import agent_versions

    conn = await connect(database_url(_settings(ctx)))
    try:
        rows = await live_workers(conn)
        found = [] if as_json else await agent_versions(conn)
    finally:
        await conn.close()
    items = [
        {
            "worker_id": str(r["worker_id"]),
            "name": r["name"],
            "version": r["version"],
            "deploy_label": r["deploy_label"],
            "agents": {  # each agent it serves: its version and policy
                name: {k: card.get(k) for k in ("version", "version_policy")}
                for name, card in (r["stats"].get("agents") or {}).items()
                if isinstance(card, dict)
            },
            "host": r["host"],
            "pid": r["pid"],
            "started_at": r["started_at"].isoformat(),
            "heartbeat_at": r["heartbeat_at"].isoformat(),
            "leases": r["leases"],
            "actors_in_memory": r["stats"].get("actors_in_memory", 0),
            "rss_mb": round(r["stats"].get("rss_bytes", 0) / 2**20, 1),
        }
        for r in rows
    ]
    if as_json:
        click.echo(json.dumps(items, indent=2, ensure_ascii=True))  # escaped: inert
        return
    versions = {i["version"] for i in items}
    table = Table(title=f"{len(items)} live worker(s)")
    for col in ("worker", "name", "version", "pid", "leases", "in memory", "RSS MB", "heartbeat"):
        table.add_column(col)
    for i in items:
        table.add_row(
            i["worker_id"][:8],
            plain(i["name"]),
            plain(i["version"]),
            str(i["pid"]),
            str(i["leases"]),
            str(i["actors_in_memory"]),
            str(i["rss_mb"]),
            i["heartbeat_at"][11:19],
        )
    out.print(table)
    if len(versions) > 1:
        out.print(plain("version skew:", style="yellow"), plain(", ".join(sorted(versions))))
    lines = version_lines(found)
    if lines:
        out.print(plain("agent versions with runs not ended:"))
        for line in lines:
            out.print(plain(line, style="red" if "NO LIVE WORKER" in line else ""))


@main.group(invoke_without_command=True)
@click.option("--actor", help="Only this actor's dead letters.")
@click.option("--limit", default=50, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
@click.pass_context
def deadletters(ctx: click.Context, actor: str | None, limit: int, as_json: bool) -> None:
    """List dead-lettered messages. Requeue them with `toren deadletters requeue ID...`."""
    if ctx.invoked_subcommand is None:
        _list_deadletters(ctx, actor, limit, as_json)


@run_async
async def _list_deadletters(
    ctx: click.Context, actor: str | None, limit: int, as_json: bool
) -> None:
    from toren._core.client import Client

    async with await Client.connect(database_url(_settings(ctx)), pool_size=1) as client:
        items = await client.deadletters(actor_id=actor, limit=limit)
    if as_json:
        click.echo(  # escaped JSON (rich's print_json would write controls back raw)
            json.dumps(
                [
                    {
                        "id": d.id,
                        "actor_id": d.actor_id,
                        "sender": d.sender,
                        "kind": d.kind,
                        "body": d.body,
                        "deliveries": d.deliveries,
                        "attempts": d.attempts,
                        "error": d.error,
                        "dead_at": d.dead_at.isoformat(),
                    }
                    for d in items
                ],
                indent=2,
                ensure_ascii=True,
                default=str,
            )
        )
        return
    table = Table(title=f"{len(items)} dead letter(s)")
    for col in ("id", "actor", "kind", "attempts", "deliveries", "error", "dead at"):
        table.add_column(col)
    for d in items:
        table.add_row(
            str(d.id),
            plain(d.actor_id),
            plain(d.kind),
            str(d.attempts),
            str(d.deliveries),
            plain(d.error[:60]),
            d.dead_at.isoformat(timespec="seconds"),
        )
    out.print(table)


@deadletters.command("requeue")
@click.argument("ids", nargs=-1, type=int, required=True)
@click.pass_context
@run_async
async def requeue(ctx: click.Context, ids: tuple[int, ...]) -> None:
    """Put dead letters back in their mailboxes. Each goes at the end, with fresh counts."""
    from toren._core.client import Client

    async with await Client.connect(database_url(_settings(ctx)), pool_size=1) as client:
        new_ids = await client.requeue(list(ids))
    missing = len(ids) - len(new_ids)
    out.print(f"requeued {len(new_ids)} message(s)" + (f"; {missing} not found" if missing else ""))
    if missing and not new_ids:
        sys.exit(1)


register_init_command(main)
for register_kind_commands in resolved(SURFACES, "cli"):  # run and jobs, sandboxes, channels
    register_kind_commands(main)
register_serve_commands(main)
register_up_command(main)


@main.group()
def agents() -> None:
    """Inspect agents: their tools and versions."""


register_version_commands(agents)


@agents.command("check")
@click.option("--app", envvar="TOREN_APP", required=True, help="Module defining your agents.")
@click.option(
    "--strict",
    is_flag=True,
    help="Exit 1 on any flagged tool, one-sided or unknown consent, or table for no agent here.",
)
@click.pass_context
def agents_check(ctx: click.Context, app: str, strict: bool) -> None:
    """List every tool with its declarations, and what to check. Tools that are external,
    unkeyed and need no approval are flagged; cross-agent consent declared on one side only and
    the [agents.NAME] tables of the settings file are listed too.

    Exit 0; 1 for a self-call, and with --strict for any finding; 2 for a configuration error.
    """
    from toren._agent.agents import check
    from toren._agent.app import load_app, loaded_agents
    from toren._agent.tables import consent_findings, unloaded_tables

    settings = _settings(ctx)
    try:
        module = load_app(app, settings)
    except ConfigError as exc:
        print_error(exc)
        sys.exit(2)
    loaded = loaded_agents(module)
    findings = check(loaded)
    table = Table(title=f"{len(findings)} tool(s)")
    for col in ("agent", "tool", "effects", "idempotency", "approval", ""):
        table.add_column(col)
    for f in findings:
        mark = "[red]FLAG: external, unkeyed, no approval[/red]" if f.flagged else ""
        table.add_row(plain(f.agent), plain(f.tool), f.effects, f.idempotency, f.approval, mark)
    out.print(table)
    flagged = [f for f in findings if f.flagged]
    if flagged:
        out.print(
            f"[yellow]{len(flagged)} flagged:[/yellow] a crash between the effect and its record "
            "repeats it. Make the tool keyed or require approval."
        )
    consent = consent_findings(loaded)
    unloaded = unloaded_tables(settings.agents, (a.name for a in loaded))
    _print_consent(consent)
    _print_agent_tables(settings, {a.name for a in loaded})
    if any(f.error for f in consent) or (strict and (flagged or consent or unloaded)):
        sys.exit(1)


def _print_consent(findings: list[ConsentFinding]) -> None:
    if not findings:
        out.print("cross-agent consent: no one-sided declaration among the agents loaded here")
        return
    out.print(f"cross-agent consent: {len(findings)} finding(s)")
    for f in findings:
        label = plain("ERROR", style="red") if f.error else plain("WARN", style="yellow")
        out.print(label, plain(f.message))


def _print_agent_tables(settings: Settings, loaded: set[str]) -> None:
    source = str(settings.config_file) if settings.config_file else "no settings file"
    if not settings.agents:
        out.print(plain(f"settings: no [agents.NAME] table ({source})"))
        return
    out.print(plain(f"settings: {len(settings.agents)} [agents.NAME] table(s) in {source}"))
    for name, keys in sorted(settings.agents.items()):
        if name in loaded:
            out.print(plain(f"  [agents.{name}] applied: {', '.join(sorted(keys))}"))
        else:
            out.print(
                plain(f"  [agents.{name}] no such agent loaded here", style="yellow"),
                plain("(a worker loading another app may use it)"),
            )


@main.command()
@click.option(
    "--data-dir",
    type=click.Path(file_okay=False, path_type=Path),
    help="Embedded Postgres data directory (default ~/.toren/pgdata).",
)
@click.option("--app", envvar="TOREN_APP", help="Module defining your actors (MODULE[:ATTR]).")
@click.option(
    "--port", default=8420, show_default=True, type=click.IntRange(0, 65535), help="API port."
)
@click.option(
    "--model-script",
    metavar="MODULE:FN",
    help="Run the --app's agents on an OFFLINE model scripted by FN (see toren.testing).",
)
@click.pass_context
def dev(
    ctx: click.Context, data_dir: Path | None, app: str | None, port: int, model_script: str | None
) -> None:
    """Run everything on one machine, Postgres included. It starts an embedded Postgres,
    applies the migrations and runs a worker, the HTTP API and console, and the demo.

    Ctrl-C stops it: exit 0 once it was up (the worker drains), 130 while it was starting; 1 if
    another `toren dev` runs on this TOREN_HOME or data directory (it says where)."""
    from toren._cli.dev import INTERRUPTED, run_dev

    if model_script and not app:
        raise click.UsageError("--model-script scripts the model of an --app's agents; add --app")
    settings = _settings(ctx)
    try:
        arm_kill_points()  # the `dev.*` points: tests interrupt it at a given moment
    except ValueError as exc:
        print_error(ConfigError(str(exc)))
        sys.exit(2)
    try:
        status = run_reporting(
            functools.partial(
                run_dev, settings, data_dir=data_dir, app=app, port=port, model_script=model_script
            )
        )
    except* KeyboardInterrupt:  # a second Ctrl-C while stopping: what was started is stopped
        status = INTERRUPTED  # at exit by its own handlers (pgserver's atexit)
    sys.exit(status)
