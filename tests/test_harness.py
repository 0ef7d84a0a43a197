"""toren.testing.harness as a user's test drives it: what its ``env`` reaches, and what it
leaves behind when the test (or the app) fails."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import asyncpg
import pytest

from toren import ConfigError
from toren.runs import cancel
from toren.testing import Reply, RunEnded, ToolCall, harness

pytestmark = pytest.mark.anyio

# An app that reads a setting of its own from the environment when it is imported.
APP = """\
import os

from toren import Agent

GREETING = os.environ["HARNESS_APP_GREETING"]

agent = Agent(name="{name}_agent", model="anthropic/claude-sonnet-4-6", system=GREETING)
"""
# An agent whose one tool always asks for approval first.
APPROVING = """\
from toren import Agent, ToolContext, tool


@tool(effects="external", idempotency="keyed", approval="always")
async def refund(ctx: ToolContext, amount: float) -> str:
    \"\"\"Refund the customer.\"\"\"
    return f"refunded {{amount:g}}"


agent = Agent(name="{name}_agent", model="anthropic/claude-sonnet-4-6", tools=[refund])
"""
COUNT = iter(range(1_000_000))


@pytest.fixture
def app(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, server_url: str) -> str:
    """The app's module name (each test's own: agent names are process-wide)."""
    name = f"harness_env_app_{os.getpid()}_{next(COUNT)}"
    (tmp_path / f"{name}.py").write_text(APP.format(name=name))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [str(tmp_path), *sys.path])
    monkeypatch.setenv("TOREN_DATABASE_URL", server_url)  # its databases on the test server
    monkeypatch.delenv("HARNESS_APP_GREETING", raising=False)
    return name


async def _harness_databases(server_url: str) -> set[str]:
    conn = await asyncpg.connect(server_url)
    try:
        rows = await conn.fetch("SELECT datname FROM pg_database")
    finally:
        await conn.close()
    return {r["datname"] for r in rows}


async def test_env_reaches_the_app_as_it_is_imported_and_is_restored(app: str) -> None:
    async with harness(app, lambda r: "hi", env={"HARNESS_APP_GREETING": "Be brief."}) as h:
        assert os.environ["HARNESS_APP_GREETING"] == "Be brief."
        run_id = await h.start(f"{app}_agent", "hello")
        assert (await h.wait(run_id)).output == "hi"
        assert h.model.requests[0]["system"] == "Be brief."
    assert "HARNESS_APP_GREETING" not in os.environ


async def test_an_app_that_fails_to_load_leaves_the_environment_as_it_was(app: str) -> None:
    before = dict(os.environ)
    with pytest.raises(ConfigError, match="HARNESS_APP_GREETING"):
        async with harness(app, lambda r: "hi", env={"OTHER_HARNESS_VAR": "x"}):
            pass
    assert dict(os.environ) == before


async def test_a_failing_test_fails_as_itself_and_leaves_no_database_or_environment(
    app: str, server_url: str
) -> None:
    before_env = dict(os.environ)
    before = await _harness_databases(server_url)
    seen: list[str] = []

    async def failing_test() -> None:
        async with harness(app, lambda r: "hi", env={"HARNESS_APP_GREETING": "x"}) as h:
            seen.append(h.database_url.rsplit("/", 1)[-1])
            raise RuntimeError("the test failed")

    with pytest.raises(RuntimeError, match="the test failed"):
        await failing_test()
    assert seen
    assert seen[0] not in await _harness_databases(server_url)
    assert await _harness_databases(server_url) == before
    assert dict(os.environ) == before_env


async def test_a_provider_with_no_scripted_server_is_a_clear_error(app: str) -> None:
    with pytest.raises(ConfigError, match=r"no scripted server for provider\(s\) 'anthropics'"):
        async with harness(app, lambda r: "hi", providers=["anthropics"]):
            pass


async def test_waiting_for_a_cancelled_run_says_it_was_cancelled(app: str, tmp_path: Path) -> None:
    name = f"{app}_approving"
    (tmp_path / f"{name}.py").write_text(APPROVING.format(name=name))
    refund = Reply([ToolCall(id="r1", name="refund", arguments={"amount": 5})])
    async with harness(name, lambda r: refund) as h:
        run_id = await h.start(f"{name}_agent", "refund me")
        await h.waiting(run_id)
        await cancel(h.client, run_id, reason="duplicate")
        with pytest.raises(RunEnded, match=r"is cancelled \(cancelled: cancelled by .+\), not"):
            await h.wait(run_id)
        state = await h.wait(run_id, "cancelled")
    assert (state.status, state.error_class) == ("cancelled", "cancelled")
