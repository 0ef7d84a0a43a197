"""``toren up``: migrations, a worker and the HTTP API and console in one process, on your
Postgres. It is the container image's default command (docker/Dockerfile).

Unlike ``toren dev`` it never starts an embedded Postgres and runs no demo: it needs
``TOREN_DATABASE_URL`` (or ``TOREN_DATABASE_URL_FILE``). SIGTERM drains the worker (the message
in hand finishes, leases are released) and then stops the API; ``/readyz`` answers 503 from the
moment the drain begins.
"""

from __future__ import annotations

import logging
from typing import Any

import click

from toren._cli.common import err, run_async
from toren._cli.serve import child_command, host_option, port_option, workers_option
from toren._core.errors import ConfigError
from toren._core.killpoints import arm as arm_kill_points
from toren._core.terminal import plain
from toren._settings import Settings

log = logging.getLogger("toren.up")


def register(main: click.Group) -> None:
    main.add_command(up)


@click.command()
@click.option("--app", envvar="TOREN_APP", help="Module defining your agents (MODULE[:ATTR]).")
@host_option
@port_option
@workers_option
@click.option("--max-actors", type=int, help="Cap on actors run at once by this worker.")
@click.option("--grace-seconds", type=float, help="Shutdown grace period (default 30).")
@click.option("--deploy-label", help="Added to the version shown by `toren workers`.")
@click.pass_context
@run_async
async def up(
    ctx: click.Context, /, app: str | None, host: str, port: int, workers: int, **overrides: Any
) -> None:
    """Run a worker, the API and console in one process. It applies the migrations
    first and runs against TOREN_DATABASE_URL (never an embedded Postgres) until SIGTERM.
    With --workers N the API is served by N more processes sharing the port (the worker
    stays in this one).

    GET /healthz says the process is alive; GET /readyz answers 200 once the schema is migrated
    and this process's worker is registered, 503 with a reason otherwise (also while draining).
    Exit 2 without a database URL or with a bad configuration.
    """
    # Here, not at the top: the worker, the HTTP API and the agent layer are what `toren up`
    # runs, and what every other command (each imports this module) does without.
    from toren._cli.boot import boot_app
    from toren._core.db import connect
    from toren._core.migrate import migrate
    from toren._surfaces.http import ServerOptions
    from toren._surfaces.serve import serving
    from toren.supervisors.worker import Worker, run_worker  # the entry point of a worker

    root = ctx.find_root()
    settings = Settings.load(config_file=root.params.get("config"), **overrides)
    url = settings.database_url
    if not url:
        raise ConfigError(
            "toren up needs TOREN_DATABASE_URL (or TOREN_DATABASE_URL_FILE): it never starts "
            "an embedded Postgres",
            hint="Set TOREN_DATABASE_URL=postgresql://USER:PASSWORD@HOST/DB; for a laptop "
            "without a Postgres, `toren dev` runs one for you.",
        )
    try:
        arm_kill_points()
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
    boot_app(app, settings)  # without an app, it warns that this worker runs no agents
    conn = await connect(url)
    try:
        applied = await migrate(conn)
    finally:
        await conn.close()
    log.info("schema ready (%d migration(s) applied now)", len(applied))
    if host not in ("127.0.0.1", "localhost", "::1"):
        err.print(
            plain(
                f"listening on {host}: anyone who can reach it and holds a token can drive "
                "runs; put TLS in front of it."
            )
        )
    started: list[Worker] = []

    def probe() -> Any:
        return started[0].state() if started else (None, "starting")

    options = ServerOptions.of(settings)
    if workers == 1:
        async with serving(url, host=host, port=port, options=options, worker=probe) as base:
            log.info("API and console on %s; readiness at %s/readyz", base, base)
            await run_worker(settings, url, on_started=started.append)
    else:
        from toren._surfaces.processes import api_processes

        command = child_command(ctx, host, "up")
        async with api_processes(command, count=workers, host=host, port=port, worker=probe) as (
            _processes,
            bound,
        ):
            base = f"http://{host}:{bound}"
            log.info(
                "API and console on %s in %d processes; readiness at %s/readyz",
                base,
                workers,
                base,
            )
            await run_worker(settings, url, on_started=started.append)
    log.info("stopped")
