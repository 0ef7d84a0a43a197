"""Takeover: SIGKILL the worker that owns an actor mid-message; how long until another worker
appends the actor's next event?

Runs two ``toren worker`` processes with the default lease settings (lease 15 s, renewal 5 s,
polling 1 s) on an embedded Postgres, over N trials (default 20), restarting the killed worker
after each. Prints the median and the maximum next to the baseline a lease-expiry-only design
waits for (the lease, 15 s; the product Toren descends from waits up to 60 s).

    python -m bench.takeover [--trials 20]
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import anyio
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from bench.app import Hold, Holder
from toren import Client, Settings
from toren.kernel import EmbeddedPostgres, connect, migrate

ROOT = Path(__file__).resolve().parent.parent
console = Console()


def start_worker(url: str, log: Path) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOREN_")}
    env.update({"TOREN_DATABASE_URL": url, "PYTHONPATH": str(ROOT)})
    with log.open("ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "toren", "worker", "--app", "bench.app"],
            env=env,
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
        )


async def wait_registered(client: Client, pid: int) -> None:
    while not await client.pool.fetchval("SELECT count(*) FROM toren.workers WHERE pid=$1", pid):
        await anyio.sleep(0.02)


async def trial(
    client: Client, i: int, procs: dict[int, subprocess.Popen[bytes]], tmp: Path, url: str
) -> float:
    actor_id = f"bench/takeover/{i}"
    marker = tmp / f"marker-{i}"
    await client.spawn(Holder, actor_id)
    await client.send(actor_id, Hold(seconds=120, marker=str(marker)))
    while not marker.exists() or not marker.read_text():
        await anyio.sleep(0.005)
    owner = int(marker.read_text())
    killed_at = time.monotonic()
    os.kill(owner, signal.SIGKILL)
    while not await client.pool.fetchval(
        "SELECT count(*) FROM toren.journal WHERE actor_id = $1", actor_id
    ):
        await anyio.sleep(0.002)
    took = time.monotonic() - killed_at
    procs.pop(owner).wait()
    new = start_worker(url, tmp / "workers.log")
    procs[new.pid] = new
    await wait_registered(client, new.pid)
    return took


async def main(trials: int) -> None:
    defaults = Settings()
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        server = EmbeddedPostgres(tmp / "pg")
        url = server.url
        conn = await connect(url)
        await migrate(conn)
        await conn.close()
        procs: dict[int, subprocess.Popen[bytes]] = {}
        client = await Client.connect(url)
        try:
            for _ in range(2):
                p = start_worker(url, tmp / "workers.log")
                procs[p.pid] = p
            for pid in procs:
                await wait_registered(client, pid)
            times: list[float] = []
            with Progress(console=console, transient=True) as progress:
                task = progress.add_task("takeover trials", total=trials)
                for i in range(trials):
                    times.append(await trial(client, i, procs, tmp, url))
                    progress.advance(task)
        finally:
            await client.close()
            for p in procs.values():
                p.kill()
                p.wait()
            server.stop()
    table = Table(
        title=f"Takeover after SIGKILL, {trials} trials (lease {defaults.lease_seconds:g}s)"
    )
    for col in ("figure", "seconds", "vs lease expiry"):
        table.add_column(col)
    median, worst = statistics.median(times), max(times)
    for name, value in (("median", median), ("max", worst), ("min", min(times))):
        table.add_row(name, f"{value:.3f}", f"{defaults.lease_seconds / value:.0f}x faster")
    table.add_row("baseline: lease expiry", f"{defaults.lease_seconds:.3f}", "1x")
    console.print(table)
    target = "met" if median < 1.0 else "NOT met"
    console.print(f"target median < 1 s: {target}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=20)
    args = parser.parse_args()
    anyio.run(main, args.trials)
