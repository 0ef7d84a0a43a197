"""``toren dev``: embedded Postgres, migrations, a worker and the demo, in one process."""

from __future__ import annotations

from pathlib import Path

import anyio
from rich.console import Console

from toren._app import load_app
from toren._client import Client
from toren._config import Settings
from toren._db import EmbeddedPostgres, connect, record_dev_url
from toren._errors import ActorAlreadyExists
from toren._migrate import migrate

console = Console(stderr=True)


async def run_dev(settings: Settings, *, data_dir: Path | None, app: str | None) -> None:
    """Start (or reuse) the embedded server, migrate, run a worker until Ctrl-C."""
    from supervisors.worker import run_worker  # the entry point that boots a worker

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
    load_app(app or "toren.demo")
    if app is None:
        from toren.demo import Beat, Heartbeat

        async with await Client.connect(url, pool_size=1) as client:
            try:
                if await client.spawn(Heartbeat, "demo/heartbeat"):
                    await client.send("demo/heartbeat", Beat())
            except ActorAlreadyExists:
                pass
    console.print(
        "[bold]toren dev[/bold] is running (Ctrl-C to stop). In another terminal:\n"
        "  toren workers            live workers, versions, leases, memory\n"
        "  toren deadletters        messages actors gave up on\n"
        "The demo actor demo/heartbeat beats every 5 s on a durable timer; kill this process\n"
        "and start it again: the count goes on from its journal."
    )
    try:
        await run_worker(settings, url)
    finally:
        if server is not None:
            server.stop()
