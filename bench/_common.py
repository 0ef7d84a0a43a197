"""What every benchmark section shares: the database, worker processes, progress, results."""

from __future__ import annotations

import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import anyio
import asyncpg
import attrs
import psutil
from rich.progress import Progress, TaskID

ROOT = Path(__file__).resolve().parent.parent
SDK_IMPORTED = b"imported the anthropic SDK"  # what a bench.app worker logs once it has


def median_ms(seconds: list[float]) -> float:
    return statistics.median(seconds) * 1000


def p99_ms(seconds: list[float]) -> float:
    ordered = sorted(seconds)
    return ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))] * 1000


@attrs.define
class Bench:
    """One run of the suite: one embedded Postgres, a scratch directory, the counts to use."""

    url: str
    tmp: Path
    smoke: bool
    progress: Progress
    results: dict[str, Any] = attrs.field(factory=dict)
    rows: list[tuple[str, str, str]] = attrs.field(factory=list)  # (figure, value, note)
    _workers: list[subprocess.Popen[bytes]] = attrs.field(factory=list)

    def count(self, full: int, smoke: int) -> int:
        return smoke if self.smoke else full

    def record(self, key: str, value: Any, figure: str, shown: str, note: str = "") -> None:
        """A result: stored under ``key`` in results.json and shown as a row of the table."""
        self.results[key] = value
        self.rows.append((figure, shown, note))

    def ratio(self, key: str, value: float, baseline: str, figure: str, target: str) -> None:
        """Record ``value`` over the result ``baseline``, if this run measured that baseline
        (``--only`` may have left it out)."""
        base = self.results.get(baseline)
        if base:
            r = value / base
            self.record(key, round(r, 2), figure, f"{r:.2f}x", target)

    @contextmanager
    def task(self, description: str, total: int) -> Iterator[TaskID]:
        task = self.progress.add_task(description, total=total)
        try:
            yield task
        finally:
            self.progress.update(task, completed=total, visible=False)

    def start_worker(
        self, env: Mapping[str, str] | None = None, log: Path | None = None
    ) -> subprocess.Popen[bytes]:
        """A ``toren worker --app bench.app`` process on the suite's database (its output to
        ``log``, by default the suite's ``workers.log``)."""
        return self.start_toren(["worker", "--app", "bench.app"], env, log)

    async def start_ready_worker(
        self, pool: asyncpg.Pool, name: str, env: Mapping[str, str] | None = None
    ) -> subprocess.Popen[bytes]:
        """A ``toren worker --app bench.app`` process, registered and done importing its agents'
        provider SDK (Anthropic's for ``bench.app``), its output in ``worker-NAME.log``.

        A worker serves before that import ends (1-2 s in a thread, with garbage collections
        that stop its event loop meanwhile): a section that measures steps waits for it, so
        that it measures a worker that has finished starting, as every worker was when SDKs
        were imported before registering."""
        log = self.tmp / f"worker-{name}.log"
        proc = self.start_worker(env, log)
        await self.wait_ready(pool, proc, log)
        return proc

    async def wait_ready(
        self, pool: asyncpg.Pool, proc: subprocess.Popen[bytes], log: Path, within: float = 60
    ) -> None:
        """Wait until the worker ``proc`` (its output in ``log``, its own) is registered and
        done importing its SDK."""
        deadline = time.monotonic() + within
        await self.wait_registered(pool, proc, log)
        while SDK_IMPORTED not in log.read_bytes():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"worker {proc.pid} did not import its SDK; see {log}")
            await anyio.sleep(0.02)

    def environ(self, env: Mapping[str, str] | None = None) -> dict[str, str]:
        """The environment of a ``toren`` process on the suite's database: this one's, without
        its ``TOREN_`` variables, with ``env`` added."""
        environ = {k: v for k, v in os.environ.items() if not k.startswith("TOREN_")}
        environ.update({"TOREN_DATABASE_URL": self.url, "PYTHONPATH": str(ROOT)})
        environ.update(env or {})
        return environ

    def start_toren(
        self, args: list[str], env: Mapping[str, str] | None = None, log: Path | None = None
    ) -> subprocess.Popen[bytes]:
        """A ``toren ARGS`` process on the suite's database (stopped by :meth:`stop_workers`),
        its output appended to ``log`` (by default the suite's ``workers.log``)."""
        with (log or self.tmp / "workers.log").open("ab") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", "toren", *args],
                env=self.environ(env),
                cwd=ROOT,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        self._workers.append(proc)
        return proc

    async def wait_registered(
        self, pool: asyncpg.Pool, proc: subprocess.Popen[bytes], log: Path | None = None
    ) -> None:
        """Wait until ``proc`` is registered (its output in ``log``, by default ``workers.log``)."""
        deadline = time.monotonic() + 60
        while not await pool.fetchval(
            "SELECT count(*) FROM toren.workers WHERE pid = $1", proc.pid
        ):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(
                    f"worker {proc.pid} did not start; see {log or self.tmp / 'workers.log'}"
                )
            await anyio.sleep(0.02)

    def stop_workers(self) -> None:
        """SIGTERM every worker (a graceful stop releases its leases), SIGKILL past 30 s."""
        for proc in self._workers:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self._workers:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._workers.clear()


def rss_mb(pid: int) -> float:
    return float(psutil.Process(pid).memory_info().rss) / 2**20


async def db_counters(pool: asyncpg.Pool) -> dict[str, int]:
    """Cumulative write counters of the server and this database (for per-step deltas)."""
    row = await pool.fetchrow(
        "SELECT w.wal_bytes::bigint AS wal_bytes, w.wal_records, w.wal_sync, "
        "d.tup_inserted + d.tup_updated + d.tup_deleted AS rows_written "
        "FROM pg_stat_wal w, pg_stat_database d WHERE d.datname = current_database()"
    )
    assert row is not None
    return dict(row)


async def per_step(pool: asyncpg.Pool, before: dict[str, int], steps: int) -> dict[str, float]:
    """What ``steps`` cost the database since ``before``: WAL bytes, rows written, WAL flushes.

    Statistics reach the views when a backend reports them: the numbers are read after a pause.
    """
    await anyio.sleep(1.5)  # backends flush their statistics at most once a second
    after = await db_counters(pool)
    return {key: round((after[key] - before[key]) / steps, 1) for key in before}
