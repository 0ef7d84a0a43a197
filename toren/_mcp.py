"""The MCP server: list, read, start and steer runs from Claude or any MCP client.

Over stdio (``toren mcp``) the caller is the local user (recorded as ``mcp:<user>``); over
streamable HTTP (``toren mcp --http``) every request needs an API token, whose name is recorded.
Approvals and messages given here are recorded with channel ``mcp``.
"""

from __future__ import annotations

import getpass
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from contextlib import asynccontextmanager
from typing import Any

import anyio
from mcp.server.mcpserver import Context, MCPServer

from toren._client import AskError, Client
from toren._errors import ActorNotLive, UnknownActor
from toren._json import safe_text
from toren._listing import list_runs as _list_runs
from toren._tokens import authenticate
from toren._version import __version__
from toren.runs import (
    DECISION_WAIT,
    MESSAGE_CAP,
    IdempotencyConflict,
    MessageTooLarge,
    decide,
    read_run,
    receipt,
    say,
    start_run,
    waiting_on,
)

log = logging.getLogger("toren.mcp")

CHANNEL = "mcp"


class ToolError(Exception):
    """Reported to the MCP client as a tool error, with this message."""


def build(client: Client, *, message_cap: int = MESSAGE_CAP) -> MCPServer:
    """An MCP server whose tools act on ``client``'s database."""
    server: MCPServer = MCPServer(
        "toren",
        version=__version__,
        instructions="Toren runs durable LLM agents. List runs, read one, start one, send it a "
        "message, approve or deny what it waits for.",
    )

    async def who(ctx: Context) -> str:
        headers = ctx.headers
        if headers is None:
            return f"mcp:{getpass.getuser()}"
        token = headers.get("authorization", "").partition(" ")[2].strip()
        principal = await authenticate(client.pool, token)
        if principal is None:  # the HTTP layer already refused it; a revocation in between
            raise ToolError("the token is no longer valid")
        return principal.name

    @server.tool()
    async def list_runs(
        status: str | None = None, agent: str | None = None, limit: int = 20
    ) -> list[dict[str, Any]]:
        """Runs, newest first. status: running, parked (waiting on a human or a timer),
        completed or failed."""
        try:
            limit = max(1, min(limit, 200))
            rows = await _list_runs(client, status=status, agent=agent, limit=limit)
        except ValueError as exc:
            raise ToolError(str(exc)) from exc
        return [_printable(row.to_json()) for row in rows]

    @server.tool(name="read_run")
    async def read_run_tool(run_id: str) -> dict[str, Any]:
        """A run: status, input, output or error, what it waits for, and its cost receipt."""
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
                    {"call_id": c.id, "tool": c.name, "arguments": c.arguments}
                    for c in waiting_on(state)
                ],
                "receipt": {
                    "calls_made": r.calls_made,
                    "calls_replayed": r.calls_replayed,
                    "usd_paid": str(r.usd_paid),
                    "usd_not_repaid": str(r.usd_not_repaid),
                },
            }
        )
        return shown

    @server.tool(name="start_run")
    async def start_run_tool(
        agent: str, input: str, idempotency_key: str | None = None
    ) -> dict[str, Any]:
        """Start a run of an agent on an input; returns its id."""
        if not agent or not input:
            raise ToolError("agent and input are required")
        try:
            rid = await start_run(
                client, agent, input, idempotency_key=idempotency_key, cap=message_cap
            )
        except (IdempotencyConflict, MessageTooLarge) as exc:
            raise ToolError(str(exc)) from exc
        return {"id": rid, "status": "running"}

    @server.tool()
    async def send_message(run_id: str, text: str, ctx: Context) -> str:
        """Send the run a message (applied at its next step)."""
        rid = _run_id(run_id)
        await _state(client, rid)
        try:
            await say(client, rid, text, who=await who(ctx), channel=CHANNEL, cap=message_cap)
        except MessageTooLarge as exc:
            raise ToolError(str(exc)) from exc
        return f"sent to {rid}"

    async def _decide(run_id: str, call_id: str, approved: bool, reason: str, ctx: Context) -> str:
        rid = _run_id(run_id)
        await _state(client, rid)
        name = await who(ctx)
        try:
            outcome = await decide(
                client,
                rid,
                call_id=call_id,
                approved=approved,
                who=name,
                reason=reason,
                channel=CHANNEL,
            )
        except (ActorNotLive, AskError, MessageTooLarge) as exc:
            raise ToolError(str(exc)) from exc
        if outcome is None:
            return (
                f"pending: no worker answered within {DECISION_WAIT:g}s; the decision is "
                f"applied only if call {call_id} of {rid} still waits when the run handles it"
            )
        if not outcome.accepted:
            raise ToolError(f"not applied: {outcome.detail}")
        return f"{outcome.detail} (by {name}, {rid})"

    @server.tool()
    async def approve(run_id: str, call_id: str, ctx: Context, reason: str = "") -> str:
        """Approve the tool call `call_id` the run waits for (read_run lists them under
        waiting_on). A decision for a call that does not wait is refused."""
        return await _decide(run_id, call_id, True, reason, ctx)

    @server.tool()
    async def deny(run_id: str, call_id: str, ctx: Context, reason: str = "") -> str:
        """Deny the tool call `call_id` the run waits for (the model is told, with the
        reason). A decision for a call that does not wait is refused."""
        return await _decide(run_id, call_id, False, reason, ctx)

    return server


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
        raise ToolError(f"no run {rid}") from exc
    if row["kind"] != "toren.run":
        raise ToolError(f"no run {rid}")
    return await read_run(client, rid)


async def serve_stdio(url: str, *, message_cap: int = MESSAGE_CAP) -> None:
    client = await Client.connect(url)
    try:
        await build(client, message_cap=message_cap).run_stdio_async()
    finally:
        await client.close()


ASGIApp = Callable[
    [MutableMapping[str, Any], Callable[[], Awaitable[Any]], Callable[[Any], Awaitable[None]]],
    Awaitable[None],
]


def require_token(app: ASGIApp, client: Client) -> ASGIApp:
    """Wrap an ASGI app: HTTP requests without a valid bearer token get a 401."""

    async def guarded(
        scope: MutableMapping[str, Any],
        receive: Callable[[], Awaitable[Any]],
        send: Callable[[Any], Awaitable[None]],
    ) -> None:
        if scope["type"] == "http":
            headers = dict(scope.get("headers") or [])
            header = headers.get(b"authorization", b"").decode(errors="replace")
            scheme, _, token = header.partition(" ")
            ok = scheme.lower() == "bearer" and await authenticate(client.pool, token.strip())
            if not ok:
                body = b'{"error": "send Authorization: Bearer <token> (toren tokens create)"}'
                await send(
                    {
                        "type": "http.response.start",
                        "status": 401,
                        "headers": [
                            (b"content-type", b"application/json"),
                            (b"www-authenticate", b"Bearer"),
                        ],
                    }
                )
                await send({"type": "http.response.body", "body": body})
                return
        await app(scope, receive, send)

    return guarded


@asynccontextmanager
async def serving_http(
    url: str, *, host: str, port: int, message_cap: int = MESSAGE_CAP
) -> AsyncIterator[str]:
    """Serve MCP over streamable HTTP at ``http://host:port/mcp`` while inside."""
    import uvicorn

    client = await Client.connect(url)
    mcp_server = build(client, message_cap=message_cap)
    app = require_token(mcp_server.streamable_http_app(host=host), client)
    config = uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="on")
    server = uvicorn.Server(config)
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(server.serve)
            while not server.started:  # noqa: ASYNC110  (uvicorn offers only this flag)
                await anyio.sleep(0.02)
            bound = server.servers[0].sockets[0].getsockname()[1]
            try:
                yield f"http://{host}:{bound}/mcp"
            finally:
                server.should_exit = True
    finally:
        await client.close()
