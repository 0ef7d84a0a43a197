"""``toren dev``: embedded Postgres, migrations, a worker and the demo, in one process."""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path
from types import ModuleType

import anyio
from rich.console import Console
from rich.text import Text

from toren._agents import agents_in
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
from toren.testing import AnthropicServer, ScriptedModel, load_script
from toren.testing._harness import SERVERS, providers_of

console = Console(stderr=True)


async def run_dev(
    settings: Settings,
    *,
    data_dir: Path | None,
    app: str | None,
    port: int = DEFAULT_PORT,
    model_script: str | None = None,
) -> None:
    """Start (or reuse) the embedded server, migrate, run a worker (and the demo) until Ctrl-C.

    With ``model_script`` (``MODULE:FN``, for ``app``), the app's agents talk to an offline
    model scripted by FN.

    Raises:
        ConfigError: ``model_script`` cannot be loaded (checked before anything starts).
    """
    from toren.supervisors.worker import run_worker  # the entry point that boots a worker

    scripted = load_script(model_script) if model_script else None
    if logging.getLogger().getEffectiveLevel() > logging.DEBUG:
        # The console polls the API every two seconds: its access log would drown the rest
        # (`toren serve` logs every request; `toren --log-level DEBUG dev` shows them here).
        logging.getLogger("toren.http.access").setLevel(logging.WARNING)
    module = load_app(app, settings) if app is not None else None  # its errors before anything
    data_dir = _data_dir(settings, data_dir)
    with claimed(settings.home, data_dir):
        if data_dir is not None:
            forget_dead_handles(data_dir)
        progress = _Progress()
        with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            try:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(progress.stop_on_signal, signals, tg.cancel_scope)
                    async with contextlib.AsyncExitStack() as stack:
                        url = await _database(stack, settings, data_dir)
                        base = await _start_api(stack, url, port, ServerOptions.of(settings))
                        if module is None:
                            banner = await _start_demo(stack, url, settings)
                        else:
                            from toren.cli import log_boot_checks, preload_providers

                            banner = Text()
                            if scripted is not None:  # before the boot checks: they look for keys
                                banner = await _start_offline(stack, module, scripted)
                            log_boot_checks(module, settings)
                            preload_providers(module)
                        async with anyio.create_task_group() as worker:
                            await worker.start(run_worker, settings, url)
                            record = DevRecord(
                                pid=os.getpid(),
                                database_url=url,
                                api_url=base,
                                data_dir=str(data_dir) if data_dir else None,
                            )
                            write_record(settings.home, record)
                            stack.callback(remove_record, settings.home, record.pid)
                            progress.up = True
                            console.print(banner, highlight=False)
                    tg.cancel_scope.cancel()  # the worker drained: stop watching for signals
            except Exception:
                if not progress.interrupted:
                    raise
                # Ctrl-C reached Postgres's own tools too (a terminal signals the whole process
                # group): what failed after it is its consequence, not news.
                log.debug("stopped by a signal while starting", exc_info=True)
    if progress.interrupted and not progress.up:
        console.print("toren dev: interrupted while starting; stopped (nothing left running)")
        return INTERRUPTED
    console.print("toren dev: stopped")
    return 0


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


async def _start_offline(
    stack: contextlib.AsyncExitStack, module: ModuleType, scripted: ScriptedModel
) -> None:
    """One local model server per provider the app's agents use, each answering from
    ``scripted``; the SDKs are pointed at them through the environment."""
    where = []
    for provider in providers_of(module):
        server = await stack.enter_async_context(SERVERS[provider](scripted))
        os.environ.update(server.env())
        where.append(f"{provider} at {server.base_url}")
    agents = ", ".join(sorted(agents_in(module))) or "none"
    banner = Text.assemble(
        ("toren dev", "bold"),
        ": agents ",
        plain(agents),
        " run on an ",
        ("OFFLINE model", "bold"),
        " scripted by ",
        plain(scripted.name),
        f" ({', '.join(where) or 'no provider used'}): no provider is called, nothing is paid.\n"
        "In another terminal: toren run AGENT TEXT --wait, then toren jobs show RUN",
    )
    console.print(banner, soft_wrap=True)


async def _start_demo(stack: contextlib.AsyncExitStack, url: str, settings: Settings) -> None:
    from toren import demo
    from toren.cli import preload_providers

    preload_providers(load_app("toren.demo", settings))
    if os.environ.get("ANTHROPIC_API_KEY"):
        model = "Anthropic (ANTHROPIC_API_KEY is set)"
    else:
        offline = await stack.enter_async_context(
            AnthropicServer(ScriptedModel(demo.demo_model, name="toren.demo:demo_model"))
        )
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
