"""``toren dev``: embedded Postgres, migrations, a worker and the demo, in one process."""

from __future__ import annotations

import contextlib
import logging
import os
import shlex
import signal
from collections.abc import AsyncIterator
from functools import partial
from pathlib import Path
from types import ModuleType

import anyio
import attrs
from rich.console import Console
from rich.text import Text

from toren._agent.agents import agents_in
from toren._agent.app import load_app, loaded_agents
from toren._cli.boot import log_boot_checks
from toren._cli.common import path_hint, toren_command
from toren._cli.dev_state import (
    DevRecord,
    claimed,
    forget_dead_handles,
    remove_record,
    write_record,
)
from toren._core.client import Client
from toren._core.db import EmbeddedPostgres, connect
from toren._core.errors import InternalError
from toren._core.killpoints import kill_point
from toren._core.migrate import migrate
from toren._core.terminal import plain
from toren._settings import Settings
from toren._surfaces import DEFAULT_PORT
from toren._surfaces.http import ServerOptions
from toren._surfaces.serve import serving
from toren.runs import RunState, read_run, start_run
from toren.testing import AnthropicServer, ScriptedModel, load_script
from toren.testing._harness import SERVERS, providers_of

# Not wrapped to the width of a terminal that is not there: piped or logged, a command printed
# on one line stays whole.
console = Console(stderr=True, soft_wrap=True)
log = logging.getLogger("toren.dev")

INTERRUPTED = 130  # the exit status of a `toren dev` stopped by Ctrl-C before it was up
# What the banner suggests once the demo run has ended (the quickstart's "More to try").
FOLLOW_UP = "Thanks! When will it arrive?"
ANOTHER_TASK = "Order A-17 is broken, refund please"


async def run_dev(
    settings: Settings,
    *,
    data_dir: Path | None,
    app: str | None,
    port: int = DEFAULT_PORT,
    model_script: str | None = None,
) -> int:
    """Start (or reuse) the embedded server, migrate, serve the API, run a worker (and the
    demo) until Ctrl-C or SIGTERM; the exit status.

    With ``model_script`` (``MODULE:FN``, for ``app``), the app's agents talk to an offline
    model scripted by FN.

    Once all of that is up, and only then, it records where it runs under ``settings.home``
    (:mod:`toren._cli.dev_state`), and removes the record when it stops. A signal while it starts
    stops what it started and returns :data:`INTERRUPTED` (130); one once it is up drains the
    worker, stops the rest and returns 0.

    Raises:
        ConfigError: ``model_script`` or ``app`` cannot be loaded (checked before anything
            starts), the embedded server does not start, or the port cannot be bound.
        DevAlreadyRunning: another ``toren dev`` holds this home or this data directory.
    """
    scripted = load_script(model_script) if model_script else None
    # Under toren dev an edited prompt must not park every run: agents that name no version
    # policy upgrade (toren.Settings.default_version_policy).
    settings = attrs.evolve(settings, default_version_policy="upgrade")
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
                    await _serve(settings, data_dir, port, module, scripted, progress)
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


async def _serve(
    settings: Settings,
    data_dir: Path | None,
    port: int,
    module: ModuleType | None,
    scripted: ScriptedModel | None,
    progress: _Progress,
) -> None:
    """Start everything in order, record where it runs once the worker is up, and stop it all
    (record first) once the worker has drained."""
    from toren.supervisors.worker import run_worker  # the entry point that boots a worker

    async with contextlib.AsyncExitStack() as stack:
        url = await _database(stack, settings, data_dir)
        base = await _start_api(stack, url, port, ServerOptions.of(settings))
        if module is None:
            banner = await _start_demo(stack, url, settings)
        else:
            banner = _app_banner(module)
            if scripted is not None:  # before the boot checks: they look for provider keys
                banner = await _start_offline(stack, module, scripted)
            log_boot_checks(module, settings)
        async with anyio.create_task_group() as tg:
            await tg.start(partial(run_worker, sandboxes=_has_sandboxes(module)), settings, url)
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


def _has_sandboxes(module: ModuleType | None) -> bool:
    """Whether an agent of ``module`` (the demo's without one) has a sandbox: only then does the
    worker ask Docker whether it answers."""
    if module is None:
        from toren import demo

        return demo.concierge.sandbox is not None
    return any(agent.sandbox is not None for agent in loaded_agents(module))


@attrs.define
class _Progress:
    """How far ``toren dev`` got, and whether a signal stopped it while it started."""

    up: bool = False
    interrupted: bool = False

    async def stop_on_signal(
        self, signals: AsyncIterator[signal.Signals], scope: anyio.CancelScope
    ) -> None:
        """Cancel ``scope`` at the first SIGINT or SIGTERM heard here (while starting; once up,
        the worker's own handler hears them and drains), then ignore the rest."""
        async for _ in signals:
            self.interrupted = True
            scope.cancel()
            return


async def _database(
    stack: contextlib.AsyncExitStack, settings: Settings, data_dir: Path | None
) -> str:
    """The database's URL, its schema migrated: the configured server, else the embedded one
    (stopped when ``stack`` closes)."""
    url = settings.database_url
    if url is None:
        if data_dir is None:
            raise InternalError("toren dev: no database URL and no data directory")
        where = data_dir
        console.print(plain(f"starting embedded Postgres in {where} ..."))
        started: list[EmbeddedPostgres] = []
        stack.callback(_stop_all, started)
        # A thread cannot be cancelled: a Ctrl-C meanwhile is acted on once it has returned,
        # and the server it started is stopped with the rest.
        await anyio.to_thread.run_sync(_start_embedded, where, started)
        url = started[0].url
    kill_point("dev.migrating")
    conn = await connect(url)
    try:
        applied = await migrate(conn)
    finally:
        await conn.close()
    console.print(f"schema ready ({len(applied)} migration(s) applied now)")
    return url


def _start_embedded(data_dir: Path, started: list[EmbeddedPostgres]) -> None:
    kill_point("dev.postgres_starting")
    started.append(EmbeddedPostgres(data_dir))


def _stop_all(servers: list[EmbeddedPostgres]) -> None:
    for server in servers:
        server.stop()


def _data_dir(settings: Settings, data_dir: Path | None) -> Path | None:
    """The embedded server's data directory, absolute; ``None`` with a configured database."""
    if settings.database_url is not None:
        return None
    return (data_dir or settings.home / "pgdata").expanduser().resolve()


async def _start_api(
    stack: contextlib.AsyncExitStack, url: str, port: int, options: ServerOptions
) -> str:
    """Serve the API and console until ``stack`` closes; their base URL.

    Raises:
        ConfigError: the port cannot be bound (``toren dev`` does not start without them).
    """
    base = await stack.enter_async_context(serving(url, port=port, options=options))
    console.print(  # a path (toren's own) is text, never markup
        plain(
            f"API and console on {base} (sign in with a token: "
            f"`{toren_command()} tokens create NAME --scope read,operate,approve`)"
        )
    )
    return base


async def _start_offline(
    stack: contextlib.AsyncExitStack, module: ModuleType, scripted: ScriptedModel
) -> Text:
    """One local model server per provider the app's agents use, each answering from
    ``scripted``; the SDKs are pointed at them through the environment."""
    where = []
    for provider in providers_of(module):
        server = await stack.enter_async_context(SERVERS[provider](scripted))
        os.environ.update(server.env())
        where.append(f"{provider} at {server.base_url}")
    agents = ", ".join(sorted(agents_in(module))) or "none"
    return Text.assemble(
        ("toren dev", "bold"),
        ": agents ",
        plain(agents),
        " run on an ",
        ("OFFLINE model", "bold"),
        " scripted by ",
        plain(scripted.name),
        f" ({', '.join(where) or 'no provider used'}): no provider is called and nothing is "
        "paid: the script's token counts are made up, and receipts price them as each agent's "
        "model would charge.\n"
        f"In another terminal: {toren_command()} run AGENT TEXT --wait, then "
        f"{toren_command()} jobs show RUN",
    )


def _app_banner(module: ModuleType) -> Text:
    """What ``toren dev --app`` prints once up, its agents on their real providers."""
    toren = toren_command()
    agents = ", ".join(f"{a.name} ({a.model})" for a in loaded_agents(module)) or "none"
    return Text.assemble(
        ("toren dev", "bold"),
        " is running (Ctrl-C to stop). Agents: ",
        plain(agents),
        ", on their providers (keys from this environment).\n"
        f"In another terminal: {toren} run AGENT TEXT --wait, then {toren} jobs show RUN\n",
        path_hint(),
    )


async def _start_demo(stack: contextlib.AsyncExitStack, url: str, settings: Settings) -> Text:
    """Start the demo run (once per database) and its offline model (without a key); the
    banner that says where the run is (it may have ended on an earlier start) and what to do
    with it."""
    from toren import demo

    load_app("toren.demo", settings)
    if os.environ.get("ANTHROPIC_API_KEY"):
        model = "Anthropic (ANTHROPIC_API_KEY is set)"
    else:
        offline = await stack.enter_async_context(
            AnthropicServer(ScriptedModel(demo.demo_model, name="toren.demo:demo_model"))
        )
        os.environ.update(offline.env())
        model = (
            f"the OFFLINE DEMO MODEL at {offline.base_url} (set ANTHROPIC_API_KEY for a real "
            "one). Nothing is paid: its token counts are made up, and receipts price them as "
            f"{demo.concierge.model.partition('/')[2]} would charge"
        )
    async with await Client.connect(url, pool_size=1) as client:
        run_id = await start_run(
            client, demo.concierge.name, demo.DEMO_INPUT, idempotency_key="toren-dev-demo"
        )
        state = await read_run(client, run_id)  # as an earlier start may have left it
    where, commands = _demo_next(run_id, state)
    width = max(len(command) for command, _ in commands) + 3
    return Text.assemble(
        ("toren dev", "bold"),
        " is running (Ctrl-C to stop). Agent ",
        ("concierge", "bold"),
        f" on {model}.\n",
        f"Demo run {run_id} {where}. In another terminal:\n",
        *(f"  {command:<{width}}{what}\n" for command, what in commands),
        path_hint(),
    )


def _demo_next(run_id: str, state: RunState) -> tuple[str, list[tuple[str, str]]]:
    """Where the demo run is (an earlier start may have taken it to its end), and the commands
    that go on from there, each with what it does."""
    toren = toren_command()
    tail = (f"{toren} jobs tail {run_id}", "follow it live")
    decide = (f"{toren} jobs approve {run_id}", "approve the refund (or deny it: jobs deny)")
    show = (f"{toren} jobs show {run_id}", "its timeline and cost receipt")
    write = (f"{toren} jobs send {run_id} {shlex.quote(FOLLOW_UP)}", "the conversation goes on")
    new_run = (f"{toren} run concierge {shlex.quote(ANOTHER_TASK)} --wait", "a new demo run")
    workers = (f"{toren} workers", "live workers, leases, memory")
    if state.status == "completed":
        return "has completed (on an earlier start)", [show, write, new_run, workers]
    if state.status == "failed":
        failed = f"has failed (class {state.error_class}, on an earlier start)"
        return failed, [show, new_run, workers]
    if state.status == "cancelled":  # it takes no decision nor message again
        return "was cancelled (on an earlier start)", [show, new_run, workers]
    if state.status == "parked":
        return "is parked, asking to approve a $80 refund", [tail, decide, show, workers]
    if state.decisions:  # stopped while it went on after a decision: nothing to decide now
        return "goes on where it stopped", [tail, show, workers]
    return "will park, asking to approve a $80 refund", [tail, decide, show, workers]
