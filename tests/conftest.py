"""Shared fixtures: a real Postgres (embedded unless TOREN_TEST_DATABASE_URL is set), a fresh
migrated database per test, clients, and worker processes that tests can kill."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import asyncpg
import pytest

from toren import Client
from toren._core.db import EmbeddedPostgres, with_database
from toren._core.migrate import migrate

ROOT = Path(__file__).resolve().parent.parent
TEMPLATE = "toren_test_template"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--record-journals",
        action="store_true",
        help="Write the journals of fixture-producing tests to tests/fixtures/journals.",
    )


@pytest.fixture(scope="session")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="session")
def server_url() -> Iterator[str]:
    """A Postgres server for the whole session; migrations applied to a template database."""
    url = os.environ.get("TOREN_TEST_DATABASE_URL")
    server = None
    data_dir = None
    if url is None:
        # Outside pytest's basetemp: a concurrent pytest session prunes old basetemps, and with
        # them the data directory of a server still in use.
        data_dir = Path(tempfile.mkdtemp(prefix="toren-test-pg-"))
        server = EmbeddedPostgres(data_dir)
        url = server.url
    import anyio

    async def prepare() -> None:
        conn = await asyncpg.connect(url)
        try:
            await conn.execute(f"DROP DATABASE IF EXISTS {TEMPLATE} WITH (FORCE)")
            await conn.execute(f"CREATE DATABASE {TEMPLATE}")
        finally:
            await conn.close()
        tconn = await asyncpg.connect(with_database(url, TEMPLATE))
        try:
            await migrate(tconn)
        finally:
            await tconn.close()

    anyio.run(prepare)
    yield url
    if server is not None:
        server.stop()
    if data_dir is not None:
        shutil.rmtree(data_dir, ignore_errors=True)


@pytest.fixture
async def db_url(server_url: str) -> AsyncIterator[str]:
    """A fresh, migrated database for one test."""
    name = f"t_{uuid.uuid4().hex[:12]}"
    conn = await asyncpg.connect(server_url)
    try:
        await conn.execute(f"CREATE DATABASE {name} TEMPLATE {TEMPLATE}")
    finally:
        await conn.close()
    yield with_database(server_url, name)
    conn = await asyncpg.connect(server_url)
    try:
        await conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
    finally:
        await conn.close()


@pytest.fixture
async def empty_db_url(server_url: str) -> AsyncIterator[str]:
    """A fresh database with no schema at all (for migration tests)."""
    name = f"e_{uuid.uuid4().hex[:12]}"
    admin = await asyncpg.connect(server_url)
    try:
        await admin.execute(f"CREATE DATABASE {name}")
        yield with_database(server_url, name)
        await admin.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
    finally:
        await admin.close()


@pytest.fixture
async def client(db_url: str) -> AsyncIterator[Client]:
    c = await Client.connect(db_url)
    yield c
    await c.close()


class WorkerProcess:
    """A real ``toren worker`` process running the test app, with its log in a file."""

    def __init__(
        self, db_url: str, log_path: Path, app: str = "tests.app", **settings: float | str
    ) -> None:
        self.log_path = log_path
        env = dict(os.environ)
        env.update(
            {
                "TOREN_DATABASE_URL": db_url,
                "TOREN_LEASE_SECONDS": "3",
                "TOREN_RENEW_SECONDS": "1",
                "TOREN_POLL_SECONDS": "0.2",
                "TOREN_GRACE_SECONDS": "10",
                # Sandboxes only where a test asks for them (sandboxes=True, workspace_store=...).
                "TOREN_SANDBOXES": "false",
                "PYTHONPATH": str(ROOT),
            }
        )
        env.update({f"TOREN_{k.upper()}": str(v) for k, v in settings.items()})
        self._log = log_path.open("ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "toren", "--log-level", "DEBUG", "worker", "--app", app],
            env=env,
            cwd=ROOT,
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )
        self.pid = self.proc.pid

    def signal(self, sig: int) -> None:
        os.kill(self.pid, sig)

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def wait(self, timeout: float) -> int:
        return self.proc.wait(timeout)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)  # a stopped process cannot die until continued
            self.proc.kill()
            self.proc.wait(10)
        self._log.close()


@pytest.fixture
def workers(db_url: str, tmp_path: Path) -> Iterator[WorkerFactory]:
    started: list[WorkerProcess] = []

    def start(app: str = "tests.app", **settings: float | str) -> WorkerProcess:
        w = WorkerProcess(db_url, tmp_path / f"worker-{len(started)}.log", app, **settings)
        started.append(w)
        return w

    yield start
    for w in started:
        w.close()


class WorkerFactory:
    def __call__(self, app: str = "tests.app", **settings: float | str) -> WorkerProcess: ...


async def wait_for(predicate, timeout: float = 20.0, interval: float = 0.05, what: str = ""):  # type: ignore[no-untyped-def]
    """Poll an async predicate until it returns a truthy value."""
    import anyio

    deadline = time.monotonic() + timeout
    while True:
        value = await predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what or predicate}")
        await anyio.sleep(interval)


def person(name: str) -> Any:
    """A principal for tests that decide or send as someone by name."""
    from toren._agent.principal import Principal

    return Principal(kind="os_user", id=f"test-{name}", name=name, via="test")


async def decide_waiting(client: Client, run_id: str, **decision: Any) -> Any:
    """Decide the one call the run waits for (tests that do not care which call it is)."""
    from toren.runs import decide, read_run, waiting_on

    [call] = waiting_on(await read_run(client, run_id))
    return await decide(client, run_id, call_id=call.id, **decision)


async def worker_registered(client: Client, pid: int) -> bool:
    row = await client.pool.fetchval("SELECT count(*) FROM toren.workers WHERE pid = $1", pid)
    return bool(row)


@contextlib.asynccontextmanager
async def running_worker(db_url: str, agents: Any = None, **overrides: Any) -> AsyncIterator[Any]:
    """A worker tree inside the test's own process (for weak references and fast tests),
    running ``agents`` (a ``toren.runs.Agents``; the process's by default)."""
    import anyio

    from toren import Settings
    from toren.supervisors.worker import Worker

    values: dict[str, Any] = {
        "database_url": db_url,
        "lease_seconds": 3.0,
        "renew_seconds": 1.0,
        "poll_seconds": 0.2,
        "grace_seconds": 5.0,
        "sandboxes": False,  # only where a test asks (sandboxes=True, workspace_store=...)
    }
    clock = overrides.pop("clock", None)  # a toren.kernel.ShiftedClock, for schedules
    values.update(overrides)
    worker = Worker(Settings(**values), db_url, agents=agents, clock=clock)
    async with anyio.create_task_group() as tg:
        await tg.start(worker.run)
        try:
            yield worker
        finally:
            with anyio.fail_after(15, shield=True):
                await worker.stop()
