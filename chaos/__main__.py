"""``python -m chaos``: run the kill matrix, the mutations and the scenarios; print the matrix.

Exit status 0 when every cell passes and every mutation turns at least one cell red, for the
reason it stands for.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import anyio
import click
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from chaos.batches import batch_cells, clean_batch_run
from chaos.calls import CallExpected
from chaos.harness import SANDBOX_SHAPES, Cell, CellResult, Harness, Shape
from chaos.matrix import (
    MUTATION_CELLS,
    call_cells,
    caught,
    cells,
    clean_call_run,
    clean_run,
    clean_sandbox_run,
    clean_schedule_run,
    clean_telegram_run,
    sandbox_cells,
    schedule_cells,
    summary,
    table,
    telegram_cells,
)
from chaos.mutations import MUTATIONS
from chaos.oracle import Expected
from chaos.sandbox import SandboxExpected, docker_missing
from chaos.scenarios import ScenarioResult, postgres_restart, restarter, soak
from chaos.schedules import ScheduleExpected
from chaos.telegram import TelegramExpected
from chaos.version_oracle import ForkExpected
from chaos.versions import clean_fork_run, clean_upgrade_run, version_cells

console = Console()


# What each shape's cells are judged against: its clean run's result.
Clean = dict[Shape, Any]


def _clean(
    expected: Expected,
    call: CallExpected,
    sandbox: SandboxExpected | None,
    telegram: TelegramExpected,
    schedule: ScheduleExpected,
    upgrade: Expected,
    fork: ForkExpected,
    batch: Expected,
) -> Clean:
    return {
        "chaos": expected,
        "early": expected,
        "call": call,
        "sandbox": sandbox,
        "rerunnable": sandbox,
        "at_least_once": telegram,
        "at_most_once": telegram,
        "interrupted": telegram,
        "schedule": schedule,
        "upgrade": upgrade,
        "fork": fork,
        "batch": batch,
    }


async def _cells(harness: Harness, todo: list[Cell], clean: Clean, label: str) -> list[CellResult]:
    results = []
    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=console, transient=True) as progress:
        task = progress.add_task(label, total=len(todo))
        for cell in todo:
            progress.update(
                task, description=f"{label}: {cell.point}#{cell.occurrence} {cell.fault}"
            )
            result, _ = await harness.run_cell(cell, clean[cell.shape])
            if not result.passed and label == "matrix":
                console.print(f"[red]FAIL[/red] {cell.slug}: {'; '.join(result.problems)}")
            results.append(result)
            progress.advance(task)
    return results


async def main(
    only: str | None,
    mutations: bool,
    scenarios: bool,
    soak_seconds: float,
    soak_runs: int,
    workdir: Path,
) -> bool:
    from toren._core.db import EmbeddedPostgres

    server = EmbeddedPostgres(workdir / "pg")
    ok = True
    try:
        async with Harness(server.url, workdir / "cells") as harness:
            expected = await clean_run(harness)
            call = await clean_call_run(harness)
            telegram = await clean_telegram_run(harness)
            schedule = await clean_schedule_run(harness)
            upgrade = await clean_upgrade_run(harness)
            fork = await clean_fork_run(harness)
            batch = await clean_batch_run(harness)
            sandbox: SandboxExpected | None = None
            missing = await docker_missing()
            if missing is None:
                sandbox = await clean_sandbox_run(harness)
            else:
                in_ci = os.environ.get("CI") == "true"
                verdict = "[red]FAIL[/red] (CI=true)" if in_ci else "skipped"
                console.print(f"sandbox cells {verdict}: no Docker or no sandbox image: {missing}")
                ok = ok and not in_ci
            clean = _clean(expected, call, sandbox, telegram, schedule, upgrade, fork, batch)
            for title, todo in (
                ("Kill matrix", [c for c in cells() if only is None or only in c.point]),
                (
                    "Kill matrix: cross-agent calls",
                    [c for c in call_cells() if only is None or only in c.point],
                ),
                (
                    "Kill matrix: sandboxes",
                    [
                        c
                        for c in sandbox_cells()
                        if sandbox is not None and (only is None or only in c.point)
                    ],
                ),
                (
                    "Kill matrix: Telegram channels",
                    [c for c in telegram_cells() if only is None or only in c.point],
                ),
                (
                    "Kill matrix: schedules",
                    [c for c in schedule_cells() if only is None or only in c.point],
                ),
                (
                    "Kill matrix: versions and forks",
                    [c for c in version_cells() if only is None or only in c.point],
                ),
                (
                    "Kill matrix: group commit",
                    [c for c in batch_cells() if only is None or only in c.point],
                ),
            ):
                if not todo:
                    continue
                results = await _cells(harness, todo, clean, "matrix")
                console.print(table(results, f"{title}: kill point x fault"))
                console.print(summary(results))
                ok = ok and all(r.passed for r in results)
            if scenarios:
                with console.status("Postgres restarted mid-run..."):
                    restart = await postgres_restart(harness, restarter(server.data_dir), expected)
                with console.status(
                    f"soak: {soak_runs} runs, workers killed for {soak_seconds:g}s..."
                ):
                    soaked = await soak(harness, expected, runs=soak_runs, seconds=soak_seconds)
                for s in (restart, soaked):
                    _scenario(s)
                    ok = ok and s.passed
        if mutations:
            for name in MUTATIONS:
                todo = list(MUTATION_CELLS[name])
                if sandbox is None and any(c.shape in SANDBOX_SHAPES for c in todo):
                    continue  # said above: no Docker here
                async with Harness(
                    server.url, workdir / "cells", mutation=name, bound=10
                ) as mutated:
                    red = await _cells(mutated, todo, clean, name)
                reds = sum(not r.passed for r in red)
                console.print(table(red, f"Mutation {name}: {reds} of {len(red)} cells red"))
                for r in red:
                    if not r.passed:
                        console.print(f"  {r.cell.slug}: {r.problems[0]}")
                ok = ok and any(caught(name, r) for r in red)
    finally:
        server.stop()
    return ok


def _scenario(result: ScenarioResult) -> None:
    colour = "green" if result.passed else "red"
    console.print(f"[{colour}]{result.line()}[/{colour}]")
    for problem in result.problems[:10]:
        console.print(f"  {problem}")


@click.command()
@click.option("--only", help="Run only the cells whose kill point contains this text.")
@click.option("--mutations/--no-mutations", default=True, help="Run the mutations too.")
@click.option("--scenarios/--no-scenarios", default=True, help="Postgres restart and the soak.")
@click.option(
    "--soak-seconds", default=20.0, show_default=True, help="How long workers are killed."
)
@click.option("--soak-runs", default=50, show_default=True, help="Runs in the soak.")
@click.option("--keep", is_flag=True, help="Keep the workers' logs (kept anyway on a failure).")
def cli(
    only: str | None,
    mutations: bool,
    scenarios: bool,
    soak_seconds: float,
    soak_runs: int,
    keep: bool,
) -> None:
    """Kill a worker at every phase of an agent run; check nothing is lost or paid twice."""
    workdir = Path(tempfile.mkdtemp(prefix="toren-chaos-"))
    ok = False
    try:
        ok = anyio.run(main, only, mutations, scenarios, soak_seconds, soak_runs, workdir)
    finally:
        if keep or not ok:
            console.print(f"workers' logs: {workdir / 'cells'}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    raise SystemExit(0 if ok else 1)


cli()
