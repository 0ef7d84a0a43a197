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
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping, Sequence
from contextlib import asynccontextmanager
from typing import Any, Protocol

import anyio
import attrs
from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ToolError as SDKToolError

from toren._agent.principal import Principal
from toren._core.client import Client
from toren._core.surfaces import Surfaces, resolved
from toren._surfaces.http.guard import FailedAuth
from toren._surfaces.kinds import SURFACES
from toren._surfaces.tokens import SCOPES, Access, TokenCache
from toren._version import __version__
from toren.runs import MESSAGE_CAP

log = logging.getLogger("toren.mcp")


class ToolError(SDKToolError):
    """Reported to the MCP client as a tool error, with this message (the SDK reports any
    other exception as a crash, without its message)."""


class Caller(Protocol):
    """Who calls a tool (the OS user over stdio, the token over HTTP), if it may use
    ``scope`` (on runs of ``agent``); a :class:`ToolError` if not."""

    async def __call__(self, ctx: Context, scope: str, agent: str | None = None) -> Access: ...


@attrs.frozen(kw_only=True)
class McpTools:
    """What a kind adds its MCP tools with (its surfaces' ``mcp``: ``(tools) -> None``).

    Attributes:
        server: The server to add them to (``@tools.server.tool()``).
        client: The client over the database the tools act on.
        caller: Checks who calls and what they may do; every tool awaits it first.
        message_cap: The largest message a tool may send, in bytes.
        allow_decisions: Whether tools that decide (approve, deny) are offered.
    """

    server: MCPServer
    client: Client
    caller: Caller
    message_cap: int
    allow_decisions: bool


def build(
    client: Client,
    *,
    message_cap: int = MESSAGE_CAP,
    allow_decisions: bool = False,
    tokens: TokenCache | None = None,
    kinds: Sequence[Surfaces] = SURFACES,
) -> MCPServer:
    """An MCP server whose tools act on ``client``'s database: those of each of ``kinds``
    (Toren's own unless told); the run kind's ``approve`` and ``deny`` exist only with
    ``allow_decisions``."""
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

    tools = McpTools(
        server=server,
        client=client,
        caller=caller,
        message_cap=message_cap,
        allow_decisions=allow_decisions,
    )
    for install in resolved(kinds, "mcp"):  # the run kind's tools, and any other kind's
        install(tools)
    return server


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
    failed = failed or FailedAuth(client.pool, "mcp", 20)

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
            token = token.strip() if scheme.lower() == "bearer" else ""
            # A token that passed here lately is checked without a statement, and counted only
            # if it fails now; any other credential is an attempt, counted as a failure before
            # it is checked (the counts are shared by every server process) and uncounted if it
            # passes. No credential at all is no attempt: it is refused without a statement.
            attempt = await failed.attempt(address) if header and not tokens.known(token) else None
            if attempt is not None and attempt.retry_after is not None:
                await _refuse(send, 429, b"too many failed authentications", attempt.retry_after)
                return
            ok = bool(token) and await tokens.authenticate(client.pool, token, via="mcp")
            if not ok:
                retry_after = await failed.failed(address) if header and attempt is None else None
                if retry_after is not None:
                    await _refuse(send, 429, b"too many failed authentications", retry_after)
                    return
                await _refuse(
                    send, 401, b"send Authorization: Bearer <token> (toren tokens create)"
                )
                return
            if attempt is not None:
                await failed.passed(attempt)
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
    failed = FailedAuth(client.pool, "mcp", failed_auth_per_minute)
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
