"""``idempotency="at_most_once"``: a tool call that may have started before a crash is never run
again; the model is told it was interrupted."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from tests.conftest import WorkerFactory, wait_for
from tests.steps import model, settled
from toren import Client
from toren._agent.model import ToolCall
from toren.runs import read_run, start_run

pytestmark = pytest.mark.anyio


async def test_a_call_in_flight_at_a_crash_is_reported_interrupted_not_run_again(
    client: Client, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, workers: WorkerFactory
) -> None:
    launches = tmp_path / "launches"
    monkeypatch.setenv("TOREN_TEST_LAUNCHES", str(launches))
    steps = [
        [ToolCall(id="l1", name="launch", arguments={"name": "rocket", "seconds": 300})],
        [ToolCall(id="l2", name="launch", arguments={"name": "probe"})],
        "{results}",
    ]
    async with model(steps, monkeypatch):
        first = workers("tests.sandbox_app")
        run_id = await start_run(client, "launcher", "launch")

        async def launched() -> bool:
            return launches.exists() and launches.read_text() == "rocket\n"

        await wait_for(launched, timeout=60, what="the first launch under way")
        first.signal(signal.SIGKILL)
        first.wait(10)
        second = workers("tests.sandbox_app")
        assert await wait_for(lambda: settled(client, run_id), timeout=60) == "completed", (
            second.log()
        )

    state = await read_run(client, run_id)
    assert state.results["l1"].is_error
    assert "interrupted" in state.results["l1"].content
    assert "not run again" in state.results["l1"].content
    assert state.results["l2"].content == "launched probe"
    assert launches.read_text() == "rocket\nprobe\n"  # the rocket launched once
