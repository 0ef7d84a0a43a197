"""``toren dev``: embedded Postgres, migrations, a worker and the demo, in one process."""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path

import anyio
from rich.console import Console

from toren._app import load_app
from toren._client import Client
from toren._config import Settings
from toren._db import EmbeddedPostgres, connect, record_dev_url
from toren._errors import ConfigError
from toren._http import ServerOptions
from toren._migrate import migrate
from toren._serve import DEFAULT_PORT, serving
from toren._terminal import plain
from toren.runs import start_run
from toren.testing import AnthropicServer

console = Console(stderr=True)


async def run_dev(
    settings: Settings, *, data_dir: Path | None, app: str | None, port: int = DEFAULT_PORT
) -> None:
    """Start (or reuse) the embedded server, migrate, run a worker (and the demo) until Ctrl-C."""
    from toren.supervisors.worker import run_worker  # the entry point that boots a worker

    if logging.getLogger().getEffectiveLevel() > logging.DEBUG:
        # The console polls the API every two seconds: its access log would drown the rest
        # (`toren serve` logs every request; `toren --log-level DEBUG dev` shows them here).
        logging.getLogger("toren.http.access").setLevel(logging.WARNING)
    url = settings.database_url
    server = None
    if url is None:
        data_dir = data_dir or settings.home / "pgdata"
        console.print(f"starting embedded Postgres in {data_dir} ...")
        server = await anyio.to_thread.run_sync(lambda: EmbeddedPostgres(data_dir))
        url = server.url
    record_dev_url(settings.home, url)
    conn = await connect(url)
    try:
        applied = await migrate(conn)
    finally:
        await conn.close()
    console.print(f"schema ready ({len(applied)} migration(s) applied now)")
    try:
        async with contextlib.AsyncExitStack() as stack:
            await _start_api(stack, url, port, ServerOptions.of(settings))
            if app is None:
                await _start_demo(stack, url, settings)
            else:
                from toren.cli import log_boot_checks, preload_providers

                module = load_app(app, settings)
                log_boot_checks(module, settings)
                preload_providers(module)
            await run_worker(settings, url)
    finally:
        if server is not None:
            server.stop()


async def _start_api(
    stack: contextlib.AsyncExitStack, url: str, port: int, options: ServerOptions
) -> None:
    try:
        base = await stack.enter_async_context(serving(url, port=port, options=options))
    except ConfigError as exc:
        console.print(plain("no API or console:", style="yellow"), plain(str(exc)))
        return
    console.print(
        f"API and console on {base} (sign in with a token: "
        "`toren tokens create NAME --scope read,approve`)",
        highlight=False,
    )


async def _start_demo(stack: contextlib.AsyncExitStack, url: str, settings: Settings) -> None:
    from toren import demo
    from toren.cli import preload_providers

    preload_providers(load_app("toren.demo", settings))
    if os.environ.get("ANTHROPIC_API_KEY"):
        model = "Anthropic (ANTHROPIC_API_KEY is set)"
    else:
        offline = await stack.enter_async_context(AnthropicServer(demo.demo_model))
        os.environ.update(offline.env())
        model = (
            f"the OFFLINE DEMO MODEL at {offline.base_url} (set ANTHROPIC_API_KEY for a real one)"
        )
    async with await Client.connect(url, pool_size=1) as client:
        run_id = await start_run(
            client, demo.concierge.name, demo.DEMO_INPUT, idempotency_key="toren-dev-demo"
        )
    console.print(
        "[bold]toren dev[/bold] is running (Ctrl-C to stop). "
        f"Agent [bold]concierge[/bold] on {model}.\n"
        f"Demo run {run_id} will park, asking to approve a $80 refund. In another terminal:\n"
        f"  toren jobs tail {run_id}      follow it live\n"
        f"  toren jobs approve {run_id}   approve the refund (or deny it: jobs deny)\n"
        f"  toren jobs show {run_id}      its timeline and cost receipt\n"
        "  toren workers                  live workers, leases, memory",
        highlight=False,
    )
