"""``toren agents versions`` and ``toren jobs upgrade``: the agents' versions, the runs pinned
to each, and moving a run to the newest version. ``toren workers`` shows the versions that still
have runs with :func:`version_lines`."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

import click
from rich.table import Table

from toren._cli.common import database_url, out, run_async, toren_command
from toren._cli.run_ids import resolve
from toren._core.terminal import plain

if TYPE_CHECKING:
    from toren._core.client import Client
    from toren.runs.version_listing import AgentVersions

# The runs' and the kernel's modules are imported in the commands' bodies: `toren --help`
# imports this module to describe its commands.


def register_agents(agents: click.Group) -> None:
    """Add ``versions`` to the ``toren agents`` group."""

    @agents.command("versions")
    @click.option("--agent", help="Only this agent's versions.")
    @click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
    @click.pass_context
    @run_async
    async def agents_versions(ctx: click.Context, agent: str | None, as_json: bool) -> None:
        """List each agent's versions with workers and runs. For each: its policy, the live
        workers serving it (with their code version and deploy label), and the runs not ended
        that are pinned to it. A version
        no live worker serves is flagged: its runs are parked until a worker serving it
        starts, or `toren jobs upgrade RUN` moves them to the newest version."""
        from toren._core.client import Client
        from toren.runs.version_listing import agent_versions

        client = await Client.connect(database_url(ctx.obj["settings"]), pool_size=1)
        try:
            found = await agent_versions(client.pool, agent=agent)
        finally:
            await client.close()
        if as_json:  # escaped: inert
            click.echo(json.dumps([a.to_json() for a in found], indent=2, ensure_ascii=True))
            return
        table = Table(title=f"{len(found)} agent(s)")
        for col in ("agent", "version", "policy", "workers", "unfinished runs", ""):
            table.add_column(col)
        for a in found:
            for v in a.versions:
                workers = ", ".join(f"{w.name} ({w.code_version})" for w in v.workers)
                note = "newest" if v.newest else ""
                if not v.served:
                    parked = f": {v.unfinished_runs} run(s) parked" if v.unfinished_runs else ""
                    note = f"[red]NO WORKER{parked}[/red]"
                table.add_row(
                    plain(a.agent),
                    plain(v.version),
                    plain(v.policy or "-"),
                    plain(workers or "-"),
                    str(v.unfinished_runs),
                    note,
                )
            if a.unpinned_runs or not a.versions:
                table.add_row(
                    plain(a.agent), "(not pinned)", "-", "-", str(a.unpinned_runs), "any version"
                )
        out.print(table)
        if any(a.stranded_runs for a in found):
            out.print(
                plain(
                    "Runs on a version no live worker serves are parked: start a worker serving "
                    f"it, or move each with `{toren_command()} jobs upgrade RUN` (list them with "
                    f"`{toren_command()} jobs list --agent AGENT`)."
                )
            )


def version_lines(found: list[AgentVersions]) -> list[str]:
    """``toren workers``' lines for the versions that still have runs not ended."""
    lines = []
    for a in found:
        for v in a.versions:
            if not v.unfinished_runs:
                continue
            who = ", ".join(w.name for w in v.workers)
            served = f"served by {who}" if who else "NO LIVE WORKER serves it: they are parked"
            lines.append(f"  {a.agent}@{v.version}: {v.unfinished_runs} run(s), {served}")
    return lines


async def pinned(
    client: Client, run_id: str, *, check: bool, completed: bool = False
) -> tuple[str | None, str | None]:
    """The version run ``run_id`` is pinned to (from its row's route), and, when ``check`` (it
    has not ended, nor waits for a slot) or ``completed`` (a conversation: parked if a human's
    message waits), why it is parked if no live worker serves it."""
    from toren._core.rows import actor_row
    from toren.runs import RUN_KIND
    from toren.runs.version_listing import parked_reason, pinned_version, stranded

    row = await actor_row(client.pool, run_id, kind=RUN_KIND)
    route = row.route if row is not None else None
    given = {run_id: route}
    found = await stranded(client, given if check else {}, completed=given if completed else None)
    stuck = found.get(run_id)
    return pinned_version(route)[1], parked_reason(stuck) if stuck is not None else None


def register_jobs(jobs: click.Group) -> None:
    """Add ``upgrade`` to the ``toren jobs`` group."""

    @jobs.command("upgrade")
    @click.argument("run_id")
    @click.pass_context
    @run_async
    async def jobs_upgrade(ctx: click.Context, run_id: str) -> None:
        """Move RUN to the newest version of its agent. The newest is the version the most
        recently started live worker serving the agent publishes; the move has the agent's
        policy's semantics: under
        `next_turn` its calls are taken as recorded; otherwise they are checked again and
        invalidated from the first that differs. Exit 1 if the run has ended or is on the
        newest version already, or no live worker serves its agent; 2 if there is no such
        run."""
        from toren._agent.principal import Principal
        from toren._core.client import Client
        from toren._core.rows import actor_row
        from toren.runs import RUN_KIND, upgrade_run
        from toren.runs.version_listing import pinned_version

        client = await Client.connect(database_url(ctx.obj["settings"]), pool_size=2)
        try:
            run_id = await resolve(client, run_id)
            row = await actor_row(client.pool, run_id, kind=RUN_KIND)
            was = pinned_version(row.route if row is not None else None)[1]
            version = await upgrade_run(client, run_id, by=Principal.os_user("cli"))
        finally:
            await client.close()
        moved = f"from version {was} " if was else ""
        out.print(plain(f"upgrade: {run_id} moves {moved}to version {version}"))
