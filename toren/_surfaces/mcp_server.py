"""The MCP server: list, read, start and steer runs from Claude or any MCP client.

Over stdio (``toren mcp``) the caller is the local OS user (a principal of kind ``os_user``,
from the process's uid); over streamable HTTP (``toren mcp --http``) every request needs an API
token, whose scopes govern the tools (``read`` to list and read, ``operate`` to start and send,
``approve`` to decide). Everything done here is recorded with ``via: mcp``.

Deciding is off unless the server is started with ``allow_decisions``: an LLM client that reads
runs reads text an attacker may have written (a web page a tool fetched, a message), and the
same client able to approve would turn a prompt injection into an approval.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from contextlib import asynccontextmanager
from typing import Any

import anyio
from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ToolError as SDKToolError

from toren._agent.principal import Principal
from toren._core.client import AskError, Client
from toren._core.errors import ActorNotLive, UnknownActor
from toren._core.json_text import safe_text
from toren._surfaces.http.guard import FailedAuth
from toren._surfaces.tokens import SCOPES, Access, TokenCache
from toren._version import __version__
from toren.runs import (
    DECISION_WAIT,
    MESSAGE_CAP,
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
from toren.runs.listing import list_runs as _list_runs

log = logging.getLogger("toren.mcp")


class ToolError(SDKToolError):
    """Reported to the MCP client as a tool error, with this message (the SDK reports any
    other exception as a crash, without its message)."""


def build(
    client: Client,
    *,
    message_cap: int = MESSAGE_CAP,
    allow_decisions: bool = False,
    tokens: TokenCache | None = None,
) -> MCPServer:
    """An MCP server whose tools act on ``client``'s database; ``approve`` and ``deny`` exist
    only with ``allow_decisions``."""
    tokens = tokens or TokenCache()
    decisions = ", approve or deny what it waits for" if allow_decisions else ""
    server: MCPServer = MCPServer(
        "toren",
        version=__version__,
        instructions="Toren runs durable LLM agents. List runs, read one, start one, send it a "
        f"message{decisions}.",
    )

    async def caller(ctx: Context, scope: str, agent: str | None = None) -> Access:
        """Who calls (the OS user over stdio, the token over HTTP), if it may use ``scope``
        (on runs of ``agent``)."""
        try:
            headers = ctx.headers
        except ValueError:  # called in this process, not over a transport: as over stdio
            headers = None
        if headers is None:
            who = Principal.os_user("mcp")
            return Access(principal=who, scopes=frozenset(SCOPES))
        token = headers.get("authorization", "").partition(" ")[2].strip()
        access = await tokens.authenticate(client.pool, token, via="mcp")
        if access is None:  # the HTTP layer already refused it; a revocation in between
            raise ToolError("the token is no longer valid")
        if not access.allows(scope):
            have = ", ".join(sorted(access.scopes))
            raise ToolError(f"forbidden: this token lacks the {scope!r} scope (it has: {have})")
        if agent is not None and not access.may_write(agent):
            raise ToolError(f"forbidden: this token may not act on runs of agent {agent!r}")
        return access

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
        agent: str, input: str, ctx: Context, idempotency_key: str | None = None
    ) -> dict[str, Any]:
        """Start a run of an agent on an input; returns its id."""
        access = await caller(ctx, "operate", agent)
        try:
            await check_served(client, agent)
            rid = await start_run(
                client,
                agent,
                input,
                idempotency_key=idempotency_key,
                cap=message_cap,
                by=access.principal,
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
            await say(client, rid, text, by=access.principal, cap=message_cap)
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

    if not allow_decisions:
        return server

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


async def serve_stdio(
    url: str, *, message_cap: int = MESSAGE_CAP, allow_decisions: bool = False
) -> None:
    client = await Client.connect(url)
    try:
        server = build(client, message_cap=message_cap, allow_decisions=allow_decisions)
        await server.run_stdio_async()
    finally:
        await client.close()


ASGIApp = Callable[
    [MutableMapping[str, Any], Callable[[], Awaitable[Any]], Callable[[Any], Awaitable[None]]],
    Awaitable[None],
]


def require_token(
    app: ASGIApp, client: Client, tokens: TokenCache, failed: FailedAuth | None = None
) -> ASGIApp:
    """Wrap an ASGI app: HTTP requests without a valid bearer token get a 401; an address
    past the failed-authentication limit gets a 429."""
    failed = failed or FailedAuth(20)

    async def guarded(
        scope: MutableMapping[str, Any],
        receive: Callable[[], Awaitable[Any]],
        send: Callable[[Any], Awaitable[None]],
    ) -> None:
        if scope["type"] == "http":
            address = str((scope.get("client") or ("?",))[0])
            given = [v for k, v in scope.get("headers") or [] if k.lower() == b"authorization"]
            if len(given) > 1:  # which one counts would depend on who reads it
                await _refuse(send, 401, b"send one Authorization header")
                return
            header = given[0].decode(errors="replace") if given else ""
            scheme, _, token = header.partition(" ")
            retry_after = failed.blocked(address)
            if retry_after is not None:
                await _refuse(send, 429, b"too many failed authentications", retry_after)
                return
            ok = scheme.lower() == "bearer" and await tokens.authenticate(
                client.pool, token.strip(), via="mcp"
            )
            if not ok:
                if header:
                    failed.failed(address)
                await _refuse(
                    send, 401, b"send Authorization: Bearer <token> (toren tokens create)"
                )
                return
        await app(scope, receive, send)

    return guarded


async def _refuse(
    send: Callable[[Any], Awaitable[None]], status: int, why: bytes, retry_after: int = 0
) -> None:
    headers = [(b"content-type", b"application/json"), (b"cache-control", b"no-store")]
    if status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    if retry_after:
        headers.append((b"retry-after", str(retry_after).encode()))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": b'{"error": "' + why + b'"}'})


@asynccontextmanager
async def serving_http(
    url: str,
    *,
    host: str,
    port: int,
    message_cap: int = MESSAGE_CAP,
    allow_decisions: bool = False,
    failed_auth_per_minute: int = 20,
) -> AsyncIterator[str]:
    """Serve MCP over streamable HTTP at ``http://host:port/mcp`` while inside."""
    import uvicorn

    client = await Client.connect(url)
    tokens = TokenCache()
    mcp_server = build(
        client, message_cap=message_cap, allow_decisions=allow_decisions, tokens=tokens
    )
    failed = FailedAuth(failed_auth_per_minute)
    app = require_token(mcp_server.streamable_http_app(host=host), client, tokens, failed)
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
