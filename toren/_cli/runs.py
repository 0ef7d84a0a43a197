"""``toren run`` and ``toren jobs ...``: start, inspect, follow and steer agent runs."""

from __future__ import annotations

import json
from decimal import Decimal
from typing import TYPE_CHECKING, Any

import anyio
import click
from rich.table import Table

from toren._agent.principal import Principal
from toren._cli.common import database_url, err, out, run_async, toren_command
from toren._cli.forks import add_fork
from toren._cli.receipts import family_lines, receipt_line
from toren._cli.restore import add_restore
from toren._cli.run_ids import console_link, resolve
from toren._cli.sandboxes import call_lines, described
from toren._cli.versions import pinned
from toren._cli.versions import register_jobs as register_version_commands
from toren._core.errors import ConfigError, TorenError, UnknownActor
from toren._core.terminal import plain
from toren._settings import Settings
from toren.runs.events import ENDED, STATUSES
from toren.runs.forked import forked_from
from toren.runs.receipt import receipt

if TYPE_CHECKING:
    from toren._agent.model import ToolCall
    from toren._core.client import Client
    from toren.runs import RunState

# What the commands below read and write runs with (the client, the runs' API, the timeline,
# sandboxes) is imported in their bodies: `toren --help` and every other command import this
# module to describe its commands, and do without asyncpg and the runs' fold.


def who() -> Principal:
    """How a CLI user is recorded on what they do: the OS user of this process, by uid (never
    from ``LOGNAME`` or ``USER``). The CLI needs no token: database access is the trust."""
    return Principal.os_user("cli")


async def _client(settings: Settings) -> Client:
    from toren._core.archive_reader import ArchivesAt
    from toren._core.client import Client
    from toren._core.config import archive_store_url

    client = await Client.connect(database_url(settings), pool_size=2)
    client.archives = ArchivesAt(archive_store_url(settings))
    return client


async def _read(client: Client, run_id: str) -> RunState:
    from toren.runs import read_run
    from toren.runs.audit import RunPruned

    try:
        return await read_run(client, run_id)
    except RunPruned:
        raise  # it says when it was pruned (exit 1), as every write to it does
    except UnknownActor:
        raise ConfigError(f"no run {run_id!r}", hint="List runs with `toren jobs list`.") from None


# Runs `jobs list` prints at most: a bound, so that -1 or 2**63 is a usage error.
_LIST_MAX = 100_000
EVENTS_PAGE = 1000  # events `jobs show` lists at once: a page of the API's GET /runs/{id}/events
_SEQ_MAX = 2**63 - 2  # a page bound Postgres takes as a bigint (the limit is asked one more)


def _concurrency_key(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """``--concurrency-key``, checked before anything is stored (exit 2 if it is not a key)."""
    from toren.runs.limits import key_problem

    if value is not None and (problem := key_problem(value)) is not None:
        raise click.BadParameter(f"a concurrency key is {problem}", ctx=ctx, param=param)
    return value


def register(main: click.Group) -> None:
    """Add ``run`` and ``jobs`` to the ``toren`` command group."""

    @main.command("run")
    @click.argument("agent")
    @click.argument("text")
    @click.option(
        "--key", help="Idempotency key (per agent): the same agent, key and input start one run."
    )
    @click.option(
        "--concurrency-key",
        callback=_concurrency_key,
        help="Runs of AGENT with the same concurrency key go at most max_runs_per_key at a "
        "time (default 1: one at a time, in order); the others wait, queued.",
    )
    @click.option(
        "--wait",
        is_flag=True,
        help="Wait until the run ends (completed, failed, cancelled) or parks.",
    )
    @click.pass_context
    @run_async
    async def run_cmd(
        ctx: click.Context,
        agent: str,
        text: str,
        key: str | None,
        concurrency_key: str | None,
        wait: bool,
    ) -> None:
        """Start a run of AGENT on TEXT; prints its id."""
        from toren.runs import start_run

        client = await _client(ctx.obj["settings"])
        try:
            await _check_served(client, agent)
            cap = ctx.obj["settings"].max_message_bytes
            run_id = await start_run(
                client,
                agent,
                text,
                idempotency_key=key,
                cap=cap,
                by=who(),
                concurrency_key=concurrency_key,
            )
            out.print(plain(run_id))
            link = console_link(ctx.obj["settings"], run_id)
            if link:  # on stderr: `RUN=$(toren run ...)` gets the id alone
                err.print(plain(f"console: {link}"))
            if wait:
                state = await _until_settled(client, run_id)
                _, stuck = await pinned(client, run_id, check=state.status not in ENDED)
                if stuck is not None:  # on a version no live worker serves
                    out.print(plain(f"parked: {stuck}"))
                    out.print(plain(f"  upgrade: {toren_command()} jobs upgrade {run_id}"))
                if state.status == "parked":
                    for line in await _parked(client, run_id, state):
                        out.print(plain(line))
                elif stuck is None:
                    out.print(plain(f"{state.status}: {state.output or state.error or ''}"))
        finally:
            await client.close()

    @main.group()
    def jobs() -> None:
        """Inspect and steer runs."""

    add_fork(jobs)
    add_restore(jobs)

    @jobs.command("list")
    @click.option("--status", type=click.Choice(STATUSES))
    @click.option("--agent")
    @click.option(
        "--limit", type=click.IntRange(min=1, max=_LIST_MAX), default=50, show_default=True
    )
    @click.pass_context
    @run_async
    async def jobs_list(
        ctx: click.Context, status: str | None, agent: str | None, limit: int
    ) -> None:
        """The newest runs with their status and cost."""
        from toren.runs.listing import list_runs

        client = await _client(ctx.obj["settings"])
        try:
            rows = await list_runs(client, status=status, agent=agent, limit=limit)
        finally:
            await client.close()
        table = Table()
        for col in ("run", "agent", "status", "calls", "paid $", "started"):
            table.add_column(col)
        for row in rows:
            table.add_row(
                plain(row.id),
                plain(row.agent),
                plain(
                    f"{row.status} #{row.queue_position} for {row.queued_for}"
                    if row.queue_position is not None
                    else f"{row.status}: {row.waiting_for}"
                    if row.waiting_for
                    else row.status
                ),
                str(row.calls_made),
                f"{Decimal(row.usd_paid):.6f}",
                row.created_at.isoformat(timespec="seconds"),
            )
        out.print(table)

    @jobs.command("show")
    @click.argument("run_id")
    @click.option("--json", "as_json", is_flag=True, help="Print the run and its events as JSON.")
    @click.option(
        "--after",
        type=click.IntRange(min=0, max=_SEQ_MAX),
        default=0,
        help="Only the events after this sequence number (the next page: the last one shown).",
    )
    @click.option(
        "--limit",
        type=click.IntRange(min=1, max=_SEQ_MAX),
        default=EVENTS_PAGE,
        show_default=True,
        help="At most this many events.",
    )
    @click.pass_context
    @run_async
    async def jobs_show(
        ctx: click.Context, run_id: str, as_json: bool, after: int, limit: int
    ) -> None:
        """The run's timeline, its sandboxed calls and its receipt. Each sandboxed call shows
        its command, where, how it ended and the first lines of its output (all of it with
        --json, as `commands`). The timeline lists 1,000 events at most (--limit); the next
        ones with --after, as the line that ends it says. With --json the events are
        `events`, each with its timeline line, and `more_events` says whether more follow."""
        import attrs

        from toren._cli.retention import show_pruned
        from toren._cli.timeline import describe, event_record, record
        from toren.runs.limits import QUEUED, concurrency, reason
        from toren.sandboxes.listing import read_calls, sandbox_of

        client = await _client(ctx.obj["settings"])
        try:
            run_id = await resolve(client, run_id)
            if await show_pruned(client, run_id, as_json):
                return  # its journal was pruned: its audit record answers
            state = await _read(client, run_id)
            sandbox = await sandbox_of(client.pool, run_id)
            over = state.status in ENDED
            limits = await concurrency(client, run_id)
            wait = None if over else limits.wait
            version, stuck = await pinned(
                client,
                run_id,
                check=not over and wait is None,
                completed=state.status == "completed",
            )
            calls = await read_calls(client.pool, run_id, ended=over)
            entries = await client.journal(run_id, after=after, limit=limit + 1)
            more, entries = len(entries) > limit, entries[:limit]
            forked = forked_from(state)
            if as_json:
                shown = record(run_id, state)
                shown["forked_from"] = forked.to_json() if forked else None
                if wait is not None:
                    shown["status"] = QUEUED
                elif stuck is not None:
                    shown["status"] = "parked"
                shown["version"] = version
                shown["waiting_for"] = stuck
                shown = shown | {
                    "concurrency_key": limits.key,
                    "queued": attrs.asdict(wait) if wait is not None else None,
                    "sandbox": sandbox.to_json() if sandbox else None,
                    "commands": [c.to_json() for c in calls],
                    "events": [event_record(e) for e in entries],
                    "more_events": more,
                }
                # ASCII escapes: any text a run holds prints, lone surrogates included.
                click.echo(json.dumps(shown, indent=2, ensure_ascii=True))
                return
            if forked is not None:
                out.print(plain(forked.line()))
            for entry in entries:
                out.print(plain(f"{entry.seq:>4}  {describe(entry.type, entry.data)}"))
            if more:
                out.print(
                    plain(
                        f"   ...  more events: {toren_command()} jobs show {run_id} "
                        f"--after {entries[-1].seq}"
                    )
                )
            if stuck is not None and not more:  # the timeline's last line: why it waits
                out.print(
                    plain(
                        f"   --  parked: {stuck}; move it to the newest version with "
                        f"{toren_command()} jobs upgrade {run_id}"
                    )
                )
            if sandbox is not None or calls:
                out.print()
            if sandbox is not None:
                out.print(plain(described(sandbox)))
            if calls:
                out.print(plain("sandboxed calls:"))
                for line in call_lines(calls, run_id):
                    out.print(plain(line))
            for line in family_lines(state):
                out.print(plain(line))
            if limits.key is not None:
                out.print(plain(f"\nconcurrency key: {limits.key}"))
            status = state.status if wait is None else f"{QUEUED} ({reason(wait)})"
            if stuck is not None and wait is None:
                status = f"parked ({stuck})"
            out.print(plain(f"\nstatus {status}. {receipt_line(receipt(state))}"))
            link = console_link(ctx.obj["settings"], run_id)
            if link:
                out.print(plain(f"console: {link}"))
        finally:
            await client.close()

    @jobs.command("tail")
    @click.argument("run_id")
    @click.pass_context
    @run_async
    async def jobs_tail(ctx: click.Context, run_id: str) -> None:
        """Follow a run's events until it completes or fails."""
        from toren._cli.timeline import describe
        from toren.runs.audit import unknown_run

        client = await _client(ctx.obj["settings"])
        try:
            run_id = await resolve(client, run_id)
            seen = 0
            while True:
                page = await client.journal(run_id, after=seen)
                for entry in page:
                    out.print(plain(f"{entry.seq:>4}  {describe(entry.type, entry.data)}"))
                    seen = entry.seq
                    if entry.type in ("run.completed", "run.failed", "toren.failed"):
                        return
                if not page:  # nothing new: a run pruned (before or since) has none to come
                    try:
                        await client.actor(run_id)
                    except UnknownActor:
                        raise await unknown_run(client.pool, run_id) from None
                await anyio.sleep(0.5)
        finally:
            await client.close()

    def steer(
        name: str,
        help_text: str,
        action: Any,
        *,
        text: bool = False,
        reason: bool = False,
        flags: tuple[click.Option, ...] = (),
    ) -> None:
        params: list[click.Parameter] = [click.Argument(["run_id"]), *flags]
        if text:
            params.append(click.Argument(["text"]))
        if reason:
            params.append(
                click.Option(["--reason"], default="", help="Recorded with the decision.")
            )

        @click.pass_context
        @run_async
        async def command(ctx: click.Context, /, run_id: str, **kwargs: Any) -> None:
            settings: Settings = ctx.obj["settings"]
            client = await _client(settings)
            try:
                run_id = await resolve(client, run_id)
                await action(client, run_id, settings=settings, **kwargs)
                out.print(plain(f"{name}: sent to {run_id}"))
            finally:
                await client.close()

        jobs.add_command(click.Command(name, callback=command, params=params, help=help_text))

    async def send(c: Client, r: str, text: str, settings: Settings) -> None:
        from toren.runs import say

        await say(c, r, text, by=who(), cap=settings.max_message_bytes)

    async def stop(c: Client, r: str, reason: str, settings: Settings) -> None:
        from toren.runs import cancel

        await cancel(c, r, by=who(), reason=reason)

    async def again(c: Client, r: str, settings: Settings, upgrade: bool) -> None:
        from toren.runs import retry

        await retry(c, r, by=who(), upgrade=upgrade)

    steer("send", "Send a message TEXT to RUN (applied at its next step).", send, text=True)
    steer("cancel", "Cancel RUN.", stop, reason=True)
    steer(
        "retry",
        "Resume failed RUN from its last good step. With --upgrade, on the newest version of "
        "its agent (for a failure whose fix exists only there).",
        again,
        flags=(
            click.Option(
                ["--upgrade"],
                is_flag=True,
                help="Move the run to the newest version of its agent first (as `jobs "
                "upgrade` does).",
            ),
        ),
    )
    register_version_commands(jobs)

    def decision(name: str, help_text: str, approved: bool) -> None:
        @jobs.command(name, help=help_text)
        @click.argument("run_id")
        @click.option("--call", "call_id", help="The waiting call to decide (its call id).")
        @click.option(
            "--run",
            "run",
            help="The run whose call it is (RUN or a child run of it), when the call id waits "
            "in several.",
        )
        @click.option("--reason", default="", help="Recorded with the decision.")
        @click.pass_context
        @run_async
        async def command(
            ctx: click.Context, run_id: str, call_id: str | None, run: str | None, reason: str
        ) -> None:
            client = await _client(ctx.obj["settings"])
            try:
                await _decide(
                    client,
                    await resolve(client, run_id),
                    call_id,
                    approved=approved,
                    reason=reason,
                    run=await resolve(client, run) if run else None,
                )
            finally:
                await client.close()

    decision(
        "approve",
        "Approve the tool call RUN waits on. It is shown first; with several, name it with --call.",
        True,
    )
    decision(
        "deny",
        "Deny the tool call RUN waits on. The model is told why; with several, name it with "
        "--call.",
        False,
    )


class DecisionNotApplied(TorenError):
    """The run did not apply a decision (its call does not wait, or was decided otherwise)."""

    def __init__(self, detail: str) -> None:
        self.detail = detail
        super().__init__(f"not applied: {detail}")


async def _decide(
    client: Client,
    run_id: str,
    call_id: str | None,
    *,
    approved: bool,
    reason: str,
    run: str | None = None,
) -> None:
    """Show the call decided, decide it, and report what the run did (exit 1 if refused).
    Calls the run's child runs wait on are listed and decided from the parent too."""
    from toren.runs import DECISION_WAIT, AmbiguousDecision, decide, decision_target

    state = await _read(client, run_id)
    waiting = await _waiting(client, run_id, state)
    if call_id is None:
        if not waiting:
            raise DecisionNotApplied(
                f"{run_id} is not waiting for a decision (it is {state.status})"
            )
        if len(waiting) > 1:
            calls = ", ".join(f"{c.name} (--call {c.id})" for _, c in waiting)
            raise ConfigError(
                f"{run_id} waits for {len(waiting)} decisions: {calls}",
                hint="Name the one you decide with --call.",
            )
        run, call_id = waiting[0][0], waiting[0][1].id
    verb = "approving" if approved else "denying"
    try:
        target, _ = await decision_target(client, run_id, call_id, run)
    except AmbiguousDecision as exc:
        raise ConfigError(str(exc), hint="Name it with --run.") from exc
    for where, call in waiting:
        if call.id == call_id and where == target:
            out.print(plain(f"{verb} {await _call_text(client, run_id, where, call)}"))
    outcome = await decide(
        client, target, call_id=call_id, approved=approved, by=who(), reason=reason
    )
    if outcome is None:
        out.print(
            plain(
                f"pending: no worker answered within {DECISION_WAIT:g}s; the decision is queued "
                f"and is applied only if call {call_id} still waits when the run handles it"
            )
        )
    elif not outcome.accepted:
        raise DecisionNotApplied(outcome.detail)
    else:
        out.print(plain(outcome.detail))


async def _waiting(client: Client, run_id: str, state: RunState) -> list[tuple[str, ToolCall]]:
    """The calls waiting for a decision in the run and in its child runs, with the run each
    waits in."""
    from toren.runs import read_run, waiting_below, waiting_on

    waiting = [(run_id, c) for c in waiting_on(state)]
    for below, _, _ in await waiting_below(client, run_id):
        waiting.extend((below, c) for c in waiting_on(await read_run(client, below)))
    return waiting


async def _call_text(client: Client, run_id: str, where: str, call: ToolCall) -> str:
    """``TOOL ARGUMENTS [in CWD] (call ID [of child run RUN])``: a waiting call, as a person
    deciding it needs to see it."""
    from toren.sandboxes.listing import approval_cwds

    arguments = json.dumps(call.arguments, ensure_ascii=True)
    of = f" of child run {where}" if where != run_id else ""
    cwd = (await approval_cwds(client.pool, where, [call.id])).get(call.id)
    at = f" in {cwd}" if cwd else ""  # a sandboxed command: where it would run
    return f"{call.name} {arguments}{at} (call {call.id}{of})"


async def _parked(client: Client, run_id: str, state: RunState) -> list[str]:
    """What ``toren run --wait`` prints for a parked run: what it waits on and the exact
    commands that move it on."""
    toren = toren_command()
    waiting = await _waiting(client, run_id, state)
    lines = []
    for where, call in waiting:
        named = f" --call {call.id}" if len(waiting) > 1 else ""
        lines += [
            f"parked: waiting for approval of {await _call_text(client, run_id, where, call)}",
            f"  approve: {toren} jobs approve {run_id}{named}",
            f"  deny:    {toren} jobs deny {run_id}{named} --reason WHY",
        ]
    if not waiting and state.running:
        children = ", ".join(f"{c.run_id} ({c.agent})" for c in state.running.values())
        lines.append(f"parked: waiting for child run(s) {children}")
    if not lines:
        lines.append("parked: waiting for a timer or a message")
    lines.append(f"  its timeline: {toren} jobs show {run_id}")
    return lines


async def _check_served(client: Client, agent: str) -> None:
    """Refuse a run no live worker could take; start it anyway when no worker is up at all."""
    from toren.runs import AgentNotServed, check_served

    try:
        if not await check_served(client, agent):
            err.print(
                plain(
                    f"note: no worker is running; the run starts when one with agent {agent!r} does"
                )
            )
    except AgentNotServed as exc:
        raise ConfigError(
            f"no live worker runs agent {agent!r} "
            f"(they run: {', '.join(sorted(exc.served)) or 'no agents'})",
            hint="Start a worker with --app naming the module that defines it.",
        ) from None


async def _until_settled(client: Client, run_id: str) -> RunState:
    """The run's state once it has ended (completed, failed, cancelled) or parked, also on a
    version no live worker serves (looked at every second): its status is polled from its row
    (nothing folded meanwhile), the state read once at the end."""
    from toren.runs import read_run, run_status

    settled = (*ENDED, "parked")
    polls = 0
    while True:
        polls += 1
        if await run_status(client, run_id) in settled:
            state = await read_run(client, run_id)
            if state.status in settled:  # not gone on meanwhile
                return state
        if polls % 4 == 0 and (await pinned(client, run_id, check=True))[1] is not None:
            return await read_run(client, run_id)
        await anyio.sleep(0.25)
