"""Several API server processes on one port: ``toren serve --workers N`` and ``toren up
--workers N``.

The parent reserves the port: it binds it with ``SO_REUSEPORT`` and never listens on it (so it
takes no connection, and nothing but another ``SO_REUSEPORT`` socket of the same user can bind
it while the children come and go). It then starts N children, each a ``toren serve`` that
listens on that port with ``SO_REUSEPORT`` (aiohttp's ``TCPSite(reuse_port=True)``): Linux
spreads new connections over the listening sockets by a hash of their addresses, so keep-alive
clients are spread too (one socket shared by every child would hand a burst of connections to
whichever child woke first). The children share what must be shared through Postgres (failed
sign-ins, sessions, tokens, the journal that streams read and the notifications that wake them)
and their request counters through ``prometheus_client``'s multiprocess directory, which the
parent creates empty and removes when it stops.

The parent supervises (:class:`ApiProcesses`):

- A child that exits is started again, after a short pause that doubles up to
  :data:`MOST_PAUSE`; past :data:`RESTARTS` exits within :data:`WINDOW` seconds the parent
  stops the others and fails (:class:`ApiProcessesFailing`, exit code 1). A child that exits
  with code 2 (a configuration error, which another start would repeat) stops everything at
  once with that code.
- Each child runs in its own session, so a terminal's Ctrl-C reaches the parent alone, which
  stops the children with one ``SIGTERM`` each (they stop as ``toren serve`` does: streams end
  with ``stopping``, requests in hand are answered) and waits for them; a second signal to the
  parent kills them at once.
- A child's standard input is a pipe from the parent: a parent that dies (even by ``SIGKILL``)
  closes it, and the child stops by itself. ``toren up`` also sends its worker's state down it,
  one line per change, for the children's ``/readyz``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import get_args

import anyio
import anyio.abc
import psutil

from toren._core.errors import ConfigError, TorenError
from toren._surfaces.http.models import WorkerState
from toren._surfaces.http.readiness import WorkerProbe

log = logging.getLogger("toren.http")

MOST = 64
"""Most API processes one parent runs (each holds ``pool_size`` + 1 database connections)."""
RESTARTS = 5
WINDOW = 60.0
FIRST_PAUSE = 0.1
MOST_PAUSE = 5.0
STATE_POLL = 0.1
"""Seconds between looks at the worker's state (``toren up``): how late a child's ``/readyz``
learns of a change."""


class ApiProcessesFailing(TorenError):
    """The API processes kept exiting: more than :data:`RESTARTS` within :data:`WINDOW` s."""

    def __init__(self, exits: int, last: str) -> None:
        self.exits = exits
        super().__init__(
            f"the API processes ended {exits} times within {WINDOW:g}s (the last one {last}); "
            "stopped them all: see their errors above"
        )


def describe(code: int) -> str:
    """How a child ended, for people: ``exited with code 1``, ``was killed by SIGKILL``."""
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def reserve(host: str, port: int) -> tuple[list[socket.socket], int]:
    """Bind ``host:port`` (every address ``host`` names) with ``SO_REUSEPORT``, not listening;
    returns the sockets and the port (the one chosen, for port 0).

    Raises:
        ConfigError: the port cannot be bound (taken by a process that is not ours).
    """
    held: list[socket.socket] = []
    try:
        infos = socket.getaddrinfo(
            host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
        for family, kind, proto, _, address in infos:
            sock = socket.socket(family, kind, proto)
            held.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)  # as asyncio does
            if port:  # taken by any listener, even one with SO_REUSEPORT (another --workers N)?
                with socket.socket(family, kind, proto) as probe:
                    probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                    if family == socket.AF_INET6:
                        probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                    probe.bind((address[0], port, *address[2:]))
            sock.bind((address[0], port, *address[2:]))
            port = sock.getsockname()[1]  # port 0: the others take the one chosen first
    except OSError as exc:
        for sock in held:
            sock.close()
        raise ConfigError(
            f"cannot listen on {host}:{port}: {exc.strerror or exc}",
            hint="Pick another port with --port, or stop what uses this one.",
        ) from exc
    return held, port


class ApiProcesses:
    """The children serving one port, and the parent's side of their pipes (see the module)."""

    def __init__(
        self,
        command: Sequence[str],
        *,
        count: int,
        env: dict[str, str],
        worker: WorkerProbe | None = None,
    ) -> None:
        self.command = list(command)
        self.count = count
        self.env = env
        self.worker = worker
        self.live: dict[int, anyio.abc.Process] = {}
        self.stopping = anyio.Event()  # set once the children are being stopped
        self._exits: list[float] = []
        self._gone = anyio.Event()
        self._said = b""
        self._starting = 0

    def pids(self) -> list[int]:
        """The live children's process ids, by slot."""
        return [self.live[slot].pid for slot in sorted(self.live)]

    async def keep(self, slot: int) -> None:
        """Run the child of ``slot``, again each time it exits, until stopping.

        Raises:
            ConfigError: it exited with code 2.
            ApiProcessesFailing: the children exited too often.
        """
        pause = FIRST_PAUSE
        while not self.stopping.is_set():
            self._starting += 1
            try:
                with anyio.CancelScope(shield=True):  # a child started is a child waited for
                    process = await anyio.open_process(
                        self.command,
                        stdin=subprocess.PIPE,
                        stdout=None,  # the children write where the parent does
                        stderr=None,
                        env=self.env,
                        start_new_session=True,
                    )
                self.live[slot] = process
            finally:
                self._starting -= 1
            log.debug("API process %d started", process.pid)
            if self.stopping.is_set():  # it began while it started
                process.send_signal(signal.SIGTERM)
            if self.worker is not None:
                await self._tell(process, self._said)
            try:
                code = await process.wait()
            finally:
                # Cancelled (another slot failed): the child is still live until it exits, and
                # stop() (signalled by it, or killed on a second signal) waits for it.
                with anyio.CancelScope(shield=True):
                    await process.wait()
                del self.live[slot]
                if self.stopping.is_set() and not self.live and not self._starting:
                    self._gone.set()
            if self.stopping.is_set():
                return
            if code == 2:
                raise ConfigError(
                    f"API process {process.pid} exited with code 2 (a configuration error, "
                    "above); stopped them all"
                )
            now = anyio.current_time()
            self._exits = [t for t in self._exits if t > now - WINDOW] + [now]
            if len(self._exits) > RESTARTS:
                raise ApiProcessesFailing(len(self._exits), describe(code))
            log.warning(
                "API process %d %s; starting another in %gs",
                process.pid,
                describe(code),
                pause,
            )
            await anyio.sleep(pause)
            pause = min(pause * 2, MOST_PAUSE)

    async def tell_worker_state(self) -> None:
        """Send the worker's state to every child each time it changes (``toren up``)."""
        while self.worker is not None:
            worker_id, state = self.worker()
            said = f"{worker_id or '-'} {state}\n".encode()
            if said != self._said:
                self._said = said
                for process in list(self.live.values()):
                    await self._tell(process, said)
            await anyio.sleep(STATE_POLL)

    async def _tell(self, process: anyio.abc.Process, line: bytes) -> None:
        if not line or process.stdin is None:
            return
        with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
            await process.stdin.send(line)

    async def stop(self) -> None:
        """``SIGTERM`` to every child, then wait until all have exited; a signal to the parent
        meanwhile kills them at once."""
        self.stopping.set()
        if not self.live and not self._starting:
            return
        self._signal(signal.SIGTERM)
        with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async with anyio.create_task_group() as tg:

                async def second() -> None:
                    async for _ in signals:
                        log.warning("second signal: killing the API processes")
                        self._signal(signal.SIGKILL)

                tg.start_soon(second)
                await self._gone.wait()
                tg.cancel_scope.cancel()

    def _signal(self, signum: signal.Signals) -> None:
        for process in list(self.live.values()):
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(signum)


@contextlib.asynccontextmanager
async def api_processes(
    command: Callable[[int], Sequence[str]],
    *,
    count: int,
    host: str,
    port: int,
    worker: WorkerProbe | None = None,
) -> AsyncIterator[tuple[ApiProcesses, int]]:
    """Run ``count`` children of ``command(port)`` on ``host:port`` while inside (see the
    module); yields them and the port. On the way out they are stopped and waited for.

    Raises:
        ConfigError: the port cannot be bound, or a child exited with code 2.
        ApiProcessesFailing: the children kept exiting.
    """
    sockets, bound = reserve(host, port)
    if count > (os.cpu_count() or 1):
        log.warning(
            "%d API processes on %d CPUs: more processes than CPUs add connections to Postgres "
            "(each its own pool) and no throughput",
            count,
            os.cpu_count() or 1,
        )
    sweep_metrics(Path(tempfile.gettempdir()))
    metrics_dir = tempfile.mkdtemp(prefix=f"{METRICS_PREFIX}{os.getpid()}-")
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": metrics_dir}
    processes = ApiProcesses(command(bound), count=count, env=env, worker=worker)
    try:
        async with anyio.create_task_group() as tg:
            for slot in range(count):
                tg.start_soon(processes.keep, slot)
            if worker is not None:
                tg.start_soon(processes.tell_worker_state)
            try:
                yield processes, bound
            finally:
                with anyio.CancelScope(shield=True):
                    await processes.stop()
                tg.cancel_scope.cancel()
    finally:
        for sock in sockets:
            sock.close()
        shutil.rmtree(metrics_dir, ignore_errors=True)


METRICS_PREFIX = "toren-metrics-"
"""The metrics directory of a parent: ``toren-metrics-<its pid>-<random>`` in the temp folder."""


def sweep_metrics(folder: Path) -> None:
    """Remove the metrics directories of parents that are gone without removing theirs (killed
    with SIGKILL): those of this user whose pid is no longer a process."""
    for path in folder.glob(f"{METRICS_PREFIX}*-*"):
        pid = path.name[len(METRICS_PREFIX) :].partition("-")[0]
        try:
            mine = path.is_dir() and path.stat().st_uid == os.getuid()
        except OSError:
            continue
        if mine and pid.isdigit() and not psutil.pid_exists(int(pid)):
            shutil.rmtree(path, ignore_errors=True)


class ParentSays:
    """A child's side of its pipe: the worker state the parent sent last (its ``/readyz``
    probe), and whether the parent is gone (the pipe closed)."""

    def __init__(self) -> None:
        self.worker_id: uuid.UUID | None = None
        self.state: WorkerState = "starting"

    def probe(self) -> tuple[uuid.UUID | None, WorkerState]:
        return self.worker_id, self.state

    def heard(self, line: str) -> None:
        worker_id, _, state = line.strip().partition(" ")
        if state in get_args(WorkerState):
            self.state = state  # type: ignore[assignment]  # checked against the Literal
            self.worker_id = uuid.UUID(worker_id) if worker_id != "-" else None

    async def listen(self, fd: int) -> None:
        """Read lines from ``fd`` until it closes (returns then: the parent is gone)."""
        os.set_blocking(fd, False)
        pending = b""
        while True:
            await anyio.wait_readable(fd)
            try:
                chunk = os.read(fd, 4096)
            except BlockingIOError:
                continue
            if not chunk:
                return
            *lines, pending = (pending + chunk).split(b"\n")
            for line in lines:
                self.heard(line.decode(errors="replace"))
