"""``python -m bench.profile``: see :mod:`bench.profile`."""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import anyio
import asyncpg
import click
from rich.console import Console
from rich.progress import Progress

from bench._common import Bench
from bench.profile.measure import PY_SPY, Postgres
from bench.profile.memory import phase_parked
from bench.profile.services import phase_agent, phase_api
from bench.profile.statements import phase_floor, phase_kernel, phase_statement
from toren.kernel import EmbeddedPostgres, migrate

console = Console()

PHASES = ("floor", "kernel", "statement", "agent", "parked", "api")


async def _main(
    names: tuple[str, ...],
    out: Path,
    frames: int,
    parked_n: int,
    spy: bool,
    allocator: str,
    max_actors: int,
) -> None:
    with tempfile.TemporaryDirectory(prefix="toren-profile-") as d:
        tmp = Path(d)
        server = EmbeddedPostgres(tmp / "pg")
        try:
            b = Bench(url=server.url, tmp=tmp, smoke=False, progress=Progress(console=console))
            conn = await asyncpg.connect(b.url)
            await migrate(conn)
            await conn.close()
            pg = Postgres(tmp / "pg", spy=spy)
            for name in names:
                load = Path("/proc/loadavg").read_text().split()[:3]
                started = time.strftime("%Y-%m-%d %H:%M:%S")
                console.print(f"{started} {name} (load {' '.join(load)})")
                try:
                    if name == "floor":
                        text = await phase_floor(b, pg, out)
                    elif name == "kernel":
                        text = await phase_kernel(b, pg, out)
                    elif name == "statement":
                        text = await phase_statement(b, pg, out)
                    elif name == "agent":
                        text = await phase_agent(b, pg, out)
                    elif name == "parked":
                        text = await phase_parked(
                            b, pg, out, frames, parked_n, allocator, max_actors
                        )
                    else:
                        text = await phase_api(b, pg, out, 15)
                finally:
                    b.stop_workers()
                end_load = Path("/proc/loadavg").read_text().split()[:3]
                loads = f"load before {' '.join(load)}, after {' '.join(end_load)}"
                head = f"<!-- {started}, {loads} -->\n"
                (out / f"{name}.md").write_text(head + text)
                console.print(f"  written {out / name}.md")
        finally:
            server.stop()


@click.command()
@click.argument("phases", nargs=-1, type=click.Choice(PHASES))
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), required=True)
@click.option("--frames", default=0, help="parked: tracemalloc frames in the worker (0: off).")
@click.option("--parked-runs", default=10_000)
@click.option(
    "--allocator",
    type=click.Choice(["pymalloc", "malloc"]),
    default="pymalloc",
    help="parked: the worker's PYTHONMALLOC (malloc: every object from glibc).",
)
@click.option("--max-actors", default=0, help="parked: the worker's TOREN_MAX_ACTORS (0: default).")
@click.option("--spy/--no-spy", default=True, help="Sample stacks with py-spy (2 samplers).")
def main(
    phases: tuple[str, ...],
    out: Path,
    frames: int,
    parked_runs: int,
    allocator: str,
    max_actors: int,
    spy: bool,
) -> None:
    """Profile the workloads of the suite's missed targets; tables to OUT/<phase>.md."""
    if not PY_SPY.exists():
        raise click.ClickException(f"needs py-spy beside {sys.executable}: pip install py-spy")
    out.mkdir(parents=True, exist_ok=True)
    anyio.run(
        _main, phases or PHASES, out.resolve(), frames, parked_runs, spy, allocator, max_actors
    )


if __name__ == "__main__":
    main()
