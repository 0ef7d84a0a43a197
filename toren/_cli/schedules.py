"""``toren schedules list | show | create | pause | resume | trigger | backfill | delete``:
agents that run on a clock, managed at run time.

A schedule is named ``AGENT/SLOT``. Every change is a message to the schedule's actor, done by a
worker at its next step; the command checks what it can first and stores nothing when that
fails. Exit codes: 0 done (or sent); 1 no such schedule, or a schedule of that name exists with
another declaration, or another Toren error at run time; 2 bad input (an invalid cron
expression, an unknown time zone, an agent no live worker runs, ...) or configuration.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import click
from rich.table import Table

from toren._cli.common import database_url, out, run_async
from toren._core.errors import ConfigError
from toren._core.terminal import plain

if TYPE_CHECKING:
    from toren._core.client import Client
    from toren._settings import Settings
    from toren.schedules.client import ScheduleView

# What the commands read and write schedules with (the client, toren.schedules) is imported in
# their bodies: `toren --help` imports this module to describe its commands.

OVERLAPS = ("skip", "buffer_one", "buffer_all", "cancel_other", "allow_all")


def duration(text: str) -> float | str:
    """A duration option as the schedule takes it: a number of seconds, or its text (``30m``,
    ``1h30m``), which the schedule reads and refuses if it is not one."""
    try:
        return float(text)
    except ValueError:
        return text


def instant(text: str, field: str) -> float:
    """Unix seconds of ``text``, an ISO-8601 date and time with a UTC offset (or ``Z``).

    Raises:
        ConfigError: it is not one.
    """
    from datetime import datetime

    hint = "Write it like 2026-01-05T09:00:00+01:00 (or ...Z for UTC)."
    try:
        moment = datetime.fromisoformat(text)
    except ValueError:
        raise ConfigError(
            f"--{field}: {text!r} is not an ISO-8601 date and time", hint=hint
        ) from None
    if moment.tzinfo is None or moment.utcoffset() is None:
        raise ConfigError(f"--{field}: {text!r} needs a UTC offset", hint=hint)
    return moment.timestamp()


def register(main: click.Group) -> None:
    """Add ``schedules`` to the ``toren`` command group."""

    @main.group()
    def schedules() -> None:
        """Start agents' runs on a clock.

        Schedules fire at cron times in a time zone, or at intervals: list, create, pause,
        resume, trigger, backfill and delete them."""

    @schedules.command("list")
    @click.option("--agent", help="Only this agent's schedules.")
    @click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
    @click.pass_context
    @run_async
    async def list_cmd(ctx: click.Context, agent: str | None, as_json: bool) -> None:
        """List schedules and their next fire times.

        Each with its spec, next fire times (in its time zone), whether paused, its last runs,
        missed slots and why the last slot did not start."""
        from toren.schedules.client import list_schedules

        async with await _client(ctx.obj["settings"]) as client:
            views = await list_schedules(client, agent=agent)
        if as_json:
            click.echo(json.dumps([v.to_json() for v in views], indent=2, ensure_ascii=True))
            return
        table = Table(title=f"{len(views)} schedule(s)")
        for col in ("schedule", "spec", "next", "state", "last runs", "missed", "last reason"):
            table.add_column(col)
        for v in views:
            table.add_row(
                plain(v.name),
                plain(spec_text(v.schedule)),
                plain("\n".join(fire_times(v))),
                plain(state_text(v)),
                plain("\n".join(last_runs(v)) or "-"),
                str(v.missed),
                plain(v.last_reason or "-"),
            )
        out.print(table)

    @schedules.command("show")
    @click.argument("name")
    @click.option("--json", "as_json", is_flag=True, help="Print JSON.")
    @click.pass_context
    @run_async
    async def show_cmd(ctx: click.Context, name: str, as_json: bool) -> None:
        """Show one schedule (NAME is AGENT/SLOT).

        Its declaration, next fire times and recent slots."""
        from toren.schedules.client import show

        async with await _client(ctx.obj["settings"]) as client:
            view = await show(client, name)
        if as_json:
            click.echo(json.dumps(view.to_json(), indent=2, ensure_ascii=True))
            return
        for line in described(view):
            out.print(plain(line))

    @schedules.command("create")
    @click.argument("agent")
    @click.argument("slot")
    @click.option("--cron", help="A five-field cron expression, read in --timezone.")
    @click.option("--every", help="An interval instead of --cron: 90s, 30m, 1h, 1d.")
    @click.option("--timezone", default="UTC", show_default=True, help="An IANA time zone.")
    @click.option("--input", "template", help="The runs' input: a template ({date}, {time}, ...).")
    @click.option("--concurrency-key", help="The runs' concurrency key.")
    @click.option("--overlap", type=click.Choice(OVERLAPS), help="While a run is in flight.")
    @click.option("--catch-up", help="Fire slots missed within this window (e.g. 1h).")
    @click.option("--jitter", help="Delay each slot's run by up to this (e.g. 30s).")
    @click.option("--start", help="No slot before this (ISO-8601 with an offset).")
    @click.option("--end", help="No slot after this (ISO-8601 with an offset).")
    @click.option("--pause-on-failure", is_flag=True, help="Pause when a run it started fails.")
    @click.pass_context
    @run_async
    async def create_cmd(ctx: click.Context, /, agent: str, slot: str, **options: Any) -> None:
        """Create AGENT's schedule SLOT.

        Give --cron or --every; prints its name. Creating it again with the same values is a
        no-op."""
        from toren._cli.runs import who
        from toren.runs import AgentNotServed
        from toren.schedules.client import create, schedule_of

        schedule = schedule_of(slot, _fields(options))
        async with await _client(ctx.obj["settings"]) as client:
            try:
                name = await create(client, agent, schedule, by=who())
            except AgentNotServed as exc:
                raise ConfigError(
                    str(exc), hint="Start a worker that runs it, or name an agent one runs."
                ) from None
        out.print(plain(name))

    @schedules.command("pause")
    @click.argument("name")
    @click.option("--reason", default="", help="Why (shown in listings).")
    @click.pass_context
    @run_async
    async def pause_cmd(ctx: click.Context, name: str, reason: str) -> None:
        """Pause NAME: its slots start nothing until it is resumed."""
        from toren._cli.runs import who
        from toren.schedules.client import pause

        async with await _client(ctx.obj["settings"]) as client:
            await pause(client, name, by=who(), reason=reason)
        out.print(plain(f"paused {name}"))

    @schedules.command("resume")
    @click.argument("name")
    @click.pass_context
    @run_async
    async def resume_cmd(ctx: click.Context, name: str) -> None:
        """Resume NAME from now (the slots of the pause are not fired)."""
        from toren._cli.runs import who
        from toren.schedules.client import resume

        async with await _client(ctx.obj["settings"]) as client:
            await resume(client, name, by=who())
        out.print(plain(f"resumed {name}"))

    @schedules.command("trigger")
    @click.argument("name")
    @click.pass_context
    @run_async
    async def trigger_cmd(ctx: click.Context, name: str) -> None:
        """Start a run of NAME's agent now.

        Whatever its slots and overlap policy; prints the run's id."""
        from toren._cli.runs import who
        from toren.schedules.client import trigger

        async with await _client(ctx.obj["settings"]) as client:
            run = await trigger(client, name, by=who())
        out.print(plain(run))

    @schedules.command("backfill")
    @click.argument("name")
    @click.option("--from", "start", required=True, help="From (excluded), ISO-8601.")
    @click.option("--to", "end", required=True, help="To (included, not in the future), ISO-8601.")
    @click.option("--overlap", type=click.Choice(OVERLAPS), default="buffer_all", show_default=True)
    @click.pass_context
    @run_async
    async def backfill_cmd(
        ctx: click.Context, name: str, start: str, end: str, overlap: str
    ) -> None:
        """Start NAME's slots in a past range.

        Slots that started a run already start none again."""
        from toren._cli.runs import who
        from toren.schedules.client import backfill

        lower, upper = instant(start, "from"), instant(end, "to")
        async with await _client(ctx.obj["settings"]) as client:
            count = await backfill(client, name, lower, upper, overlap=overlap, by=who())
        out.print(plain(f"{count} slot(s) in the range sent to {name}"))

    @schedules.command("delete")
    @click.argument("name")
    @click.pass_context
    @run_async
    async def delete_cmd(ctx: click.Context, name: str) -> None:
        """Delete NAME: it starts nothing more (its runs in flight go on)."""
        from toren._cli.runs import who
        from toren.schedules.client import delete

        async with await _client(ctx.obj["settings"]) as client:
            await delete(client, name, by=who())
        out.print(plain(f"deleted {name}"))


async def _client(settings: Settings) -> Client:
    from toren._core.client import Client

    return await Client.connect(database_url(settings), pool_size=2)


def _fields(options: dict[str, Any]) -> dict[str, Any]:
    """The schedule's fields from ``create``'s options (those given)."""
    fields: dict[str, Any] = {"timezone": options["timezone"]}
    if options["cron"] is not None:
        fields["cron"] = options["cron"]
    for option in ("every", "catch_up", "jitter"):
        if options[option] is not None:
            fields[option] = duration(options[option])
    for option, field in (("template", "input"), ("concurrency_key", "concurrency_key")):
        if options[option] is not None:
            fields[field] = options[option]
    for option in ("overlap", "start", "end"):
        if options[option] is not None:
            fields[option] = options[option]
    if options["pause_on_failure"]:
        fields["pause_on_failure"] = True
    return fields


# --- how a schedule is printed (also for the console's and MCP's text) --------------------------


def _seconds(value: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if value >= size and value % size == 0:
            return f"{int(value // size)}{unit}"
    return f"{value:g}s"


def spec_text(schedule: dict[str, Any]) -> str:
    """``cron 0 9 * * 1-5 (Europe/Berlin)`` or ``every 30m``, with jitter if any."""
    if schedule.get("cron"):
        text = f"cron {schedule['cron']} ({schedule.get('timezone') or 'UTC'})"
    else:
        text = f"every {_seconds(float(schedule.get('every') or 0))}"
    if schedule.get("jitter"):
        text += f", jitter {_seconds(float(schedule['jitter']))}"
    return text


def fire_times(view: ScheduleView) -> list[str]:
    """The next fire times, in the schedule's time zone."""
    from toren.schedules.client import local_time

    if view.paused:
        return ["(paused)"]
    zone = str(view.schedule.get("timezone") or "UTC")
    return [local_time(t, zone).strftime("%Y-%m-%d %H:%M:%S %Z") for t in view.next] or [
        "(none: past its end)"
    ]


def state_text(view: ScheduleView) -> str:
    if view.paused:
        return f"paused: {view.paused_reason}" if view.paused_reason else "paused"
    return f"{len(view.in_flight)} in flight" if view.in_flight else "active"


def last_runs(view: ScheduleView) -> list[str]:
    """The recent slots, newest first: the run each started and its status, or why none."""
    lines = []
    for slot in reversed(view.recent):
        if slot.run:
            lines.append(f"{slot.key} {slot.run} {slot.run_status or 'gone'}")
        else:
            lines.append(f"{slot.key} {slot.outcome}")
    return lines


def described(view: ScheduleView) -> list[str]:
    """``toren schedules show``'s lines."""
    s = view.schedule
    lines = [
        f"schedule {view.name} (agent {view.agent}, {view.source})",
        f"  spec: {spec_text(s)}",
        f"  state: {state_text(view)}",
        f"  next: {', '.join(fire_times(view))}",
        f"  overlap: {s.get('overlap') or 'skip'}; "
        f"catch-up: {_seconds(float(s.get('catch_up') or 0))}"
        + ("; pauses on failure" if s.get("pause_on_failure") else ""),
    ]
    lines.extend(
        f"  {field.replace('_', ' ')}: {s[field]}"
        for field in ("start", "end", "concurrency_key")
        if s.get(field)
    )
    if s.get("input"):
        lines.append(f"  input: {s['input']}")
    lines.append(
        f"  slots: {view.started} started, {view.skipped} skipped, {view.buffered} buffered, "
        f"{view.missed} missed"
    )
    if view.last_reason:
        lines.append(f"  last slot not started: {view.last_reason}")
    for slot in reversed(view.recent):
        what = f"{slot.run} ({slot.run_status or 'gone'})" if slot.run else slot.outcome
        why = f": {slot.reason}" if slot.reason else ""
        how = f" [{slot.how}]" if slot.how else ""
        lines.append(f"  {slot.key}{how} {what}{why}")
    return lines
