"""Serving the HTTP API and console (``toren serve``, and inside ``toren dev``)."""

from __future__ import annotations

import logging
import os
import signal
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio
from aiohttp import web

from toren._core.client import Client
from toren._core.errors import ConfigError
from toren._surfaces import DEFAULT_HOST, DEFAULT_PORT
from toren._surfaces.http import ServerOptions, create_app
from toren._surfaces.http.readiness import WorkerProbe

log = logging.getLogger("toren.http")


@asynccontextmanager
async def serving(
    url: str,
    *,
    host: str = DEFAULT_HOST,
    port: int = DEFAULT_PORT,
    options: ServerOptions | None = None,
    worker: WorkerProbe | None = None,
    reuse_port: bool = False,
) -> AsyncIterator[str]:
    """Serve the API and console on ``host:port`` while inside; yields the base URL.
    ``worker`` reports the worker this process runs too, for ``/readyz``; ``reuse_port`` listens
    with ``SO_REUSEPORT`` beside the other processes of ``toren serve --workers N``.

    Raises:
        ConfigError: the port cannot be bound.
    """
    options = options or ServerOptions()
    # At 50 requests in flight, 5 connections (a client's default) made requests queue for one:
    # 10 answered about 15% more reads per second, at a p99 of 20 ms instead of 26 (bench api).
    client = await Client.connect(url, pool_size=options.pool_size)
    runner = web.AppRunner(
        create_app(client, options, worker=worker), access_log=None, handle_signals=False
    )
    try:
        await runner.setup()
        site = web.TCPSite(runner, host, port, reuse_port=reuse_port or None)
        try:
            await site.start()
        except OSError as exc:
            raise ConfigError(
                f"cannot listen on {host}:{port}: {exc.strerror}",
                hint="Pick another port with --port, or stop what uses this one.",
            ) from exc
        bound = runner.addresses[0][1]
        base = f"http://{host}:{bound}"
        if reuse_port:  # one of several: the parent says where they serve
            log.debug("API process %d on %s", os.getpid(), base)
        else:
            log.info("API and console on %s (openapi: %s/openapi.json)", base, base)
        yield base
    finally:
        with anyio.CancelScope(shield=True):
            await runner.cleanup()
            await client.close()


async def serve_forever(
    url: str, *, host: str, port: int, options: ServerOptions | None = None
) -> None:
    """Serve until SIGTERM or SIGINT, then stop as :func:`serving` does: open event streams are
    told the server is stopping, requests in hand are answered, and the access log's last lines
    (kept a tenth of a second before they are written) are written. A second signal while it
    stops gets Python's own handling again (SIGTERM ends the process at once)."""
    async with serving(url, host=host, port=port, options=options):
        # SIGTERM is how a container or a service manager stops a process: its default action
        # ends the process on the spot, with nothing of the above.
        with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async for signum in signals:
                log.info("%s: stopping", signal.Signals(signum).name)
                break


async def serve_as_child(
    url: str, *, host: str, port: int, options: ServerOptions, of_up: bool
) -> None:
    """Serve as one of the processes of ``toren serve --workers N`` (``toren up`` when
    ``of_up``: then ``/readyz`` reports the parent's worker, as the parent sends it down this
    process's standard input). Stops as :func:`serve_forever` does, on a signal or when the
    parent is gone (standard input closed). See :mod:`toren._surfaces.processes`."""
    from toren._surfaces.processes import ParentSays

    parent = ParentSays()
    async with (
        serving(
            url,
            host=host,
            port=port,
            options=options,
            worker=parent.probe if of_up else None,
            reuse_port=True,
        ),
        anyio.create_task_group() as tg,
    ):

        async def until_parent_gone() -> None:
            await parent.listen(sys.stdin.fileno())
            log.warning("the parent process is gone: stopping")
            tg.cancel_scope.cancel()

        tg.start_soon(until_parent_gone)
        with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async for signum in signals:
                log.debug("API process %d: %s: stopping", os.getpid(), signal.Signals(signum).name)
                break
        # One signal stops it; the parent's second is SIGKILL. A second SIGTERM (systemd
        # signals every process of its unit, then the parent signals each child) must not cut
        # the streams and requests it is finishing.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        tg.cancel_scope.cancel()
