"""``/metrics`` (Prometheus, through ``prometheus_client``) and ``/healthz``."""

from __future__ import annotations

from collections.abc import Iterator

import anyio
import asyncpg
import attrs
from aiohttp import web
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    Metric,
    generate_latest,
)
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector

from toren._core.pruning import table_sizes
from toren._core.rows import run_status_counts
from toren._core.workers import live_worker_count, live_workers
from toren._surfaces.http.common import ACCESS, CLIENT, OPTIONS, json
from toren._surfaces.http.models import Health, WorkerInfo
from toren._surfaces.http.versions import with_runs
from toren.runs.audit import last_prunes
from toren.runs.events import STATUSES
from toren.runs.version_listing import agent_versions

REGISTRY: web.AppKey[CollectorRegistry] = web.AppKey("registry", CollectorRegistry)
_REQUESTS: web.AppKey[Counter] = web.AppKey("requests", Counter)
_LATENCY: web.AppKey[Histogram] = web.AppKey("latency", Histogram)


def install(app: web.Application) -> None:
    """``/metrics`` and ``/healthz``. The request counters are this process's, unless
    :attr:`ServerOptions.metrics_dir` names the directory of ``prometheus_client``'s
    multiprocess mode (``toren serve --workers N``): then each process writes its counts there
    and a scrape, whichever process answers it, reads every process's (those of processes that
    have exited too: totals never go back). The other series are read from the database at each
    scrape, the same whichever process answers."""
    registry = CollectorRegistry()
    app[REGISTRY] = registry
    app[_REQUESTS] = Counter(
        "toren_http_requests",
        "HTTP requests answered, by method, route and status.",
        ["method", "route", "status"],
        registry=registry,
    )
    app[_LATENCY] = Histogram(
        "toren_http_request_seconds",
        "Time to answer an HTTP request (streams: until they end).",
        ["route"],
        registry=registry,
    )
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/healthz", healthz)


def observe(app: web.Application, method: str, route: str, status: int, seconds: float) -> None:
    app[_REQUESTS].labels(method, route, str(status)).inc()
    app[_LATENCY].labels(route).observe(seconds)


@attrs.frozen
class _Exposition:
    """What one scrape shows: the request counters (this process's, or every process's) and
    the gauges read from the database for it."""

    counters: Collector
    gauges: list[Metric]

    def collect(self) -> Iterator[Metric]:
        yield from self.counters.collect()
        yield from self.gauges


async def metrics(request: web.Request) -> web.Response:
    app = request.app
    pool = app[CLIENT].pool
    runs = GaugeMetricFamily("toren_runs", "Runs by status.", labels=["status"])
    # Counts kept as runs change status (migration 0006): a few rows, however many runs.
    counts = await run_status_counts(pool)
    for status in STATUSES:
        runs.add_metric([status], counts.get(status, 0))
    workers = GaugeMetricFamily(
        "toren_workers_live", "Live workers.", value=await live_worker_count(pool)
    )
    # Retention: sizes from the catalog, the last prunes from a small log (no table is scanned).
    tables = GaugeMetricFamily(
        "toren_table_bytes",
        "Bytes each table of schema toren takes (pg_total_relation_size: indexes, TOAST).",
        labels=["table"],
    )
    for table, size in (await table_sizes(pool)).items():
        tables.add_metric([table], size)
    pruned = GaugeMetricFamily(
        "toren_last_prune",
        "What the last prune batch of each agent that removed something removed: runs, "
        "events, bytes (journal rows), archived runs, seconds it took, and when (unix time).",
        labels=["agent", "what"],
    )
    for last in await last_prunes(pool):
        for what in ("runs", "events", "bytes", "archived", "took"):
            pruned.add_metric([last["agent"], what], last[what])
        pruned.add_metric([last["agent"], "at"], last["at"].timestamp())
    shared = app[OPTIONS].metrics_dir
    counters: Collector = (
        app[REGISTRY] if shared is None else MultiProcessCollector(None, path=shared)  # type: ignore[no-untyped-call]
    )
    exposition = _Exposition(counters, [runs, workers, tables, pruned])
    return web.Response(
        body=generate_latest(exposition), headers={"Content-Type": CONTENT_TYPE_LATEST}
    )


async def healthz(request: web.Request) -> web.Response:
    """Whether the database answers and how many workers are live; to an authenticated caller
    also which workers, their versions, version skew, and the agent versions that still have
    runs (flagged when no live worker serves one)."""
    pool = request.app[CLIENT].pool
    shown = ACCESS in request  # authenticated: the middleware passed optional credentials
    try:
        with anyio.fail_after(3):
            rows = await live_workers(pool)
            # The agent versions that still have runs: only to a caller who may see them.
            agents = with_runs(await agent_versions(pool)) if shown else None
    except (OSError, TimeoutError, asyncpg.PostgresError, asyncpg.InterfaceError):
        health = Health(
            status="degraded",
            database=False,
            workers_live=0,
            workers=None,
            versions=None,
            version_skew=False,
        )
        return json(health, status=503)
    workers = [
        WorkerInfo(
            worker_id=str(r["worker_id"]),
            name=r["name"],
            version=r["version"],
            heartbeat_at=r["heartbeat_at"].isoformat(),
        )
        for r in rows
    ]
    versions = sorted({w.version for w in workers})
    health = Health(
        status="ok",
        database=True,
        workers_live=len(workers),
        workers=workers if shown else None,
        versions=versions if shown else None,
        version_skew=len(versions) > 1,
        agent_versions=agents,
    )
    return json(health)
