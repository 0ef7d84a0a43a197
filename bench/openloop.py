"""An open-loop HTTP load generator: GET one URL at a constant rate, whatever the answers do.

``python -m bench.openloop URL --rate 500 --seconds 10 --header 'Authorization: Bearer ...'``
prints one JSON object. The API section runs it in a process of its own, so that its CPU is its
own and the figure says whether the generator kept up.

Request ``i`` is due at ``start + i / rate`` and is sent then, on a connection of a keep-alive
pool, whether or not earlier requests have been answered (a closed loop such as ``wrk`` waits
for an answer before its connection sends again, so a slow answer delays the requests behind it
and hides them: coordinated omission). Each latency is counted from the request's due time, not
from when it went out, so a generator that falls behind is charged to the figure, never hidden
by it; how late requests went out is reported beside it (``send_lag_*``). One second at the
same rate warms the connections and the server's caches first and is not counted.

Reported: latency p50, p99 (nearest rank) and max; requests answered, failed (a connection
error or a status other than 200) and the rates sent and answered; and the generator's CPU time
over the counted wall time (``time.process_time``): near 1.0 would mean it was the bottleneck.
"""

from __future__ import annotations

import json
import math
import statistics
import sys
import time
from typing import Any

import aiohttp
import anyio
import click

WARM_UP_SECONDS = 1.0


async def _load(
    http: aiohttp.ClientSession, url: str, rate: float, seconds: float
) -> tuple[list[tuple[float, float]], list[float], int, float]:
    """Requests at ``rate`` for ``seconds``: when each answered one was due (from the start)
    and its latency from then, the send lags, the failures, and the wall time from the first
    due time to the last answer."""
    latencies: list[tuple[float, float]] = []
    lags: list[float] = []
    failed = 0

    async def one(due: float) -> None:
        nonlocal failed
        lags.append(time.perf_counter() - due)
        try:
            async with http.get(url) as answer:
                await answer.read()
                ok = answer.status == 200
        except aiohttp.ClientError:
            ok = False
        if ok:
            latencies.append((due - start, time.perf_counter() - due))
        else:
            failed += 1

    count = math.ceil(rate * seconds)
    start = time.perf_counter() + 0.01
    async with anyio.create_task_group() as tg:
        for i in range(count):
            due = start + i / rate
            wait = due - time.perf_counter()
            if wait > 0:
                await anyio.sleep(wait)
            tg.start_soon(one, due)
    return latencies, lags, failed, time.perf_counter() - start


def _ms(seconds: float) -> float:
    return round(seconds * 1000, 3)


def _p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]


async def generate(
    url: str, rate: float, seconds: float, headers: dict[str, str], dump: str | None = None
) -> dict[str, Any]:
    """Warm up, then load ``url`` at ``rate`` for ``seconds``; the figures (see the module).
    With ``dump``, each answered request's due time and latency (seconds) is written there,
    one pair a line."""
    connector = aiohttp.TCPConnector(limit=256)
    async with aiohttp.ClientSession(connector=connector, headers=headers) as http:
        await _load(http, url, rate, WARM_UP_SECONDS)
        cpu = time.process_time()
        answered, lags, failed, wall = await _load(http, url, rate, seconds)
        cpu = time.process_time() - cpu
    if not answered:
        raise click.ClickException(f"no request to {url} was answered with 200")
    if dump is not None:
        with open(dump, "w") as out:  # noqa: ASYNC230 (after the measurement)
            out.writelines(f"{due:.4f} {latency:.5f}\n" for due, latency in answered)
    latencies = [latency for _, latency in answered]
    slowest = max(answered, key=lambda a: a[1])
    return {
        "rate": rate,
        "seconds": seconds,
        "answered": len(latencies),
        "failed": failed,
        "sent_per_s": round(len(lags) / seconds, 1),
        "answered_per_s": round(len(latencies) / wall, 1),
        "p50_ms": _ms(statistics.median(latencies)),
        "p99_ms": _ms(_p99(latencies)),
        "max_ms": _ms(slowest[1]),
        "max_due_s": round(slowest[0], 3),  # when the slowest was due, from the start
        "send_lag_p99_ms": _ms(_p99(lags)),
        "send_lag_max_ms": _ms(max(lags)),
        "generator_cpu": round(cpu / wall, 3),  # of one core
    }


@click.command()
@click.argument("url")
@click.option("--rate", type=float, default=500.0, show_default=True, help="Requests a second.")
@click.option("--seconds", type=float, default=10.0, show_default=True, help="Counted seconds.")
@click.option("--header", multiple=True, help="'Name: value', sent with every request.")
@click.option("--dump", default=None, help="Write each request's due time and latency here.")
def main(url: str, rate: float, seconds: float, header: tuple[str, ...], dump: str | None) -> None:
    """GET URL at a constant rate and print the latencies (from each due time) as JSON."""
    headers = dict(h.split(": ", 1) for h in header)
    figures = anyio.run(generate, url, rate, seconds, headers, dump)
    json.dump(figures, sys.stdout)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
