"""A harness for testing an app's agents end to end, offline: real Postgres, a real worker, the
providers' real SDKs against a scripted model.

::

    @pytest.mark.anyio
    async def test_refund_asks_first() -> None:
        async with harness("shop.app", script) as h:
            run_id = await h.start("shop", "Refund order A-17")
            [call] = await h.waiting(run_id)          # it parks, asking to approve a call
            await h.approve(run_id)
            state = await h.wait(run_id, "completed")
            assert (await h.receipt(run_id)).calls_made == 3

:func:`harness` uses the Postgres server ``TOREN_DATABASE_URL`` names, or else an embedded one
(``pgserver``, started once per process in a temporary directory); either way in a database of
its own, created and migrated for it and dropped afterwards, so tests do not collide. It loads
the app (with its settings file: ``config``, else ``TOREN_CONFIG`` or ``./toren.toml``), starts
one scripted server per provider the app's agents use and points the SDKs at it (through the
environment, restored afterwards), and runs a worker in the test's own process. One harness at
a time per process: the environment and the worker's provider clients are process-wide.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Iterable, Mapping
from pathlib import Path
from typing import Any

import anyio
import asyncpg
import attrs

from toren._agent.agents import agents_in
from toren._agent.app import load_app
from toren._agent.model import ToolCall
from toren._core.client import Client
from toren._core.db import EmbeddedPostgres, with_database
from toren._core.errors import ConfigError
from toren._core.migrate import migrate
from toren._settings import Settings
from toren.runs import (
    ENDED,
    DecisionOutcome,
    Receipt,
    RunState,
    decide,
    read_run,
    receipt,
    say,
    start_run,
    waiting_on,
)
from toren.testing._script import ModelScript, ScriptedModel
from toren.testing._scripted import ScriptedServer
from toren.testing.model_servers import AnthropicServer, BedrockServer, OpenAIServer

__all__ = ["Harness", "RunEnded", "harness"]

SERVERS: dict[str, type[ScriptedServer]] = {
    "anthropic": AnthropicServer,
    "openai": OpenAIServer,
    "bedrock": BedrockServer,
}
# Quick takeover and polling: a test waits for nothing longer than it must.
FAST = {"lease_seconds": 3.0, "renew_seconds": 1.0, "poll_seconds": 0.2, "grace_seconds": 5.0}

_embedded: EmbeddedPostgres | None = None


def _embedded_url() -> str:
    """The URL of this process's embedded Postgres, started on first use; it stops (and its
    directory is removed) when the process exits."""
    global _embedded  # one server per process, like a session fixture
    if _embedded is None:
        data_dir = Path(tempfile.mkdtemp(prefix="toren-harness-pg-"))
        server = EmbeddedPostgres(data_dir)

        def stop() -> None:
            server.stop()
            shutil.rmtree(data_dir, ignore_errors=True)

        atexit.register(stop)
        _embedded = server
    return _embedded.url


class RunEnded(AssertionError):
    """A run reached a status the test was not waiting for (a failure, or an end)."""


class Harness:
    """What a test drives an app through: start runs, wait for them, decide, read them.

    Attributes:
        client: a :class:`~toren.Client` on the harness's database.
        database_url: that database.
        models: the scripted server of each provider the app's agents use (``"anthropic"``,
            ``"openai"``, ``"bedrock"``), to count and read what the model was sent.
    """

    def __init__(
        self, client: Client, database_url: str, models: Mapping[str, ScriptedServer]
    ) -> None:
        self.client = client
        self.database_url = database_url
        self.models = dict(models)

    @property
    def model(self) -> ScriptedServer:
        """The one scripted server (the app's agents use one provider).

        Raises:
            LookupError: they use several (read :attr:`models`) or none.
        """
        if len(self.models) != 1:
            raise LookupError(f"the app uses {len(self.models)} providers; read .models")
        return next(iter(self.models.values()))

    async def start(self, agent: str, input: str, *, idempotency_key: str | None = None) -> str:
        """Start a run of ``agent`` on ``input``; returns its id."""
        return await start_run(self.client, agent, input, idempotency_key=idempotency_key)

    async def state(self, run_id: str) -> RunState:
        """The run as its journal has it now."""
        return await read_run(self.client, run_id)

    async def wait(
        self,
        run_id: str,
        *statuses: str,
        timeout: float = 30.0,  # noqa: ASYNC109  (waiting within a deadline is what it does)
    ) -> RunState:
        """Wait until the run's status is one of ``statuses`` (default ``"completed"``).

        Raises:
            RunEnded: the run ended otherwise than waited for (failed, cancelled, completed: the
                message says how).
            TimeoutError: ``timeout`` seconds went by first.
        """
        wanted = set(statuses or ("completed",))
        deadline = time.monotonic() + timeout
        while True:
            state = await self.state(run_id)
            if state.status in wanted:
                return state
            if state.status in ENDED:
                why = f" ({state.error_class}: {state.error})" if state.error_class else ""
                raise RunEnded(
                    f"{run_id} is {state.status}{why}, not {' or '.join(sorted(wanted))}"
                )
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"{run_id} is still {state.status} after {timeout:g}s, "
                    f"not {' or '.join(sorted(wanted))}"
                )
            await anyio.sleep(0.05)

    async def waiting(
        self,
        run_id: str,
        *,
        timeout: float = 30.0,  # noqa: ASYNC109  (as wait)
    ) -> list[ToolCall]:
        """Wait for the run to park, and return the calls waiting for a decision (empty when
        it parked on something else: a timer, a child run)."""
        return waiting_on(await self.wait(run_id, "parked", timeout=timeout))

    async def approve(
        self, run_id: str, *, call_id: str | None = None, reason: str = "approved in a test"
    ) -> DecisionOutcome | None:
        """Approve ``call_id``, or the one call the run waits on (see :meth:`decide`)."""
        return await self.decide(run_id, approved=True, call_id=call_id, reason=reason)

    async def deny(
        self, run_id: str, *, call_id: str | None = None, reason: str = "denied in a test"
    ) -> DecisionOutcome | None:
        """Deny ``call_id``, or the one call the run waits on (see :meth:`decide`)."""
        return await self.decide(run_id, approved=False, call_id=call_id, reason=reason)

    async def decide(
        self, run_id: str, *, approved: bool, call_id: str | None = None, reason: str = ""
    ) -> DecisionOutcome | None:
        """Decide a call once the run waits on it; returns what the run did with the decision.

        Raises:
            LookupError: no ``call_id`` was given and the run does not wait on exactly one call.
        """
        if call_id is None:
            calls = await self.waiting(run_id)
            if len(calls) != 1:
                names = ", ".join(f"{c.id} ({c.name})" for c in calls) or "none"
                raise LookupError(f"{run_id} waits on {len(calls)} calls ({names}); pass call_id")
            call_id = calls[0].id
        return await decide(self.client, run_id, call_id=call_id, approved=approved, reason=reason)

    async def say(self, run_id: str, text: str) -> None:
        """Send the run a human message."""
        await say(self.client, run_id, text)

    async def output(self, run_id: str) -> str | None:
        """The run's final answer (``None`` until it completes)."""
        return (await self.state(run_id)).output

    async def receipt(self, run_id: str) -> Receipt:
        """What the run cost so far: calls, tokens, dollars."""
        return receipt(await self.state(run_id))


@contextlib.asynccontextmanager
async def _database(base_url: str) -> AsyncIterator[str]:
    """A fresh, migrated database on the server of ``base_url``, dropped afterwards."""
    name = f"toren_test_{uuid.uuid4().hex[:12]}"
    admin = await asyncpg.connect(base_url)
    try:
        await admin.execute(f'CREATE DATABASE "{name}"')
    finally:
        await admin.close()
    url = with_database(base_url, name)
    try:
        conn = await asyncpg.connect(url)
        try:
            await migrate(conn)
        finally:
            await conn.close()
        yield url
    finally:
        with anyio.CancelScope(shield=True):
            admin = await asyncpg.connect(base_url)
            try:
                await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
            finally:
                await admin.close()


@contextlib.contextmanager
def _environment(values: Mapping[str, str]) -> Any:
    """Set environment variables; put back what was there afterwards."""
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def providers_of(module: Any) -> list[str]:
    """The providers the agents ``module`` defines use, sorted."""
    from toren.providers import parse_model

    return sorted({parse_model(agent.model)[0] for agent in agents_in(module).values()})


@contextlib.asynccontextmanager
async def harness(
    app: str,
    model: ModelScript | ScriptedModel,
    *,
    config: str | Path | None = None,
    env: Mapping[str, str] | None = None,
    providers: Iterable[str] = (),
    **settings: Any,
) -> AsyncIterator[Harness]:
    """Run ``app`` (``MODULE``, as ``--app`` takes it) against ``model`` (a model script, see
    :class:`~toren.testing.ScriptedModel`) on a worker in this process, in a database of its
    own; yields a :class:`Harness`.

    ``env`` sets environment variables for the harness's life, from before the settings are read
    and the app is imported (a bot token, a setting the app reads as it is imported, ...);
    ``providers`` adds servers for providers no agent of the app names; ``settings`` override
    the worker's settings (``sandboxes=True``, ``telegram_api_url=...``): by default it takes
    over leases and polls quickly.

    Raises:
        ConfigError: the app cannot be loaded, its settings are invalid, or ``providers``
            names one with no scripted server.
    """
    from toren.supervisors.worker import Worker

    scripted = model if isinstance(model, ScriptedModel) else ScriptedModel(model)
    unknown = sorted(set(providers) - set(SERVERS))
    if unknown:
        raise ConfigError(
            f"no scripted server for provider(s) {', '.join(map(repr, unknown))}",
            hint=f"providers are among {', '.join(SERVERS)}",
        )
    async with contextlib.AsyncExitStack() as stack:
        # ``env`` first: the settings and the app module (as it is imported) read it too.
        stack.enter_context(_environment(dict(env or {})))
        config_file = Path(config) if config else None
        loaded = Settings.load(config_file=config_file, **{**FAST, **settings})
        module = load_app(app, loaded)
        base_url = loaded.database_url
        if base_url is None:
            base_url = await anyio.to_thread.run_sync(_embedded_url)
        url = await stack.enter_async_context(_database(base_url))
        servers: dict[str, ScriptedServer] = {}
        values: dict[str, str] = {}
        for provider in sorted({*providers_of(module), *providers}):
            server = await stack.enter_async_context(SERVERS[provider](scripted))
            servers[provider] = server
            values.update(server.env())
        stack.enter_context(_environment(values))
        worker = Worker(attrs.evolve(loaded, database_url=url), url)
        client = await stack.enter_async_context(await Client.connect(url, pool_size=2))
        try:
            async with anyio.create_task_group() as tg:
                await tg.start(worker.run)
                try:
                    yield Harness(client, url, servers)
                finally:
                    with anyio.fail_after(15, shield=True):
                        await worker.stop()
        except BaseExceptionGroup as group:
            # The test's own failure (an assert) raised as itself, as pytest shows one, not
            # wrapped in the worker's task group.
            if len(group.exceptions) == 1:
                raise group.exceptions[0] from None
            raise
