"""The coding agent, run offline on a real worker, Postgres and Docker: its program runs in its
container under an allow rule, and the command outside the rules waits for approval.

Needs Docker and the image toren/sandbox:latest (``./scripts/sandbox-image``): without them the
test is skipped with the reason printed, and fails under CI=true."""

from __future__ import annotations

from pathlib import Path

import pytest

from examples.coding_agent.model import script
from tests.sandbox_support import unavailable
from toren.actors.sandboxes.docker import Docker, Unavailable
from toren.sandboxes import DEFAULT_IMAGE
from toren.testing import harness

pytestmark = pytest.mark.anyio


async def need_docker() -> None:
    """Docker and the sandbox image, or a skip with the reason (a failure when CI=true)."""
    try:
        client = await Docker.connect()
        try:
            await client.check_image(DEFAULT_IMAGE)
        finally:
            await client.close()
    except Unavailable as exc:
        unavailable(str(exc))


async def test_the_program_runs_in_the_sandbox_and_the_cleanup_waits_for_approval(
    tmp_path: Path,
) -> None:
    await need_docker()
    store = str(tmp_path / "workspaces")
    async with harness(
        "examples.coding_agent.app", script, sandboxes=True, workspace_store=store
    ) as h:
        run_id = await h.start("pair_coder", "Write and run a program summing ten squares.")
        [call] = await h.waiting(run_id, timeout=90)  # python3 ran under its allow rule
        assert call.name == "bash"
        assert call.arguments == {"command": "rm squares.py"}
        state = await h.state(run_id)
        ran = state.results["b1"]
        assert not ran.is_error
        assert ran.content.startswith("$ python3 squares.py\n[in /workspace; exit 0]")
        assert ran.content.rstrip().endswith("285")

        await h.approve(run_id)
        state = await h.wait(run_id, "completed", timeout=90)
        assert state.output == "The sum of the first ten squares is 285."
        removed = state.results["b2"]
        assert "[in /workspace; exit 0]" in removed.content
        receipt = await h.receipt(run_id)
        assert receipt.calls_made == 4
        assert receipt.input_tokens > 0
        assert receipt.usd_paid > 0
