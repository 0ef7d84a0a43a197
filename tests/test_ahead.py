"""A tool call's intent recorded ahead, in the commit that made the call next
(actors/runs/ahead.py): a run laid out as before it goes on as it did."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import pytest

import toren.providers.anthropic  # noqa: F401
from tests import run_app
from tests.conftest import running_worker, wait_for
from toren import Client
from toren._agent.app import load_app
from toren._agent.model import ToolCall
from toren.actors.runs import RunActor, ahead, steps
from toren.runs import read_run, start_run
from toren.testing import AnthropicServer, Reply

pytestmark = pytest.mark.anyio


async def test_a_run_stopped_before_the_intent_step_of_an_earlier_version_runs_its_tool_once(
    client: Client, db_url: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The journal as the version before issue 33 left it when its worker stopped between the
    model's answer and the step recording the tool's intent (``model.called`` committed, no
    intent): a worker of this version records the intent in a step of its own, under the key the
    earlier version would have used, and runs the tool once."""
    load_app("tests.run_app")
    run_app.applied.clear()
    ledger = tmp_path / "ledger"
    monkeypatch.setenv("TOREN_TEST_LEDGER", str(ledger))
    arguments = {"title": "printer on fire"}
    script = [Reply([ToolCall(id="t1", name="create_ticket", arguments=arguments)]), Reply("Done.")]
    reached = anyio.Event()

    async def stopped(self: RunActor, ctx: Any, agent: Any, call: Any) -> None:
        reached.set()  # the intent's step of the earlier version, cut before its commit
        await anyio.sleep_forever()

    async with AnthropicServer(script) as server:
        for name, value in server.env().items():
            monkeypatch.setenv(name, value)
        with monkeypatch.context() as earlier:
            earlier.setattr(ahead, "intend", lambda ctx, agent: None)  # no intent ahead
            earlier.setattr(RunActor, "_tool_step", stopped)
            async with running_worker(db_url, grace_seconds=0.1):
                run_id = await start_run(client, "support", "open a ticket")
                with anyio.fail_after(20):
                    await reached.wait()
        laid_out = [e.type for e in await client.journal(run_id)]
        assert laid_out[-1] == "model.called", laid_out
        async with running_worker(db_url):

            async def completed() -> bool:
                return (await read_run(client, run_id)).status == "completed"

            await wait_for(completed, what="the run completed")
        assert len(server.requests) == 2  # the answer recorded before the stop is not asked again
    key = steps.idempotency_key(run_id, "create_ticket", arguments, 0)
    journal = await client.journal(run_id)
    intents = [e.data for e in journal if e.type == "tool.intent"]
    assert [i["idempotency_key"] for i in intents] == [key]
    assert ledger.read_text().splitlines() == [f"{key} printer on fire"]
    # As the earlier version would have gone on: resumed, the intent in a step of its own, run.
    types = [e.type for e in journal]
    after = types[types.index("model.called") :][:4]
    assert after == ["model.called", "run.resumed", "tool.intent", "tool.result"], types
