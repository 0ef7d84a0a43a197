"""The schedule kind's MCP tools: list schedules (``read``); create, pause, resume, trigger,
backfill and delete one (``operate``, on the schedules of the agents the caller may act on).
The MCP server (:mod:`toren._surfaces.mcp_server`) adds them through the schedule kind's
surfaces."""

from __future__ import annotations

from typing import Any

from mcp.server.mcpserver import Context

from toren._surfaces.mcp_runs import _printable
from toren._surfaces.mcp_server import McpTools, ToolError
from toren.runs import AgentNotServed
from toren.schedules import ScheduleError
from toren.schedules.client import (
    ScheduleExists,
    ScheduleNotFound,
    ScheduleView,
    backfill,
    create,
    delete,
    local_time,
    pause,
    resume,
    schedule_of,
    split_name,
    trigger,
)
from toren.schedules.client import (
    list_schedules as _list_schedules,
)
from toren.schedules.spec import aware


def install(tools: McpTools) -> None:
    """Add the schedule tools to ``tools.server``."""
    server, client, caller = tools.server, tools.client, tools.caller

    @server.tool()
    async def list_schedules(ctx: Context, agent: str | None = None) -> list[dict[str, Any]]:
        """Schedules (named AGENT/SLOT): their spec, next fire times in their time zone,
        whether paused, recent slots with their runs' status, missed slots, and why the last
        slot did not start."""
        access = await caller(ctx, "read")
        views = await _list_schedules(client, agent=agent)
        return [_printable(_shown(v)) for v in views if access.may_write(v.agent)]

    async def _target(ctx: Context, name: str) -> tuple[str, Any]:
        try:
            agent, _ = split_name(name)
        except ScheduleError as exc:
            raise ToolError(str(exc)) from exc
        return name, await caller(ctx, "operate", agent)

    @server.tool(name="pause_schedule")
    async def pause_tool(name: str, ctx: Context, reason: str = "") -> str:
        """Pause the schedule AGENT/SLOT: its slots start nothing until it is resumed."""
        name, access = await _target(ctx, name)
        try:
            await pause(client, name, by=access.principal, reason=reason)
        except (ScheduleError, ScheduleNotFound) as exc:
            raise ToolError(str(exc)) from exc
        return f"paused {name}"

    @server.tool(name="resume_schedule")
    async def resume_tool(name: str, ctx: Context) -> str:
        """Resume the schedule AGENT/SLOT from now (the slots of the pause are not fired)."""
        name, access = await _target(ctx, name)
        try:
            await resume(client, name, by=access.principal)
        except ScheduleNotFound as exc:
            raise ToolError(str(exc)) from exc
        return f"resumed {name}"

    @server.tool(name="trigger_schedule")
    async def trigger_tool(name: str, ctx: Context) -> dict[str, Any]:
        """Start a run of the schedule AGENT/SLOT's agent now; returns the run's id."""
        name, access = await _target(ctx, name)
        try:
            run = await trigger(client, name, by=access.principal)
        except (ScheduleError, ScheduleNotFound) as exc:
            raise ToolError(str(exc)) from exc
        return {"schedule": name, "run": run}

    @server.tool(name="create_schedule")
    async def create_tool(
        agent: str, name: str, schedule: dict[str, Any], ctx: Context
    ) -> dict[str, Any]:
        """Create AGENT's schedule NAME: ``schedule`` holds its fields as POST /schedules
        takes them (``cron`` or ``every``, ``timezone``, ``input``, ``overlap``, ...). The
        same declaration again is a no-op; another one under a live name is refused."""
        access = await caller(ctx, "operate", agent)
        try:
            declared = schedule_of(name, schedule)
            full = await create(client, agent, declared, by=access.principal)
        except (ScheduleError, ScheduleExists, AgentNotServed) as exc:
            raise ToolError(str(exc)) from exc
        return {"schedule": full}

    @server.tool(name="backfill_schedule")
    async def backfill_tool(
        name: str, start: str, end: str, ctx: Context, overlap: str = "buffer_all"
    ) -> dict[str, Any]:
        """Start the slots of the schedule AGENT/SLOT in (start, end] (ISO 8601 with an
        offset; end not in the future; at most 1,000 slots) under ``overlap``; returns how
        many slots the range holds. A slot that started a run already starts none again."""
        name, access = await _target(ctx, name)
        try:
            low, high = aware("start", start).timestamp(), aware("end", end).timestamp()
            slots = await backfill(client, name, low, high, overlap=overlap, by=access.principal)
        except (ScheduleError, ScheduleNotFound) as exc:
            raise ToolError(str(exc)) from exc
        return {"schedule": name, "slots": slots}

    @server.tool(name="delete_schedule")
    async def delete_tool(name: str, ctx: Context) -> str:
        """Delete the schedule AGENT/SLOT: it starts nothing more (its runs go on)."""
        name, access = await _target(ctx, name)
        try:
            await delete(client, name, by=access.principal)
        except ScheduleNotFound as exc:
            raise ToolError(str(exc)) from exc
        return f"deleted {name}"


def _shown(view: ScheduleView) -> dict[str, Any]:
    zone = str(view.schedule.get("timezone") or "UTC")
    shown = view.to_json()
    shown["next"] = [local_time(t, zone).isoformat() for t in view.next]
    return shown
