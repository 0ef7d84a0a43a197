"""A Postgres cluster with failover for tests: one etcd and two Postgres servers under Patroni 4,
synchronous replication on, everything on 127.0.0.1, started and torn down by the caller.

What it needs, and where it finds it (:func:`missing` says what is not there):

- ``etcd`` (Debian's ``etcd-server``), Postgres binaries (``/usr/lib/postgresql/<major>/bin``,
  Debian's ``postgresql``), ``pgbouncer`` for :class:`Bouncer`;
- Patroni 4 from PyPI in a virtualenv of its own (never Debian's 3.0.2, which lost acknowledged
  writes when restarted over a stale primary): ``$TOREN_PATRONI``, else the virtualenv beside the
  one running the tests (``<venv>-patroni/bin/patroni``), which ``scripts/test`` creates through
  ``scripts/patroni-venv`` (or ``/opt/toren-patroni`` where the postgres user cannot reach it).

Run as root (CI, this machine), Postgres, Patroni, etcd and PgBouncer run as the ``postgres``
user through ``setpriv`` (which execs: the pid we hold is the server's, not a wrapper's); run as
anyone else, as that user. Two faults: :meth:`Cluster.kill_postmaster` (Patroni promotes the sync
standby in a few seconds; the old primary rejoins as a replica by itself) and
:meth:`Cluster.kill_patroni` (its Postgres stays up as a stale primary whose commits block once
the standby is promoted). :meth:`Cluster.stop` stops everything, orphans included.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from types import TracebackType
from typing import IO, Self

import aiohttp
import anyio
import asyncpg
import psutil

PASSWORD = "toren-ha"  # the superuser's, on loopback only
SCOPE = "toren-ha"
_PG_USER = "postgres"


def patroni_bin() -> Path:
    """Where Patroni 4 is: ``$TOREN_PATRONI``, else the virtualenv ``scripts/patroni-venv``
    makes beside this one (``<venv>-patroni``), else its fallback ``/opt/toren-patroni``."""
    given = os.environ.get("TOREN_PATRONI")
    if given:
        return Path(given)
    beside = Path(f"{sys.prefix.rstrip('/')}-patroni") / "bin" / "patroni"
    fallback = Path("/opt/toren-patroni/bin/patroni")
    return fallback if not beside.exists() and fallback.exists() else beside


def postgres_bin() -> Path | None:
    """The newest Debian Postgres binaries directory, if any."""
    found = sorted(
        Path("/usr/lib/postgresql").glob("*/bin/postgres"), key=lambda p: int(p.parent.parent.name)
    )
    return found[-1].parent if found else None


def missing(*, bouncer: bool = False) -> str | None:
    """What the cluster (and, with ``bouncer``, PgBouncer) needs and is not here, or ``None``."""
    problems = []
    if shutil.which("etcd") is None:
        problems.append("etcd (apt: etcd-server etcd-client)")
    if postgres_bin() is None:
        problems.append("Postgres binaries (apt: postgresql)")
    if bouncer and shutil.which("pgbouncer") is None:
        problems.append("pgbouncer (apt: pgbouncer)")
    if os.geteuid() == 0 and shutil.which("setpriv") is None:
        problems.append("setpriv (to run Postgres as the postgres user)")
    elif not _runs(patroni_bin()):
        problems.append(
            f"Patroni 4 at {patroni_bin()}, runnable by the cluster's user "
            "(scripts/patroni-venv makes it; or set $TOREN_PATRONI)"
        )
    return "; ".join(problems) or None


def _runs(patroni: Path) -> bool:
    """Whether the cluster's user can run ``patroni`` (a Python under /root is out of reach)."""
    try:
        done = subprocess.run(
            _as_postgres([str(patroni), "--version"]), capture_output=True, timeout=30, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0 and done.stdout.startswith(b"patroni 4.")


def _free_ports(n: int) -> list[int]:
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _as_postgres(argv: Sequence[str]) -> list[str]:
    """The command run as the postgres user (when we are root: Postgres refuses root)."""
    if os.geteuid() != 0:
        return list(argv)
    return [
        "setpriv",
        f"--reuid={_PG_USER}",
        f"--regid={_PG_USER}",
        "--init-groups",
        "env",
        "HOME=/var/lib/postgresql",
        *argv,
    ]


def _chown(path: Path) -> None:
    if os.geteuid() == 0:
        shutil.chown(path, _PG_USER, _PG_USER)


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie answers ``kill -0`` but is dead)."""
    try:
        return psutil.Process(pid).status() not in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)
    except psutil.NoSuchProcess:
        return False


class _Process:
    """A server process we started (its pid is the server's: setpriv execs), logging to a file."""

    def __init__(self, argv: Sequence[str], log: Path) -> None:
        self.log_path = log
        self._log: IO[bytes] = log.open("ab")
        self.proc = subprocess.Popen(
            _as_postgres(argv),
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # a Ctrl-C of the tests is not theirs
        )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def running(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL, and reap it (no zombie left)."""
        if self.running():
            self.proc.kill()
        self.proc.wait(10)
        self._log.close()

    def stop(self, timeout: float = 20) -> None:
        """SIGTERM, then SIGKILL after ``timeout``; reaped either way."""
        if self.running():
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()


class Node:
    """One Postgres server and the Patroni that manages it."""

    def __init__(
        self, name: str, root: Path, *, pg_port: int, api_port: int, etcd_port: int
    ) -> None:
        self.name = name
        self.pg_port = pg_port
        self.api_port = api_port
        self.home = root / name
        self.data_dir = self.home / "data"
        self.config = self.home / "patroni.yml"
        self.log = root / f"{name}-patroni.log"
        self.patroni: _Process | None = None
        self.home.mkdir(parents=True)
        _chown(self.home)
        self.config.write_text(json.dumps(self._settings(etcd_port), indent=1))  # YAML is JSON

    def _settings(self, etcd_port: int) -> dict[str, object]:
        bin_dir = postgres_bin()
        auth = "scram-sha-256"
        return {
            "scope": SCOPE,
            "name": self.name,
            "log": {"level": "INFO"},
            "restapi": {
                "listen": f"127.0.0.1:{self.api_port}",
                "connect_address": f"127.0.0.1:{self.api_port}",
            },
            "etcd3": {"hosts": f"127.0.0.1:{etcd_port}"},  # etcd 3.4 has its v2 API off
            "bootstrap": {
                "dcs": {
                    "ttl": 20,  # Patroni's least
                    "loop_wait": 1,
                    "retry_timeout": 5,
                    "primary_start_timeout": 0,
                    "synchronous_mode": True,
                    "postgresql": {
                        "use_pg_rewind": True,
                        "parameters": {
                            "wal_log_hints": "on",
                            "max_connections": 200,
                            "shared_buffers": "32MB",
                        },
                    },
                },
                "initdb": [{"encoding": "UTF8"}, {"auth-host": auth}, {"auth-local": "trust"}],
            },
            "postgresql": {
                "listen": f"127.0.0.1:{self.pg_port}",
                "connect_address": f"127.0.0.1:{self.pg_port}",
                "data_dir": str(self.data_dir),
                "bin_dir": str(bin_dir),
                "pgpass": str(self.home / "pgpass"),
                "authentication": {
                    "superuser": {"username": "postgres", "password": PASSWORD},
                    "replication": {"username": "replicator", "password": PASSWORD},
                    "rewind": {"username": "postgres", "password": PASSWORD},
                },
                "pg_hba": [
                    "local all all trust",
                    f"host replication replicator 127.0.0.1/32 {auth}",
                    f"host all all 127.0.0.1/32 {auth}",
                ],
                "parameters": {"unix_socket_directories": str(self.home)},
            },
        }

    def start_patroni(self) -> None:
        self.patroni = _Process([str(patroni_bin()), str(self.config)], self.log)

    def postmaster_pid(self) -> int | None:
        """The running postmaster's pid (from ``postmaster.pid``), or ``None``."""
        try:
            pid = int((self.data_dir / "postmaster.pid").read_text().split("\n", 1)[0])
        except (OSError, ValueError):
            return None
        return pid if alive(pid) else None

    def stop_orphan(self) -> None:
        """Stop a Postgres whose Patroni is gone (immediate: never two Patronis on one data
        directory, and never a restarted Patroni over a running stale primary)."""
        pid = self.postmaster_pid()
        if pid is None:
            return
        os.kill(pid, signal.SIGQUIT)  # immediate shutdown
        deadline = time.monotonic() + 20
        while alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        if alive(pid):
            os.kill(pid, signal.SIGKILL)

    async def role(self) -> str | None:
        """``"primary"``, ``"replica"`` or ``None``, by Patroni's REST API."""
        for role in ("primary", "replica"):
            if await _http_ok(f"http://127.0.0.1:{self.api_port}/{role}"):
                return role
        return None


async def _http_ok(url: str) -> bool:
    try:
        async with (
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as session,
            session.get(url) as response,
        ):
            return response.status == 200
    except (aiohttp.ClientError, TimeoutError, OSError):
        return False


async def _members(node: Node) -> list[dict[str, object]]:
    """The members as ``node``'s Patroni sees them (``GET /cluster``), or none."""
    try:
        async with (
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as session,
            session.get(f"http://127.0.0.1:{node.api_port}/cluster") as response,
        ):
            if response.status != 200:
                return []
            body = await response.json()
    except (aiohttp.ClientError, TimeoutError, OSError, ValueError):
        return []
    members = body.get("members") if isinstance(body, dict) else None
    return [m for m in members or () if isinstance(m, dict)]


async def _until(what: str, check: object, timeout: float, logs: Sequence[Path] = ()) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if await check():  # type: ignore[operator]
            return
        if time.monotonic() > deadline:
            tails = "".join(
                f"\n--- {p.name} (tail) ---\n{p.read_text(errors='replace')[-3000:]}"
                for p in logs
                if p.exists()
            )
            raise TimeoutError(f"HA cluster: {what} not within {timeout}s{tails}")
        await anyio.sleep(0.1)


class Cluster:
    """etcd and two Patroni-managed Postgres servers on 127.0.0.1 (see the module docstring).

    Use ``async with Cluster() as cluster``: on entry a primary streams to a synchronous
    standby; on exit everything is stopped and its files removed.
    """

    def __init__(self, root: Path | None = None) -> None:
        self.root = root or Path(tempfile.mkdtemp(prefix="toren-ha-"))
        self._owned_root = root is None
        _chown(self.root)
        etcd_client, etcd_peer, pg1, pg2, api1, api2 = _free_ports(6)
        self.etcd_port = etcd_client
        self._etcd_peer = etcd_peer
        self.nodes = (
            Node("pg1", self.root, pg_port=pg1, api_port=api1, etcd_port=etcd_client),
            Node("pg2", self.root, pg_port=pg2, api_port=api2, etcd_port=etcd_client),
        )
        self._etcd: _Process | None = None

    def url(self, database: str = "postgres", *, nodes: Sequence[Node] | None = None) -> str:
        """A multi-host URL that finds the writable server (``target_session_attrs``)."""
        hosts = ",".join(f"127.0.0.1:{n.pg_port}" for n in nodes or self.nodes)
        return (
            f"postgresql://postgres:{PASSWORD}@{hosts}/{database}?target_session_attrs=read-write"
        )

    def node_url(self, node: Node, database: str = "postgres") -> str:
        """A URL of one server, whatever its role."""
        return f"postgresql://postgres:{PASSWORD}@127.0.0.1:{node.pg_port}/{database}"

    @property
    def logs(self) -> list[Path]:
        return [self.root / "etcd.log", *(n.log for n in self.nodes)]

    async def __aenter__(self) -> Self:
        try:
            await self.start()
        except BaseException:
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(self.stop)
            raise
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(self.stop)

    async def start(self) -> None:
        """etcd, then the first node (the primary), then the second (its sync standby)."""
        etcd_dir = self.root / "etcd"
        etcd_dir.mkdir()
        _chown(etcd_dir)
        client, peer = f"http://127.0.0.1:{self.etcd_port}", f"http://127.0.0.1:{self._etcd_peer}"
        self._etcd = _Process(
            [
                "etcd",
                "--name=ha",
                f"--data-dir={etcd_dir}",
                f"--listen-client-urls={client}",
                f"--advertise-client-urls={client}",
                f"--listen-peer-urls={peer}",
                f"--initial-advertise-peer-urls={peer}",
                f"--initial-cluster=ha={peer}",
                "--log-level=warn",
            ],
            self.root / "etcd.log",
        )
        await _until("etcd healthy", lambda: _http_ok(f"{client}/health"), 20, self.logs)
        first, second = self.nodes
        first.start_patroni()
        await _until("pg1 primary", lambda: _is(first, "primary"), 60, self.logs)
        second.start_patroni()
        await self.wait_sync_standby(timeout=90)

    async def leader(self, timeout: float = 60) -> Node:
        """The node Patroni says is the primary (waiting for one)."""
        found: list[Node] = []

        async def one() -> bool:
            for node in self.nodes:
                if node.patroni is not None and await node.role() == "primary":
                    found[:] = [node]
                    return True
            return False

        await _until("a primary", one, timeout, self.logs)
        return found[0]

    def other(self, node: Node) -> Node:
        return self.nodes[1] if node is self.nodes[0] else self.nodes[0]

    async def wait_sync_standby(self, timeout: float = 60) -> tuple[Node, Node]:
        """Wait until the primary streams to the other node and Patroni has recorded that node
        as its synchronous standby (its ``/sync`` key: what makes it a failover candidate);
        returns ``(primary, standby)``."""
        found: list[Node] = []

        async def streaming() -> bool:
            for node in self.nodes:
                members = await _members(node)
                roles = {m.get("name"): (m.get("role"), m.get("state")) for m in members}
                leader = [n for n in self.nodes if roles.get(n.name, ("",))[0] == "leader"]
                if not leader:
                    continue
                standby = self.other(leader[0])
                if roles.get(standby.name) == ("sync_standby", "streaming") and await _is(
                    leader[0], "primary"
                ):
                    found[:] = [leader[0]]
                    return True
            return False

        await _until("a streaming synchronous standby", streaming, timeout, self.logs)
        return found[0], self.other(found[0])

    def kill_postmaster(self, node: Node) -> int:
        """SIGKILL the node's postmaster (its Patroni lives on); returns the pid killed."""
        pid = node.postmaster_pid()
        if pid is None:
            raise RuntimeError(f"{node.name} has no running postmaster")
        os.kill(pid, signal.SIGKILL)
        return pid

    async def expire_leader(self) -> None:
        """Delete the leader key from etcd: what its TTL (20 s, Patroni's least) does after its
        Patroni died, at once. The sync standby then takes the key and is promoted."""
        done = await anyio.run_process(
            [
                "etcdctl",
                f"--endpoints=127.0.0.1:{self.etcd_port}",
                "del",
                f"/service/{SCOPE}/leader",
            ],
            env={**os.environ, "ETCDCTL_API": "3"},
            check=False,
        )
        if done.returncode != 0 or done.stdout.strip() != b"1":
            raise RuntimeError(f"etcdctl del leader: {done.stdout!r} {done.stderr!r}")

    def kill_patroni(self, node: Node) -> None:
        """SIGKILL the node's Patroni: its Postgres stays up, managed by nobody."""
        if node.patroni is None:
            raise RuntimeError(f"{node.name} has no Patroni")
        node.patroni.kill()

    def restart_patroni(self, node: Node) -> None:
        """Start the node's Patroni again after :meth:`kill_patroni`, its orphaned Postgres
        stopped first (a Patroni restarted over a running stale primary is how rows got lost)."""
        if node.patroni is not None and node.patroni.running():
            raise RuntimeError(f"{node.name}'s Patroni still runs")
        node.stop_orphan()
        node.start_patroni()

    async def rejoined(self, node: Node, timeout: float = 60) -> None:
        """Wait until ``node`` is a replica streaming (synchronously) from the other."""
        await _until(f"{node.name} a replica", lambda: _is(node, "replica"), timeout, self.logs)
        _, standby = await self.wait_sync_standby(timeout)
        if standby is not node:
            raise AssertionError(f"{node.name} is not the standby")

    def stop(self) -> None:
        """TERM the Patronis (they stop their Postgres), stop any orphaned postmaster, TERM
        etcd, remove the files."""
        patronis = [n.patroni for n in self.nodes if n.patroni is not None]
        for patroni in patronis:  # all at once: each takes seconds to stop its Postgres
            if patroni.running():
                patroni.proc.terminate()
        for patroni in patronis:
            patroni.stop()
        for node in self.nodes:
            node.stop_orphan()
        if self._etcd is not None:
            self._etcd.stop()
        if self._owned_root and not os.environ.get("TOREN_HA_KEEP"):
            shutil.rmtree(self.root, ignore_errors=True)


async def _is(node: Node, role: str) -> bool:
    return await node.role() == role


class Bouncer:
    """PgBouncer in session mode on 127.0.0.1, in front of one server of a :class:`Cluster`.

    PgBouncer does not follow a failover: :meth:`point_at` rewrites its target and reloads it
    (what an operator's failover hook, or Patroni's ``on_role_change`` callback, does).
    """

    def __init__(self, cluster: Cluster, node: Node) -> None:
        self.cluster = cluster
        self.port = _free_ports(1)[0]
        self.home = cluster.root / "pgbouncer"
        self.home.mkdir(exist_ok=True)
        _chown(self.home)
        self.ini = self.home / "pgbouncer.ini"
        self._write(node)
        users = self.home / "users.txt"
        users.write_text(f'"postgres" "{PASSWORD}"\n')
        _chown(users)
        self._proc: _Process | None = None

    def _write(self, node: Node) -> None:
        self.ini.write_text(
            "[databases]\n"
            f"* = host=127.0.0.1 port={node.pg_port}\n"
            "[pgbouncer]\n"
            "listen_addr = 127.0.0.1\n"
            f"listen_port = {self.port}\n"
            f"unix_socket_dir = {self.home}\n"
            "auth_type = scram-sha-256\n"
            f"auth_file = {self.home / 'users.txt'}\n"
            "pool_mode = session\n"
            "max_client_conn = 200\n"
            "default_pool_size = 100\n"
            "server_check_delay = 0\n"
            "ignore_startup_parameters = extra_float_digits\n"
        )
        _chown(self.ini)

    def url(self, database: str = "postgres") -> str:
        return f"postgresql://postgres:{PASSWORD}@127.0.0.1:{self.port}/{database}"

    def start(self) -> None:
        self._proc = _Process(["pgbouncer", str(self.ini)], self.home / "pgbouncer.log")

    def point_at(self, node: Node) -> None:
        """Send new connections to ``node`` (SIGHUP reloads the configuration)."""
        self._write(node)
        if self._proc is not None:
            os.kill(self._proc.pid, signal.SIGHUP)

    async def ready(self, timeout: float = 20) -> None:
        async def answers() -> bool:
            try:
                conn = await asyncpg.connect(self.url(), timeout=2)
            except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError, TimeoutError):
                return False
            await conn.close()
            return True

        await _until("pgbouncer answering", answers, timeout, [self.home / "pgbouncer.log"])

    def stop(self) -> None:
        if self._proc is not None:
            self._proc.stop()


@contextlib.asynccontextmanager
async def bouncer(cluster: Cluster, node: Node) -> AsyncIterator[Bouncer]:
    """A started :class:`Bouncer`, stopped on exit."""
    b = Bouncer(cluster, node)
    b.start()
    try:
        await b.ready()
        yield b
    finally:
        b.stop()
