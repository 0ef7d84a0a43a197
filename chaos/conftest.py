"""The chaos matrix under pytest: one test per cell, per mutation and per scenario, sharing one
embedded Postgres and one harness; the matrix tables are printed at the end of the session.

``CHAOS_SOAK_SECONDS`` and ``CHAOS_SOAK_RUNS`` lengthen the soak (``python -m chaos`` has the
same as options).
"""

from __future__ import annotations

import io
import os
import shutil
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from rich.console import Console

from chaos.batches import clean_batch_run
from chaos.calls import CallExpected
from chaos.harness import CellResult, Harness
from chaos.matrix import (
    clean_call_run,
    clean_run,
    clean_sandbox_run,
    clean_schedule_run,
    clean_telegram_run,
    summary,
    table,
)
from chaos.oracle import Expected
from chaos.sandbox import SandboxExpected, docker_missing
from chaos.scenarios import ScenarioResult
from chaos.schedules import ScheduleExpected
from chaos.telegram import TelegramExpected
from chaos.version_oracle import ForkExpected
from chaos.versions import clean_fork_run, clean_upgrade_run
from toren._core.db import EmbeddedPostgres

RESULTS: dict[str, list[CellResult]] = {}
# The titles under which the matrices' cells are recorded (the rest are mutations' cells).
MATRICES = (
    "Kill matrix",
    "Kill matrix: cross-agent calls",
    "Kill matrix: sandboxes",
    "Kill matrix: Telegram channels",
    "Kill matrix: schedules",
    "Kill matrix: versions and forks",
    "Kill matrix: group commit",
)
SCENARIOS: list[ScenarioResult] = []
SKIPPED: list[str] = []  # why the sandbox cells did not run here, printed with the tables


def record(title: str, *results: CellResult) -> None:
    RESULTS.setdefault(title, []).extend(results)


@pytest.fixture(scope="session")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="session")
def chaos_workdir() -> Iterator[Path]:
    workdir = Path(tempfile.mkdtemp(prefix="toren-chaos-"))
    yield workdir
    failed = any(not r.passed for title in MATRICES for r in RESULTS.get(title, ())) or any(
        not s.passed for s in SCENARIOS
    )
    if not failed and not os.environ.get("CHAOS_KEEP"):
        shutil.rmtree(workdir, ignore_errors=True)


@pytest.fixture(scope="session")
def chaos_server(chaos_workdir: Path) -> Iterator[EmbeddedPostgres]:
    server = EmbeddedPostgres(chaos_workdir / "pg")
    yield server
    server.stop()


@pytest.fixture(scope="session")
async def harness(chaos_server: EmbeddedPostgres, chaos_workdir: Path) -> AsyncIterator[Harness]:
    async with Harness(chaos_server.url, chaos_workdir / "cells") as h:
        yield h


@pytest.fixture(scope="session")
async def expected(harness: Harness) -> Expected:
    return await clean_run(harness)


@pytest.fixture(scope="session")
async def call_expected(harness: Harness) -> CallExpected:
    return await clean_call_run(harness)


@pytest.fixture(scope="session")
async def sandbox_expected(harness: Harness) -> SandboxExpected:
    """The clean sandboxed run; the sandbox cells are skipped (with the reason) without Docker
    or the sandbox image, and fail in CI (``CI=true``), which must run them."""
    missing = await docker_missing()
    if missing is not None:
        if os.environ.get("CI") == "true":
            pytest.fail(f"the sandbox cells need Docker and the sandbox image in CI: {missing}")
        SKIPPED.append(f"sandbox cells skipped: no Docker or no sandbox image here: {missing}")
        pytest.skip(SKIPPED[-1])
    return await clean_sandbox_run(harness)


@pytest.fixture(scope="session")
async def telegram_expected(harness: Harness) -> TelegramExpected:
    return await clean_telegram_run(harness)


@pytest.fixture(scope="session")
async def schedule_expected(harness: Harness) -> ScheduleExpected:
    return await clean_schedule_run(harness)


@pytest.fixture(scope="session")
async def batch_expected(harness: Harness) -> Expected:
    return await clean_batch_run(harness)


@pytest.fixture(scope="session")
async def upgrade_expected(harness: Harness) -> Expected:
    return await clean_upgrade_run(harness)


@pytest.fixture(scope="session")
async def fork_expected(harness: Harness) -> ForkExpected:
    return await clean_fork_run(harness)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not RESULTS and not SCENARIOS and not SKIPPED:
        return
    buffer = io.StringIO()
    console = Console(file=buffer, width=120, force_terminal=False, color_system=None)
    for title, results in RESULTS.items():
        if title in MATRICES:
            console.print(table(results, f"{title}: kill point x fault"))
            console.print(summary(results))
        else:
            red = sum(not r.passed for r in results)
            console.print(table(results, f"{title}: {red} of {len(results)} cells red"))
    for s in SCENARIOS:
        console.print(s.line())
    for reason in SKIPPED[:1]:
        console.print(reason)
    terminalreporter.write_sep("=", "chaos")
    terminalreporter.write(buffer.getvalue())
