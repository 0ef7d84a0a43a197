"""Sizing: 1, 2 and 4 worker processes on one Postgres, and what each step costs the database.

Each configuration starts its ``toren worker`` processes (each capped at its share of the
actors with ``TOREN_MAX_ACTORS``, so that every worker gets its share: uncapped, the first to
wake claims them all), waits until every one has registered and imported its provider SDK, and
then gives 200 actors a chain of kernel steps each (the kernel section's step: one message in,
one event out, the next message sent to itself) until a wall-clock instant a few seconds away.
With that many busy actors per worker, each worker's steps queue for its commit lanes and go to
Postgres in batches (group commit).

- steps/s: journal rows appended in a window in the middle of the chains (Postgres' clock),
  when every actor is claimed and busy;
- per step, over the whole configuration (idle workers before the chains start to idle workers
  after they end, counters read once the backends have reported them): WAL bytes and records,
  WAL flushes (``pg_stat_wal.wal_sync``; ``wal_write`` under an ``open_*`` sync method, which
  writes and flushes at once), transactions committed (a hint of the batches: a batch of 20
  steps is one), and CPU time, of every Postgres server process (the postmaster, its children,
  and the children it has reaped, from ``/proc``) and of the workers;
- from the workers' logs: the batches they committed and the steps in them (the line each logs
  as it stops), and the deadlocks Postgres broke in their commits or lease renewals (each a
  stall of ``deadlock_timeout``, 1 s, then a retry).

Beside them, what the disk gives: 8 kB written and ``fdatasync``-ed at the same place, again and
again for one second, in a file beside Postgres' data directory, on its file system (what
``pg_test_fsync`` measures for ``fdatasync``). WAL flushes per step times steps/s cannot go past
that rate, so it bounds what one Postgres can do on this disk at the flushes per step measured.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import time
import uuid
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import asyncpg
import attrs
import psutil

from bench._common import Bench
from bench.app import Pace, Pacer
from toren import Client

WORKERS = (1, 2, 4)
# A reader may try other commit settings: these reach the section's workers.
PASSED_ON = ("TOREN_POOL_SIZE", "TOREN_COMMIT_LANES", "TOREN_COMMIT_BATCH")
BLOCK = 8192
# What a worker logs as it stops (supervisors/worker/tree.py).
DOWN = re.compile(r"down \(group commit: (\d+) batches, (\d+) steps in them\)")


@attrs.frozen
class _Sample:
    """Cumulative counters at one moment."""

    wal: dict[str, int]  # pg_stat_wal's counters
    xact_commit: int  # this database's committed transactions
    postgres_cpu: float  # seconds, every server process
    workers_cpu: float  # seconds, the configuration's workers


async def run(b: Bench) -> None:
    actors = b.count(200, 8)
    window = 2.5 if not b.smoke else 0.3
    async with await Client.connect(b.url) as client:
        data_dir = Path(await client.pool.fetchval("SHOW data_directory"))
        method = await client.pool.fetchval("SHOW wal_sync_method")
        probe_s = 1.0 if not b.smoke else 0.1
        disk = await anyio.to_thread.run_sync(_disk_flushes_per_s, data_dir, probe_s)
        configurations: dict[str, dict[str, Any]] = {}
        for n in WORKERS if not b.smoke else (2,):  # smoke: one configuration, two processes
            configurations[str(n)] = await _configuration(
                b, client, n, actors, window, data_dir, method
            )
    b.results["sizing"] = {
        "actors": actors,
        "window_s": window,
        "wal_sync_method": method,
        "disk_flushes_per_s": round(disk),
        "workers": configurations,
    }
    b.record(
        "sizing_disk_flushes_per_s",
        round(disk),
        "disk: 8 kB write + fdatasync, one after another",
        f"{disk:,.0f}/s",
        f"beside Postgres' data directory, for {probe_s:g} s (as pg_test_fsync does)",
    )
    for workers, c in configurations.items():
        b.record(
            f"sizing_steps_per_s_{workers}w",
            c["steps_per_s"],
            f"sizing: {workers} worker process{'es' if workers != '1' else ''}, {actors} "
            "busy actors",
            f"{c['steps_per_s']:,.0f} steps/s",
            f"per step: {c['wal_bytes']:,.0f} B WAL, {c['wal_flushes']:.3f} WAL flushes, "
            f"Postgres CPU {c['postgres_cpu_ms']:.3f} ms, workers' {c['workers_cpu_ms']:.3f} ms; "
            f"{c['batched_steps'] / max(1, c['steps']):.0%} of steps in batches "
            f"(mean {c['batched_steps'] / max(1, c['batches']):.1f})"
            + (f"; {c['deadlocks']} deadlocks" if c["deadlocks"] else ""),
        )
    best = max(configurations.values(), key=lambda c: c["steps_per_s"])
    if best["wal_flushes"] > 0:
        top = disk / best["wal_flushes"]
        b.record(
            "sizing_flush_bound_steps_per_s",
            round(top),
            "sizing: one Postgres tops out near (WAL flushes)",
            f"{top:,.0f} steps/s",
            f"at {best['wal_flushes']:.3f} flushes/step (the best configuration's) against "
            f"{disk:,.0f} flushes/s from this disk",
        )
    if best["postgres_cpu_ms"] > 0:
        per_core = 1000 / best["postgres_cpu_ms"]
        b.record(
            "sizing_cpu_bound_steps_per_s_per_core",
            round(per_core),
            "sizing: steps/s per core of Postgres CPU",
            f"{per_core:,.0f} steps/s",
            f"at {best['postgres_cpu_ms']:.3f} ms of Postgres CPU per step",
        )


def _disk_flushes_per_s(data_dir: Path, seconds: float) -> float:
    """8 kB written at the start of a 16 MB file and flushed (``fdatasync``), again and again:
    how many a second. The file sits beside Postgres' data directory, on its file system."""
    probe = data_dir.parent / "sizing-fsync-probe"
    fd = os.open(probe, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, bytes(16 * 2**20))  # allocated first, as a WAL segment is
        os.fsync(fd)
        block = os.urandom(BLOCK)
        flushes = 0
        started = time.perf_counter()
        while (elapsed := time.perf_counter() - started) < seconds:
            os.pwrite(fd, block, 0)
            os.fdatasync(fd)
            flushes += 1
        return flushes / elapsed
    finally:
        os.close(fd)
        probe.unlink()


def _postgres_cpu(data_dir: Path) -> float:
    """CPU seconds of the Postgres server so far: its postmaster, the children it has reaped
    (ended backends), and its children still alive."""
    pid = int((data_dir / "postmaster.pid").read_text().split()[0])
    postmaster = psutil.Process(pid)
    t = postmaster.cpu_times()
    total = t.user + t.system + t.children_user + t.children_system
    for child in postmaster.children():
        try:
            c = child.cpu_times()
        except psutil.NoSuchProcess:  # ended meanwhile: counted among the reaped next time
            continue
        total += c.user + c.system
    return total


def _workers_cpu(procs: list[subprocess.Popen[bytes]]) -> float:
    total = 0.0
    for proc in procs:
        t = psutil.Process(proc.pid).cpu_times()
        total += t.user + t.system
    return total


async def _sample(
    pool: asyncpg.Pool, data_dir: Path, procs: list[subprocess.Popen[bytes]]
) -> _Sample:
    row = await pool.fetchrow(
        "SELECT w.wal_records, w.wal_bytes::bigint AS wal_bytes, w.wal_write, w.wal_sync, "
        "d.xact_commit FROM pg_stat_wal w, pg_stat_database d "
        "WHERE d.datname = current_database()"
    )
    assert row is not None
    counters = {k: int(v) for k, v in row.items()}
    xacts = counters.pop("xact_commit")
    return _Sample(counters, xacts, _postgres_cpu(data_dir), _workers_cpu(procs))


async def _ready_workers(
    b: Bench, client: Client, n: int, actors: int
) -> list[subprocess.Popen[bytes]]:
    """``n`` workers started, registered and done importing their SDK (so that no import runs
    in the middle of the measurement)."""
    env = {k: v for k, v in os.environ.items() if k in PASSED_ON}
    env["TOREN_MAX_ACTORS"] = str(math.ceil(actors / n))
    logs = [b.tmp / f"sizing-{n}-{i}.log" for i in range(n)]
    procs = [b.start_worker(env, log) for log in logs]
    deadline = time.monotonic() + 120  # for them all
    for proc, log in zip(procs, logs, strict=True):
        await b.wait_ready(client.pool, proc, log, within=max(1.0, deadline - time.monotonic()))
    return procs


async def _steps(client: Client, ids: list[str]) -> tuple[int, float]:
    """Events appended so far by ``ids``, and when (Postgres' clock, seconds)."""
    row = await client.pool.fetchrow(
        "SELECT extract(epoch FROM clock_timestamp())::float8 AS at, "
        "(SELECT count(*) FROM toren.journal WHERE actor_id = ANY($1)) AS n",
        ids,
    )
    assert row is not None
    return int(row["n"]), float(row["at"])


async def _configuration(
    b: Bench,
    client: Client,
    n: int,
    actors: int,
    window: float,
    data_dir: Path,
    method: str,
) -> dict[str, Any]:
    tag = uuid.uuid4().hex[:8]  # a configuration run again gets actors of its own
    ids = [f"bench/sizing/{n}w-{tag}/{i}" for i in range(actors)]
    settle = 1.5 if not b.smoke else 0.1  # backends report their statistics at most once a second
    with b.task(f"sizing: {n} worker(s)", 1):
        procs = await _ready_workers(b, client, n, actors)
        try:
            for actor_id in ids:
                await client.spawn(Pacer, actor_id)
            await anyio.sleep(settle)
            before = await _sample(client.pool, data_dir, procs)
            ramp = 1.0 if not b.smoke else 0.1
            until = time.time() + ramp + window + 0.2
            async with client.pool.acquire() as conn, conn.transaction():
                for actor_id in ids:
                    await client.send(actor_id, Pace(n=1, until=until), conn=conn)
            await anyio.sleep(ramp)
            first, t1 = await _steps(client, ids)
            await anyio.sleep(window)
            last, t2 = await _steps(client, ids)
            total = await _ended(client, ids, until)
            await anyio.sleep(settle)
            after = await _sample(client.pool, data_dir, procs)
        finally:
            b.stop_workers()
    flushes = "wal_write" if method.startswith("open_") else "wal_sync"
    batches, batched, deadlocks = _batches(b.tmp.glob(f"sizing-{n}-*.log"))
    return {
        "deadlocks": deadlocks,
        "batches": batches,
        "batched_steps": batched,  # of all steps, these went in batches (the rest alone)
        "steps_per_s": round((last - first) / (t2 - t1)),
        "steps": total,
        "wal_bytes": round((after.wal["wal_bytes"] - before.wal["wal_bytes"]) / total, 1),
        "wal_records": round((after.wal["wal_records"] - before.wal["wal_records"]) / total, 2),
        "wal_flushes": round((after.wal[flushes] - before.wal[flushes]) / total, 4),
        "wal_writes": round((after.wal["wal_write"] - before.wal["wal_write"]) / total, 4),
        "transactions": round((after.xact_commit - before.xact_commit) / total, 4),
        "postgres_cpu_ms": round((after.postgres_cpu - before.postgres_cpu) * 1000 / total, 4),
        "workers_cpu_ms": round((after.workers_cpu - before.workers_cpu) * 1000 / total, 4),
    }


def _batches(logs: Iterable[Path]) -> tuple[int, int, int]:
    """The batches the workers committed and the steps in them, from the line each logs as it
    stops; and the deadlocks they were told of (a commit or a lease renewal that Postgres
    chose to break a cycle of lock waits, after ``deadlock_timeout``: retried, but a stall)."""
    texts = [log.read_text(errors="replace") for log in logs]
    found = [DOWN.search(text) for text in texts]
    return (
        sum(int(m.group(1)) for m in found if m),
        sum(int(m.group(2)) for m in found if m),
        sum(text.count("deadlock detected") for text in texts),
    )


async def _ended(client: Client, ids: list[str], until: float) -> int:
    """Waits for every chain to end (past ``until``, no event for a while); the events."""
    deadline = until + 60
    seen, at = -1, 0.0
    while True:
        await anyio.sleep(0.2)
        count, _ = await _steps(client, ids)
        if count != seen:
            seen, at = count, time.time()
        elif time.time() > until and time.time() - at >= 0.5:
            return count
        if time.time() > deadline:
            raise RuntimeError(f"the sizing chains did not end: {count} steps so far")
