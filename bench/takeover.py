"""Takeover: SIGKILL the worker that owns an actor mid-message; how long until another worker
appends the actor's next event?

Two ``toren worker`` processes with the default lease settings (lease 15 s, renewal 5 s,
polling 1 s); each trial kills the owner and starts a replacement, so two workers are always up.
A lease-expiry-only design waits for the lease (15 s; the product Toren descends from waits up
to 60 s): Toren's workers watch each other's advisory locks and take over when one drops.
"""

from __future__ import annotations

import os
import signal
import statistics
import subprocess
import time

import anyio

from bench._common import Bench
from bench.app import Hold, Holder
from toren import Client, Settings


async def _trial(
    b: Bench, client: Client, i: int, procs: dict[int, subprocess.Popen[bytes]]
) -> float:
    actor_id = f"bench/takeover/{i}"
    marker = b.tmp / f"takeover-{i}"
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
    new = b.start_worker()
    procs[new.pid] = new
    await b.wait_registered(client.pool, new)
    return took


async def run(b: Bench) -> None:
    trials = b.count(20, 2)
    lease = Settings().lease_seconds
    async with await Client.connect(b.url) as client:
        try:
            procs = {p.pid: p for p in (b.start_worker(), b.start_worker())}
            for p in procs.values():
                await b.wait_registered(client.pool, p)
            times: list[float] = []
            with b.task("takeover: SIGKILL the owner", trials) as task:
                for i in range(trials):
                    times.append(await _trial(b, client, i, procs))
                    b.progress.advance(task)
        finally:
            b.stop_workers()
    median, worst = statistics.median(times), max(times)
    b.results["takeover_trials"] = trials
    b.record(
        "takeover_median_s",
        round(median, 3),
        f"takeover after SIGKILL, median of {trials}",
        f"{median:.3f} s",
        f"target < 1 s; lease expiry would take {lease:g} s",
    )
    b.record("takeover_max_s", round(worst, 3), "takeover, max", f"{worst:.3f} s", "target < 3 s")
