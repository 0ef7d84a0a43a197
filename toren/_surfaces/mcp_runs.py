"""The run kind's MCP tools: list and read runs, start one, send it a message, and (when the
server allows decisions) approve or deny what it waits for. The MCP server
(:mod:`toren._surfaces.mcp_server`) adds them through the run kind's surfaces."""

from __future__ import annotations

from typing import Any

from mcp.server.mcpserver import Context

from toren._core.client import AskError, Client
from toren._core.errors import ActorNotLive, UnknownActor
from toren._core.json_text import safe_text
from toren._surfaces.mcp_server import McpTools, ToolError
from toren.runs import (
    DECISION_WAIT,
    AgentNotServed,
    AmbiguousDecision,
    IdempotencyConflict,
    InvalidStart,
    MessageTooLarge,
    RunNotInState,
    check_served,
    decide,
    decision_target,
    read_run,
    receipt,
    run_agent,
    say,
    start_run,
    waiting_below,
    waiting_on,
)
from toren.runs.audit import RunPruned, unknown_run
from toren.runs.listing import list_runs as _list_runs


def install(tools: McpTools) -> None:
    """Add the run tools to ``tools.server``; ``approve`` and ``deny`` only if it allows
    decisions."""
    server, client, caller = tools.server, tools.client, tools.caller

    @server.tool()
    async def list_runs(
        ctx: Context, status: str | None = None, agent: str | None = None, limit: int = 20
    ) -> list[dict[str, Any]]:
        """Runs, newest first. status: running, parked (waiting on a human or a timer),
        completed, failed or cancelled."""
        await caller(ctx, "read")
        try:
            limit = max(1, min(limit, 200))
            rows = await _list_runs(client, status=status, agent=agent, limit=limit)
        except ValueError as exc:
            raise ToolError(str(exc)) from exc
        return [_printable(row.to_json()) for row in rows]

    @server.tool(name="read_run")
    async def read_run_tool(run_id: str, ctx: Context) -> dict[str, Any]:
        """A run: status, input, output or error, what it waits for, and its cost receipt."""
        await caller(ctx, "read")
        rid = _run_id(run_id)
        state = await _state(client, rid)
        r = receipt(state)
        shown: dict[str, Any] = _printable(
            {
                "id": rid,
                "agent": state.agent,
                "status": state.status,
                "input": state.input,
                "output": state.output,
                "error": f"{state.error_class}: {state.error}" if state.error_class else None,
                "waiting_on": [
                    {"call_id": c.id, "tool": c.name, "arguments": c.arguments, "run": rid}
                    for c in waiting_on(state)
                ]
                + [  # calls of child runs (cross-agent calls), decided from here too
                    {"call_id": c.id, "tool": c.name, "arguments": c.arguments, "run": below}
                    for below, _, _ in await waiting_below(client, rid)
                    for c in waiting_on(await read_run(client, below))
                ],
                "receipt": {
                    "calls_made": r.calls_made,
                    "calls_replayed": r.calls_replayed,
                    "usd_paid": str(r.usd_paid),
                    "usd_not_repaid": str(r.usd_not_repaid),
                    "compactions_soft": r.compactions_soft,
                    "compactions_hard": r.compactions_hard,
                    "tokens_saved": r.tokens_saved,
                    "child_runs": r.child_runs,
                    "child_usd_paid": str(r.child_usd_paid),
                    "usd_total": str(r.usd_total),
                    "calls_lost": r.calls_lost,
                    "usd_lost_estimated": str(r.usd_lost_estimated),
                },
                "parent": state.parent or None,
                "children": [c.run_id for c in state.children.values()],
            }
        )
        return shown

    @server.tool(name="start_run")
    async def start_run_tool(
        agent: str,
        input: str,
        ctx: Context,
        idempotency_key: str | None = None,
        concurrency_key: str | None = None,
    ) -> dict[str, Any]:
        """Start a run of an agent on an input; returns its id. Runs with the same
        concurrency_key go at most the agent's max_runs_per_key at a time (default one)."""
        access = await caller(ctx, "operate", agent)
        try:
            await check_served(client, agent)
            rid = await start_run(
                client,
                agent,
                input,
                idempotency_key=idempotency_key,
                cap=tools.message_cap,
                by=access.principal,
                concurrency_key=concurrency_key,
            )
        except (IdempotencyConflict, MessageTooLarge, InvalidStart, AgentNotServed) as exc:
            raise ToolError(str(exc)) from exc
        return {"id": rid, "status": "running"}

    @server.tool()
    async def send_message(run_id: str, text: str, ctx: Context) -> str:
        """Send the run a message (applied at its next step)."""
        rid = _run_id(run_id)
        await _state(client, rid)
        access = await caller(ctx, "operate", await run_agent(client, rid))
        try:
            await say(client, rid, text, by=access.principal, cap=tools.message_cap)
        except (MessageTooLarge, RunNotInState) as exc:
            raise ToolError(str(exc)) from exc
        return f"sent to {rid}"

    async def _decide(
        run_id: str, call_id: str, approved: bool, reason: str, run: str, ctx: Context
    ) -> str:
        rid = _run_id(run_id)
        await _state(client, rid)
        await caller(ctx, "approve")  # the scope first; the agent once the run decided is known
        # A call a child run waits on may be decided from its parent: it goes to the child,
        # and the caller must be allowed to decide that run's agent's calls.
        try:
            rid, agent = await decision_target(
                client, rid, call_id, _run_id(run) if run.strip() else None
            )
        except (AmbiguousDecision, RunNotInState) as exc:
            raise ToolError(str(exc)) from exc
        access = await caller(ctx, "approve", agent)
        name = access.principal.name
        try:
            outcome = await decide(
                client, rid, call_id=call_id, approved=approved, by=access.principal, reason=reason
            )
        except (ActorNotLive, AskError, MessageTooLarge, RunNotInState) as exc:
            raise ToolError(str(exc)) from exc
        if outcome is None:
            return (
                f"pending: no worker answered within {DECISION_WAIT:g}s; the decision is "
                f"applied only if call {call_id} of {rid} still waits when the run handles it"
            )
        if not outcome.accepted:
            raise ToolError(f"not applied: {outcome.detail}")
        return f"{outcome.detail} (by {name}, {rid})"

    if not tools.allow_decisions:
        return

    @server.tool()
    async def approve(
        run_id: str, call_id: str, ctx: Context, reason: str = "", run: str = ""
    ) -> str:
        """Approve the tool call `call_id` the run waits for (read_run lists them under
        waiting_on, with the `run` each belongs to: the run, or a child run of its cross-agent
        calls; name it when a call id waits in more than one). A decision for a call that does
        not wait is refused."""
        return await _decide(run_id, call_id, True, reason, run, ctx)

    @server.tool()
    async def deny(run_id: str, call_id: str, ctx: Context, reason: str = "", run: str = "") -> str:
        """Deny the tool call `call_id` the run waits for (the model is told, with the
        reason; `run` as for approve). A decision for a call that does not wait is refused."""
        return await _decide(run_id, call_id, False, reason, run, ctx)


def _printable(value: Any) -> Any:
    """``value`` with NUL and lone surrogates in its text written as ``\\uXXXX`` escapes: the
    MCP SDK writes UTF-8 JSON, which cannot carry a lone surrogate."""
    if isinstance(value, str):
        return safe_text(value)
    if isinstance(value, dict):
        return {_printable(k): _printable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_printable(v) for v in value]
    return value


def _run_id(raw: str) -> str:
    raw = raw.strip()
    return raw if raw.startswith("run/") else f"run/{raw}"


async def _state(client: Client, rid: str) -> Any:
    try:
        row = await client.actor(rid)
    except UnknownActor as exc:
        missing = await unknown_run(client.pool, rid)  # a pruned run says when it was pruned
        shown = str(missing) if isinstance(missing, RunPruned) else f"no run {rid}"
        raise ToolError(shown) from exc
    if row["kind"] != "toren.run":
        raise ToolError(f"no run {rid}")
    return await read_run(client, rid)
