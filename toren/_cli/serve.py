"""``toren serve`` and ``toren tokens ...``: the HTTP API and console, and their credentials."""

from __future__ import annotations

import logging
import os
import signal
import sys
from collections.abc import Callable

import attrs
import click
from rich.table import Table

from toren._cli.common import Unshown, database_url, err, out, run_async
from toren._core.errors import ConfigError
from toren._core.killpoints import arm as arm_kill_points
from toren._core.terminal import plain
from toren._settings import Settings
from toren._surfaces import DEFAULT_HOST, DEFAULT_PORT, MOST_PROCESSES

log = logging.getLogger("toren.http")


def _settings(ctx: click.Context) -> Settings:
    root = ctx.find_root()
    settings: Settings = root.obj["settings"]
    return settings


# Where the API listens: `toren serve` and `toren up` (the image sets TOREN_HOST=0.0.0.0).
host_option = click.option(
    "--host",
    envvar="TOREN_HOST",
    default=DEFAULT_HOST,
    show_default=True,
    help="Address to listen on (env TOREN_HOST; the image sets 0.0.0.0).",
)
port_option = click.option(
    "--port",
    envvar="TOREN_PORT",
    default=DEFAULT_PORT,
    show_default=True,
    type=Unshown(click.IntRange(0, 65535), "a port number, 0 to 65535"),
    help="Port, 0 to 65535 (env TOREN_PORT).",
)

# How many API processes share the port: `toren serve` and `toren up`.
workers_option = click.option(
    "--workers",
    envvar="TOREN_API_WORKERS",
    default=1,
    show_default=True,
    type=Unshown(
        click.IntRange(1, MOST_PROCESSES), f"a number of processes, 1 to {MOST_PROCESSES}"
    ),
    help=f"API server processes sharing the port, 1 to {MOST_PROCESSES} (env "
    "TOREN_API_WORKERS); 1 serves in this process. Not actor workers.",
)
# Set by the parent of `--workers N` on each process it starts: which command it serves for.
child_option = click.option(
    "--process-of", type=click.Choice(["serve", "up"]), hidden=True, default=None
)


def child_command(ctx: click.Context, host: str, of: str) -> Callable[[int], list[str]]:
    """The command line of one API process of ``--workers N`` (it serves ``port``): this
    ``toren`` with the same ``--config`` and ``--log-level``."""
    root = ctx.find_root().params
    top = [sys.executable, "-m", "toren"]
    if root.get("config") is not None:
        top += ["--config", str(root["config"])]
    if root.get("log_level") is not None:
        top += ["--log-level", str(root["log_level"])]

    def command(port: int) -> list[str]:
        return [*top, "serve", "--host", host, "--port", str(port), "--process-of", of]

    return command


def warn_if_public(host: str) -> None:
    if host not in ("127.0.0.1", "localhost", "::1"):
        err.print(  # the host as text: TOREN_HOST may hold anything, [/x] too
            plain(f"listening on {host}:", style="yellow"),
            plain(
                "anyone who can reach it and holds a token can drive runs; put TLS in front of it."
            ),
        )


def register(main: click.Group) -> None:
    main.add_command(serve)
    main.add_command(tokens)
    main.add_command(mcp)


@click.command()
@click.option("--http", "over_http", is_flag=True, help="Serve streamable HTTP instead of stdio.")
@click.option("--host", default=DEFAULT_HOST, show_default=True)
@click.option("--port", default=8421, show_default=True, type=click.IntRange(0, 65535))
@click.option(
    "--allow-decisions",
    is_flag=True,
    help="Offer approve and deny. Off by default: a model reading runs reads text an attacker "
    "may have written, and should not also be able to approve.",
)
@click.pass_context
@run_async
async def mcp(
    ctx: click.Context, over_http: bool, host: str, port: int, allow_decisions: bool
) -> None:
    """Serve the MCP server, over stdio or streamable HTTP. Over stdio for a local client
    such as Claude Desktop, or over streamable HTTP at /mcp, where every request needs an API
    token (its scopes govern the tools). Approving and denying are offered only with
    --allow-decisions."""
    import anyio

    from toren._surfaces.mcp_server import serve_stdio, serving_http

    settings = _settings(ctx)
    url, cap = database_url(settings), settings.max_message_bytes
    if not over_http:
        await serve_stdio(url, message_cap=cap, allow_decisions=allow_decisions)
        return
    async with serving_http(
        url,
        host=host,
        port=port,
        message_cap=cap,
        allow_decisions=allow_decisions,
        failed_auth_per_minute=settings.failed_auth_per_minute,
    ) as where:
        err.print(f"MCP over streamable HTTP at {where} (Authorization: Bearer <token>)")
        await anyio.sleep_forever()


@click.command()
@host_option
@port_option
@workers_option
@child_option
@click.pass_context
@run_async
async def serve(
    ctx: click.Context, host: str, port: int, workers: int, process_of: str | None
) -> None:
    """Serve the HTTP API and the web console. Every route but /healthz needs a token.
    With --workers N, N processes share the port (see docs/operations.md)."""
    import anyio

    from toren._surfaces.http import ServerOptions
    from toren._surfaces.serve import serve_as_child, serve_forever

    if process_of is None:
        warn_if_public(host)
    try:
        arm_kill_points()  # the webhook route's kill point (chaos and the webhook crash test)
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
    settings = _settings(ctx)
    url = database_url(settings)
    options = ServerOptions.of(settings)
    if process_of is not None:
        shared = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
        await serve_as_child(
            url,
            host=host,
            port=port,
            options=attrs.evolve(options, metrics_dir=shared),
            of_up=process_of == "up",
        )
        return
    if workers == 1:
        await serve_forever(url, host=host, port=port, options=options)
        return
    from toren._surfaces.processes import api_processes

    command = child_command(ctx, host, "serve")
    async with api_processes(command, count=workers, host=host, port=port) as (_processes, bound):
        log.info("API and console on http://%s:%d in %d processes", host, bound, workers)
        with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async for signum in signals:
                log.info("%s: stopping the API processes", signal.Signals(signum).name)
                break
    log.info("stopped")


@click.group()
def tokens() -> None:
    """Create, list and revoke API tokens."""


@tokens.command("create")
@click.argument("name")
@click.option(
    "--scope",
    "scope_args",
    multiple=True,
    metavar="SCOPE[,SCOPE]",
    help="read; operate (start, send, cancel, retry); approve (decide). Repeat or separate "
    "with commas for several. Default: read only.",
)
@click.option(
    "--agent",
    "agent_args",
    multiple=True,
    metavar="NAME[,NAME]",
    help="Start, steer and decide only runs of this agent (repeat, or separate with commas).",
)
@click.option("--expires", help="Lifetime, for example 12h or 30d (default: until revoked).")
@click.pass_context
@run_async
async def create(
    ctx: click.Context,
    name: str,
    scope_args: tuple[str, ...],
    agent_args: tuple[str, ...],
    expires: str | None,
) -> None:
    """Create a token named NAME. Unique among live tokens (events record its id), it is
    printed once, here; only its hash is stored."""
    from toren._agent.agents import parse_duration
    from toren._core.db import connect
    from toren._surfaces.tokens import SCOPES, create_token
    from toren.runs import AGENT_NAME

    scopes = tuple(s.strip() for arg in scope_args for s in arg.split(",") if s.strip())
    unknown = sorted(set(scopes) - set(SCOPES))
    if unknown:
        raise click.BadParameter(
            f"unknown scope(s) {', '.join(unknown)}; choose from {', '.join(SCOPES)}",
            param_hint="--scope",
        )
    agents = tuple(a.strip() for arg in agent_args for a in arg.split(","))
    bad = [a for a in agents if not AGENT_NAME.fullmatch(a)]
    if bad:
        raise click.BadParameter(
            f"not an agent name: {', '.join(repr(a) for a in bad)} "
            "(1 to 100 letters, digits, _ . -)",
            param_hint="--agent",
        )
    lifetime = None
    if expires is not None:
        try:
            lifetime = parse_duration(expires)
        except ConfigError as exc:
            raise click.BadParameter(str(exc), param_hint="--expires") from None
    if not scopes:
        err.print("note: no --scope given: the token may only read (add --scope operate/approve)")
    conn = await connect(database_url(_settings(ctx)))
    try:
        token_id, token = await create_token(
            conn,
            name,
            scopes=scopes or ("read",),
            agents=agents or None,
            expires_in=lifetime,
        )
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None
    finally:
        await conn.close()
    granted = ", ".join(s for s in SCOPES if s in (scopes or ("read",)))
    limits = f"; agents {', '.join(agents)}" if agents else ""
    until = f"; expires in {expires}" if expires else ""
    err.print(
        plain(
            f"token {token_id} ({name}) created, scopes {granted}{limits}{until}; shown only now:"
        )
    )
    click.echo(token)


@tokens.command("list")
@click.pass_context
@run_async
async def list_(ctx: click.Context) -> None:
    """List tokens (never their secrets)."""
    from toren._core.db import connect
    from toren._surfaces.tokens import list_tokens

    conn = await connect(database_url(_settings(ctx)))
    try:
        rows = await list_tokens(conn)
    finally:
        await conn.close()
    table = Table(title=f"{len(rows)} token(s)")
    for col in ("id", "name", "scopes", "agents", "created", "expires", "last used", "revoked"):
        table.add_column(col)
    for r in rows:
        table.add_row(
            plain(r.id),
            plain(r.name),
            plain(" ".join(r.scopes)),
            plain(" ".join(r.agents) if r.agents is not None else "all"),
            r.created_at.isoformat(timespec="seconds"),
            r.expires_at.isoformat(timespec="seconds") if r.expires_at else "-",
            r.last_used_at.isoformat(timespec="seconds") if r.last_used_at else "-",
            r.revoked_at.isoformat(timespec="seconds") if r.revoked_at else "-",
        )
    out.print(table)


@tokens.command("revoke")
@click.argument("token_id")
@click.pass_context
@run_async
async def revoke(ctx: click.Context, token_id: str) -> None:
    """Revoke the token TOKEN_ID and end its console sessions. TOKEN_ID as `tokens list`
    shows it."""
    from toren._core.db import connect
    from toren._surfaces.tokens import revoke_token

    conn = await connect(database_url(_settings(ctx)))
    try:
        done = await revoke_token(conn, token_id)
    finally:
        await conn.close()
    if not done:
        raise click.ClickException(f"no live token {token_id!r}")
    out.print(plain(f"revoked {token_id}"))
