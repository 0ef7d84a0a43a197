"""``toren serve --workers N``: N real API processes on one port, under a parent that supervises
them. Connections land on both processes; streams on either follow a run a worker advances;
failed sign-ins spread over both lock the address out at the limit; ``/metrics`` counts both;
a killed process is started again; SIGTERM stops them all."""

from __future__ import annotations

import contextlib
import functools
import io
import logging
import os
import re
import signal
import socket
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import anyio
import attrs
import psutil
import pytest
from click.testing import CliRunner

from tests.conftest import ROOT, decide_waiting, person, wait_for
from tests.test_api import refund_agent
from tests.test_streams import SSE, events_of, read_until
from toren import Client
from toren._core.logs import TorenHandler
from toren._surfaces.http.access import AccessLog
from toren._surfaces.tokens import create_token
from toren.cli import main
from toren.runs import read_run, start_run, waiting_on

pytestmark = pytest.mark.anyio

TOREN = (sys.executable, "-m", "toren")
PIPE_BUF = 4096  # Linux's
LIMIT = 4  # failed authentications per address per minute, for the whole fleet


@attrs.define
class Fleet:
    """A ``toren serve --workers 2`` parent, its log, and the port its children share."""

    proc: subprocess.Popen[bytes]
    log_path: Path
    port: int = 0

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def children(self) -> list[psutil.Process]:
        return psutil.Process(self.proc.pid).children()

    def listening(self) -> list[int]:
        """The children listening on the port, by pid."""
        return [
            c.pid
            for c in self.children()
            if any(
                s.status == psutil.CONN_LISTEN and s.laddr.port == self.port
                for s in _connections(c)
            )
        ]

    def serving(self, client_port: int) -> int | None:
        """The child holding the connection from ``client_port``."""
        for child in self.children():
            if any(s.raddr and s.raddr.port == client_port for s in _connections(child)):
                return child.pid
        return None


def _connections(process: psutil.Process) -> list[Any]:
    try:
        return process.net_connections(kind="tcp")
    except psutil.NoSuchProcess:
        return []


@pytest.fixture
async def fleet(db_url: str, tmp_path: Path) -> AsyncIterator[Fleet]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOREN_")}
    env.update(
        TOREN_DATABASE_URL=db_url,
        TOREN_FAILED_AUTH_PER_MINUTE=str(LIMIT),
        TOREN_HOME=str(tmp_path / "home"),
        PYTHONPATH=str(ROOT),
    )
    log_path = tmp_path / "serve.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [*TOREN, "--log-level", "DEBUG", "serve", "--port", "0", "--workers", "2"],
            env=env,
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    fleet = Fleet(proc, log_path)
    try:

        async def bound() -> int:
            assert proc.poll() is None, fleet.log()
            found = re.search(r"on http://127\.0\.0\.1:(\d+) in 2 processes", fleet.log())
            return int(found[1]) if found else 0

        fleet.port = await wait_for(bound, timeout=30, what="the parent to reserve a port")

        async def both_listen() -> bool:
            return len(fleet.listening()) == 2

        await wait_for(both_listen, timeout=30, what="both API processes to listen")
        yield fleet
    finally:
        if proc.poll() is None:
            for child in fleet.children():
                with contextlib.suppress(psutil.NoSuchProcess):
                    child.kill()
            proc.kill()
            proc.wait(10)


@attrs.define
class Pinned:
    """An HTTP session held to one connection, and the API process that connection landed on."""

    http: aiohttp.ClientSession
    pid: int


@contextlib.asynccontextmanager
async def pinned(fleet: Fleet) -> AsyncIterator[Pinned]:
    """A new connection (``/healthz`` opens it: no credentials, nothing counted)."""
    connector = aiohttp.TCPConnector(limit=1)  # every request on one kept-alive connection
    before = _ours(fleet)
    async with aiohttp.ClientSession(connector=connector) as http:
        async with http.get(f"{fleet.base}/healthz") as r:
            assert r.status == 200, await r.text()
        [client_port] = _ours(fleet) - before
        pid = await wait_for(lambda: _ready(fleet.serving(client_port)), timeout=5)
        yield Pinned(http, pid)


def _ours(fleet: Fleet) -> set[int]:
    """The local ports of this process's connections to the fleet's port."""
    return {
        s.laddr.port
        for s in _connections(psutil.Process())
        if s.raddr and s.raddr.port == fleet.port and s.status == psutil.CONN_ESTABLISHED
    }


async def _ready(value: Any) -> Any:
    return value


@contextlib.asynccontextmanager
async def one_on_each(fleet: Fleet) -> AsyncIterator[dict[int, Pinned]]:
    """A pinned connection to each of the two processes: new connections are made until
    both are reached (the kernel spreads them by a hash: a handful suffices)."""
    async with contextlib.AsyncExitStack() as stack:
        found: dict[int, Pinned] = {}
        for _ in range(64):
            one = await stack.enter_async_context(pinned(fleet))
            found.setdefault(one.pid, one)
            if len(found) == 2:
                yield found
                return
        raise AssertionError(f"64 connections all landed on {list(found)}")


def _counted(metrics: str, route: str) -> float:
    return sum(
        float(m[1])
        for m in re.finditer(
            rf'^toren_http_requests_total\{{method="GET",route="{route}",status="200"\}} (\S+)$',
            metrics,
            re.MULTILINE,
        )
    )


async def test_two_processes_share_the_port_and_metrics_count_the_requests_of_both(
    fleet: Fleet, client: Client
) -> None:
    _, token = await create_token(client.pool, "scraper")
    async with one_on_each(fleet) as each:
        assert sorted(each) == sorted(fleet.listening())
        for one in each.values():  # two more requests on each process
            for _ in range(2):
                async with one.http.get(f"{fleet.base}/healthz") as r:
                    assert r.status == 200
        # Whichever process answers the scrape counts the requests of both.
        for one in each.values():
            headers = {"Authorization": f"Bearer {token}"}
            async with one.http.get(f"{fleet.base}/metrics", headers=headers) as r:
                assert r.status == 200
                metrics = await r.text()
            assert 'toren_runs{status="running"} 0.0' in metrics
            # One /healthz per connection opened until both were reached, plus the four.
            assert _counted(metrics, "/healthz") >= 2 + 4


async def test_failed_sign_ins_spread_over_both_processes_lock_out_at_the_limit(
    fleet: Fleet, client: Client
) -> None:
    _, good = await create_token(client.pool, "good")
    async with one_on_each(fleet) as each:
        a, b = each.values()
        for n in range(LIMIT):  # alternately on each process
            one = (a, b)[n % 2]
            headers = {"Authorization": f"Bearer trn_bad{n}_guess{n}"}
            async with one.http.get(f"{fleet.base}/runs", headers=headers) as r:
                assert r.status == 401, await r.text()
        for one in (a, b):  # both refuse the next guess, and a token they never saw pass
            for token in ("trn_bad9_guess9", good):
                headers = {"Authorization": f"Bearer {token}"}
                async with one.http.get(f"{fleet.base}/runs", headers=headers) as r:
                    assert r.status == 429, await r.text()
                    assert 1 <= int(r.headers["Retry-After"]) <= 60
            async with one.http.post(f"{fleet.base}/session", data={"token": good}) as r:
                assert r.status == 429  # the console's sign-in counts with them
    assert await client.pool.fetchval("SELECT count(*) FROM toren.auth_failures") == LIMIT


async def test_a_stream_on_either_process_follows_a_run_a_worker_advances(
    fleet: Fleet, client: Client, db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, token = await create_token(client.pool, "reader")
    headers = {**SSE, "Authorization": f"Bearer {token}"}
    async with refund_agent(monkeypatch, db_url), one_on_each(fleet) as each:
        run_id = await start_run(client, "support", "Refund me")

        async def parked() -> bool:
            return bool(waiting_on(await read_run(client, run_id)))

        await wait_for(parked, timeout=20, what="the run to park on its approval")
        path = f"{fleet.base}/runs/{run_id.removeprefix('run/')}/events"
        async with contextlib.AsyncExitStack() as stack:
            streams = []
            for one in each.values():
                r = await stack.enter_async_context(one.http.get(path, headers=headers))
                streams.append(events_of(r))
                with anyio.fail_after(10):
                    await read_until(streams[-1], "approval.requested")
            # Told by the worker's notification, each process's listener wakes its stream.
            await decide_waiting(client, run_id, approved=True, by=person("alice"), wait=None)
            for events in streams:
                with anyio.fail_after(10):
                    got = await read_until(events, "run.completed")
                assert "approval.decided" in [e.event for e in got]


async def test_a_killed_process_is_started_again_and_sigterm_stops_them_all(
    fleet: Fleet,
) -> None:
    first = sorted(fleet.listening())
    os.kill(first[0], signal.SIGKILL)

    async def replaced() -> list[int]:
        now = fleet.listening()
        return now if len(now) == 2 and first[0] not in now else []

    now = await wait_for(replaced, timeout=30, what="a new API process in the killed one's place")
    assert first[1] in now
    assert f"API process {first[0]} was killed by SIGKILL; starting another" in fleet.log()
    async with aiohttp.ClientSession() as http, http.get(f"{fleet.base}/healthz") as r:
        assert r.status == 200
    fleet.proc.send_signal(signal.SIGTERM)

    async def exited() -> bool:
        return fleet.proc.poll() is not None

    await wait_for(exited, timeout=30, what="the parent exited after SIGTERM")
    assert fleet.proc.returncode == 0, fleet.log()
    for pid in now:
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == "zombie"
    log = fleet.log()
    assert log.count("SIGTERM: stopping") == 3, log  # the parent, then each process
    assert "Traceback" not in log


@pytest.mark.parametrize(
    ("args", "env", "said"),
    [
        (["--workers", "0"], {}, "0 is not in the range 1<=x<=64"),
        (["--workers", "-3"], {}, "-3 is not in the range 1<=x<=64"),
        (["--workers", "10000"], {}, "10000 is not in the range 1<=x<=64"),
        ([], {"TOREN_API_WORKERS": "lots"}, "from TOREN_API_WORKERS; its value is not shown"),
    ],
)
def test_a_number_of_processes_out_of_range_exits_2_saying_so(
    args: list[str], env: dict[str, str], said: str
) -> None:
    for command in (["serve"], ["up"]):
        done = CliRunner().invoke(main, [*command, *args], env=env)
        assert done.exit_code == 2, done.output
        assert said in done.output
        assert "lots" not in done.output


async def test_the_access_log_writes_whole_lines_a_pipe_keeps_whole() -> None:
    """Several processes write their access logs to one standard error: each write is whole
    lines of at most PIPE_BUF bytes, which a pipe never mixes with another writer's."""

    class Writes(io.StringIO):
        def __init__(self) -> None:
            super().__init__()
            self.writes: list[str] = []

        def write(self, text: str) -> int:
            self.writes.append(text)
            return len(text)

    stream = Writes()
    logger = logging.getLogger("tests.access.pipe")
    logger.propagate = False
    logger.setLevel(logging.INFO)
    logger.addHandler(TorenHandler(stream))
    try:
        log = AccessLog(logger)
        for n in range(500):  # about 40 KiB
            log.add("GET", f"/runs/{n}?x=\u00e9" + "a" * (n % 50), 200, "127.0.0.1", "-", 0.001)
        log.flush()
    finally:
        logger.handlers.clear()
    assert len(stream.writes) > 1
    assert all(0 < len(w.encode()) <= PIPE_BUF and w.endswith("\n") for w in stream.writes)
    lines = "".join(stream.writes).splitlines()
    assert [line.split(" ")[4] for line in lines] == [
        f"/runs/{n}?x=\u00e9" + "a" * (n % 50) for n in range(500)
    ]


# A stand-in for an API process: the first to start claims ``healthy`` and serves until
# SIGTERM, then takes a while to stop (as a process draining its streams does) and says so in
# ``stopped``; every later one exits 1 at once (a crash loop beside a healthy process).
_STAND_IN = """
import os, signal, sys, time
healthy, stopped = sys.argv[1], sys.argv[2]
try:
    os.close(os.open(healthy, os.O_CREAT | os.O_EXCL))
except FileExistsError:
    sys.exit(1)
signal.signal(signal.SIGTERM, lambda *_: (time.sleep(1), open(stopped, "w").close(), sys.exit(0)))
while True:
    time.sleep(60)
"""


async def test_a_parent_giving_up_on_a_crash_loop_waits_for_the_processes_still_serving(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from toren._surfaces import processes

    monkeypatch.setattr(processes, "FIRST_PAUSE", 0.01)
    monkeypatch.setattr(processes, "MOST_PAUSE", 0.01)
    healthy, stopped = tmp_path / "healthy", tmp_path / "stopped"

    def command(port: int) -> list[str]:
        return [sys.executable, "-c", _STAND_IN, str(healthy), str(stopped)]

    with pytest.raises(ExceptionGroup) as failing:
        async with processes.api_processes(command, count=2, host="127.0.0.1", port=0):
            await anyio.sleep_forever()
    assert failing.group_contains(processes.ApiProcessesFailing)
    assert healthy.exists()
    assert stopped.exists(), "the parent ended before the process it told to stop had stopped"


def test_a_port_another_set_of_api_processes_listens_on_is_refused() -> None:
    """Another ``--workers N`` (its processes listen with ``SO_REUSEPORT``, as these would) on
    the port: refused as a port in use, never silently sharing its connections."""
    from toren._core.errors import ConfigError
    from toren._surfaces.processes import reserve

    with socket.socket() as other:
        other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = other.getsockname()[1]
        with pytest.raises(ConfigError, match=f"cannot listen on 127.0.0.1:{port}"):
            reserve("127.0.0.1", port)


async def test_up_with_two_api_processes_reports_its_worker_on_both_and_drains_it_first(
    db_url: str, tmp_path: Path
) -> None:
    """``toren up --workers 2``: the worker in the parent, its state on both processes'
    ``/readyz``; on SIGTERM the worker drains before the API processes are told to stop."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOREN_")}
    env.update(
        TOREN_DATABASE_URL=db_url,
        TOREN_HOME=str(tmp_path / "home"),
        TOREN_SANDBOXES="false",
        PYTHONPATH=str(ROOT),
    )
    log_path = tmp_path / "up.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [*TOREN, "--log-level", "DEBUG", "up", "--port", "0", "--workers", "2"],
            env=env,
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    fleet = Fleet(proc, log_path)
    try:

        async def bound() -> int:
            assert proc.poll() is None, fleet.log()
            found = re.search(r"on http://127\.0\.0\.1:(\d+) in 2 processes", fleet.log())
            return int(found[1]) if found else 0

        fleet.port = await wait_for(bound, timeout=30, what="the parent to reserve a port")
        await wait_for(lambda: _ready(len(fleet.listening()) == 2), timeout=30)
        async with one_on_each(fleet) as each:

            async def ready(one: Pinned) -> dict[str, Any] | None:
                async with one.http.get(f"{fleet.base}/readyz") as r:
                    body: dict[str, Any] = await r.json()
                return body if r.status == 200 else None

            for one in each.values():
                shown = await wait_for(functools.partial(ready, one), timeout=30)
                assert shown["worker"] == "running"
        proc.send_signal(signal.SIGTERM)
        code = await anyio.to_thread.run_sync(proc.wait, 30)
        assert code == 0, fleet.log()
    finally:
        if proc.poll() is None:
            for child in fleet.children():
                with contextlib.suppress(psutil.NoSuchProcess):
                    child.kill()
            proc.kill()
            proc.wait(10)
    text = fleet.log()
    drained = text.index("SIGTERM: draining")
    down = text.index("down (group commit")
    told = [m.start() for m in re.finditer(r"API process \d+: SIGTERM: stopping", text)]
    assert len(told) == 2, text
    assert drained < down < min(told), text
    assert "Traceback" not in text


def test_metrics_folders_of_parents_that_are_gone_are_swept(tmp_path: Path) -> None:
    from toren._surfaces.processes import METRICS_PREFIX, sweep_metrics

    with subprocess.Popen([sys.executable, "-c", "pass"]) as child:
        child.wait()
    dead_pid = child.pid  # reaped: no process has it (unless reused at once)
    dead = tmp_path / f"{METRICS_PREFIX}{dead_pid}-abc"
    live = tmp_path / f"{METRICS_PREFIX}{os.getpid()}-def"
    other = tmp_path / f"{METRICS_PREFIX}not-a-pid"
    for folder in (dead, live, other):
        folder.mkdir()
        (folder / "counter_1.db").write_bytes(b"x")
    sweep_metrics(tmp_path)
    assert not dead.exists()
    assert live.exists()
    assert other.exists()
