"""The kill matrix: every cell must pass; every mutation must turn at least one cell red, for the
reason it stands for (``MUTATION_EVIDENCE``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from chaos.batches import batch_cells
from chaos.calls import CallExpected
from chaos.conftest import MATRICES, SCENARIOS, record
from chaos.harness import Cell, Harness, Shape
from chaos.matrix import (
    MUTATION_CELLS,
    MUTATION_EVIDENCE,
    call_cells,
    caught,
    cells,
    sandbox_cells,
    schedule_cells,
    telegram_cells,
)
from chaos.mutations import MUTATIONS
from chaos.oracle import Expected
from chaos.sandbox import SandboxExpected
from chaos.scenarios import postgres_restart, restarter, soak
from chaos.schedules import ScheduleExpected
from chaos.telegram import TelegramExpected
from chaos.version_oracle import ForkExpected
from chaos.versions import fork_cells, upgrade_cells
from toren._core.db import EmbeddedPostgres

pytestmark = pytest.mark.anyio


@pytest.mark.parametrize(
    "cell",
    cells(),
    ids=lambda c: (
        ("" if c.shape == "chaos" else f"{c.shape}-") + f"{c.point}#{c.occurrence}-{c.fault}"
    ),
)
async def test_cell(cell: Cell, harness: Harness, expected: Expected) -> None:
    result, _ = await harness.run_cell(cell, expected)
    record(MATRICES[0], result)
    logs = harness.workdir / cell.slug
    assert result.passed, f"{cell.slug}: {'; '.join(result.problems)} (worker logs: {logs})"


@pytest.mark.parametrize(
    "cell", call_cells(), ids=lambda c: f"call-{c.point}#{c.occurrence}-{c.fault}"
)
async def test_call_cell(cell: Cell, harness: Harness, call_expected: CallExpected) -> None:
    result, _ = await harness.run_cell(cell, call_expected)
    record(MATRICES[1], result)
    logs = harness.workdir / cell.slug
    assert result.passed, f"{cell.slug}: {'; '.join(result.problems)} (worker logs: {logs})"


@pytest.mark.parametrize(
    "cell", sandbox_cells(), ids=lambda c: f"{c.shape}-{c.point}#{c.occurrence}-{c.fault}"
)
async def test_sandbox_cell(
    cell: Cell, harness: Harness, sandbox_expected: SandboxExpected
) -> None:
    result, _ = await harness.run_cell(cell, sandbox_expected)
    record(MATRICES[2], result)
    logs = harness.workdir / cell.slug
    assert result.passed, f"{cell.slug}: {'; '.join(result.problems)} (worker logs: {logs})"


@pytest.mark.parametrize(
    "cell", telegram_cells(), ids=lambda c: f"telegram-{c.shape}-{c.point}#{c.occurrence}-{c.fault}"
)
async def test_telegram_cell(
    cell: Cell, harness: Harness, telegram_expected: TelegramExpected
) -> None:
    result, _ = await harness.run_cell(cell, telegram_expected)
    record(MATRICES[3], result)
    logs = harness.workdir / cell.slug
    assert result.passed, f"{cell.slug}: {'; '.join(result.problems)} (worker logs: {logs})"


@pytest.mark.parametrize(
    "cell", schedule_cells(), ids=lambda c: f"schedule-{c.point}#{c.occurrence}-{c.fault}"
)
async def test_schedule_cell(
    cell: Cell, harness: Harness, schedule_expected: ScheduleExpected
) -> None:
    result, _ = await harness.run_cell(cell, schedule_expected)
    record(MATRICES[4], result)
    logs = harness.workdir / cell.slug
    assert result.passed, f"{cell.slug}: {'; '.join(result.problems)} (worker logs: {logs})"


@pytest.mark.parametrize(
    "cell", upgrade_cells(), ids=lambda c: f"upgrade-{c.point}#{c.occurrence}-{c.fault}"
)
async def test_upgrade_cell(cell: Cell, harness: Harness, upgrade_expected: Expected) -> None:
    result, _ = await harness.run_cell(cell, upgrade_expected)
    record(MATRICES[5], result)
    logs = harness.workdir / cell.slug
    assert result.passed, f"{cell.slug}: {'; '.join(result.problems)} (worker logs: {logs})"


@pytest.mark.parametrize(
    "cell", fork_cells(), ids=lambda c: f"fork-{c.point}#{c.occurrence}-{c.fault}"
)
async def test_fork_cell(cell: Cell, harness: Harness, fork_expected: ForkExpected) -> None:
    result, _ = await harness.run_cell(cell, fork_expected)
    record(MATRICES[5], result)
    logs = harness.workdir / cell.slug
    assert result.passed, f"{cell.slug}: {'; '.join(result.problems)} (worker logs: {logs})"


@pytest.mark.parametrize(
    "cell", batch_cells(), ids=lambda c: f"batch-{c.point}#{c.occurrence}-{c.fault}"
)
async def test_batch_cell(cell: Cell, harness: Harness, batch_expected: Expected) -> None:
    result, _ = await harness.run_cell(cell, batch_expected)
    record(MATRICES[6], result)
    logs = harness.workdir / cell.slug
    assert result.passed, f"{cell.slug}: {'; '.join(result.problems)} (worker logs: {logs})"


# The clean run each shape's cells are judged against (a fixture: asked for only when needed).
CLEAN: dict[Shape, str] = {
    "chaos": "expected",
    "early": "expected",
    "interrupted": "telegram_expected",
    "call": "call_expected",
    "sandbox": "sandbox_expected",  # without Docker: skipped (failed in CI)
    "rerunnable": "sandbox_expected",
    "at_least_once": "telegram_expected",
    "at_most_once": "telegram_expected",
    "schedule": "schedule_expected",
    "upgrade": "upgrade_expected",
    "fork": "fork_expected",
    "batch": "batch_expected",
}


def test_every_mutation_has_cells_and_the_evidence_that_catches_it() -> None:
    assert set(MUTATION_CELLS) == set(MUTATIONS) == set(MUTATION_EVIDENCE)


@pytest.fixture
def clean(request: pytest.FixtureRequest) -> dict[Shape, Any]:
    """The clean runs a mutation's cells are judged against, by shape. Asked for here, before
    the test runs: an async fixture asked for from a running async test cannot be set up (the
    mutation alone, ``-k NAME``, failed so unless the clean run was already made)."""
    name = request.node.callspec.params["name"]
    shapes = {cell.shape for cell in MUTATION_CELLS[name]}
    return {shape: request.getfixturevalue(CLEAN[shape]) for shape in shapes}


@pytest.mark.parametrize("name", MUTATIONS)
async def test_mutation_turns_cells_red(
    name: str,
    chaos_server: EmbeddedPostgres,
    chaos_workdir: Path,
    clean: dict[Shape, Any],
) -> None:
    # Cells run until one is red for the mutation's reason: the rest could only add reds (the
    # chaos CLI, ``python -m chaos``, runs them all).
    results = []
    async with Harness(chaos_server.url, chaos_workdir / "cells", mutation=name, bound=10) as h:
        for cell in MUTATION_CELLS[name]:
            results.append((await h.run_cell(cell, clean[cell.shape]))[0])
            if caught(name, results[-1]):
                break
    cells = MUTATION_CELLS[name]
    ran = f"{len(results)} of its {len(cells)} cells run, to the first caught"
    record(f"Mutation {name} ({ran})", *results)
    red = {r.cell.slug: r.problems for r in results if not r.passed}
    assert red, f"{name}: no cell turned red"
    assert any(caught(name, r) for r in results), (
        f"{name}: cells turned red, none with {MUTATION_EVIDENCE[name]!r}: {red}"
    )


async def test_postgres_restarted_mid_run(
    harness: Harness, chaos_server: EmbeddedPostgres, expected: Expected
) -> None:
    result = await postgres_restart(harness, restarter(chaos_server.data_dir), expected)
    SCENARIOS.append(result)
    assert result.passed, "\n".join(result.problems)


async def test_soak_workers_killed_at_random_while_runs_execute(
    harness: Harness, expected: Expected
) -> None:
    import os

    result = await soak(
        harness,
        expected,
        runs=int(os.environ.get("CHAOS_SOAK_RUNS", "50")),
        seconds=float(os.environ.get("CHAOS_SOAK_SECONDS", "20")),
    )
    SCENARIOS.append(result)
    assert result.faults >= 5, f"only {result.faults} workers killed"
    # Its workers commit with the default lanes: under 50 runs their steps batch.
    assert result.batches > 0, "no step of the soak was committed in a batch"
    assert result.passed, "\n".join(result.problems)
