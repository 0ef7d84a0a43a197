"""``python -m bench``: Toren's benchmark suite, every figure measured in one run on one database.

One embedded Postgres (``fsync`` and ``synchronous_commit`` on, as shipped) serves every
section in turn: the floor (raw asyncpg commits), the CLI's start-up, the kernel step, sizing
(kernel steps from 1, 2 and 4 worker processes, and what each costs Postgres), DBOS Transact as
a peer, agent steps through the real Anthropic SDK, takeover after SIGKILL, replay of a
1,000-step run, forks of a long run from its last step, 10,000 parked runs, the HTTP API (at a
constant 500 requests/s from an open-loop generator, and under ``wrk``), pruning ended runs
(and the kernel step beside a prune), sandboxes on real Docker (skipped, saying why, without a
daemon or the sandbox image), and a Postgres failover on a Patroni cluster of its own (skipped,
saying why, in smoke mode or without Patroni). Prints a table and writes
``bench/results.json``. ``--smoke`` runs every section with tiny counts: it
checks the suite works and measures nothing (CI runs it).
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import anyio
import click
import psutil
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from bench import (
    activate,
    agent,
    api,
    claim,
    cli,
    compaction,
    dbos_peer,
    failover,
    floor,
    fold,
    fork,
    kernel,
    limits,
    listing,
    parked,
    prune,
    replay,
    sandbox,
    schedule,
    sizing,
    takeover,
)
from bench._common import Bench
from toren import __version__
from toren.kernel import EmbeddedPostgres, connect, migrate

# In this order: ratios need their baselines (the floor before the kernel, DBOS before agents).
SECTIONS: dict[str, Callable[[Bench], Awaitable[None]]] = {
    "floor": floor.run,
    "cli": cli.run,
    "kernel": kernel.run,
    "sizing": sizing.run,  # 1, 2 and 4 worker processes of kernel steps
    "dbos": dbos_peer.run,
    "agent": agent.run,
    "takeover": takeover.run,
    "replay": replay.run,
    "fork": fork.run,
    "fold": fold.run,
    "compaction": compaction.run,
    "activate": activate.run,
    "claim": claim.run,
    "limits": limits.run,
    "parked": parked.run,
    "api": api.run,
    "listing": listing.run,
    "prune": prune.run,
    "sandbox": sandbox.run,
    "failover": failover.run,  # a Patroni cluster of its own, not the suite's server
    "schedule": schedule.run,  # last: its schedules are deleted, but their runs stay
}
DEFAULT_OUT = Path(__file__).resolve().parent / "results.json"
console = Console()


async def _suite(b: Bench, names: list[str], overall: object) -> None:
    conn = await connect(b.url)
    try:
        await migrate(conn)
        settings = {
            name: await conn.fetchval(f"SHOW {name}")
            for name in ("fsync", "synchronous_commit", "wal_sync_method", "server_version")
        }
    finally:
        await conn.close()
    if settings["fsync"] != "on" or settings["synchronous_commit"] != "on":
        raise click.ClickException(f"durability settings are relaxed: {settings}")
    b.results["postgres"] = settings
    for name in names:
        started = time.perf_counter()
        await SECTIONS[name](b)
        b.results.setdefault("section_seconds", {})[name] = round(time.perf_counter() - started, 1)
        b.progress.advance(overall)  # type: ignore[arg-type]


def _machine() -> dict[str, object]:
    return {
        "cpus": os.cpu_count(),
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "toren": __version__,
    }


@click.command()
@click.option("--smoke", is_flag=True, help="Tiny counts: checks that every section works.")
@click.option(
    "--only", multiple=True, type=click.Choice(list(SECTIONS)), help="Run only these sections."
)
@click.option(
    "--out",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help=f"Where to write the results [default: {DEFAULT_OUT.name}; smoke: not written].",
)
def main(smoke: bool, only: tuple[str, ...], out: Path | None) -> None:
    """Run the benchmark suite; print a table and write the results as JSON."""
    names = [n for n in SECTIONS if not only or n in only]
    if out is None and not smoke:
        out = DEFAULT_OUT
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="toren-bench-") as d:
        tmp = Path(d)
        server = EmbeddedPostgres(tmp / "pg")
        progress = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            TextColumn("{task.completed}/{task.total}"),
            TimeElapsedColumn(),
            console=console,
            transient=True,
        )
        try:
            with progress:
                b = Bench(url=server.url, tmp=tmp, smoke=smoke, progress=progress)
                overall = progress.add_task("benchmark sections", total=len(names))
                try:
                    anyio.run(_suite, b, names, overall)
                finally:
                    b.stop_workers()
        except Exception:
            for log in sorted(tmp.glob("*.log")):  # workers.log and each worker's own
                tail = log.read_text(errors="replace")[-4000:]
                console.print(f"last lines of {log.name}:\n{tail}", markup=False, style="dim")
            raise
        finally:
            server.stop()
    b.results["machine"] = _machine()
    b.results["measured_at"] = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    b.results["smoke"] = smoke
    b.results["suite_seconds"] = round(time.perf_counter() - started, 1)
    title = "Toren benchmarks" + (" (smoke: tiny counts, not measurements)" if smoke else "")
    table = Table(title=title)
    for column in ("figure", "value", "notes"):
        table.add_column(column)
    for row in b.rows:
        table.add_row(*row)
    console.print(table)
    if out is not None:
        out.write_text(json.dumps(b.results, indent=2, sort_keys=True) + "\n")
        console.print(f"results written to {out}")
    console.print(f"suite took {b.results['suite_seconds']:.0f} s")


if __name__ == "__main__":
    main()
