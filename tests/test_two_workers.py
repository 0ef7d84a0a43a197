"""Two workers in one process: each runs its own agents, with its own runtimes and providers.

Runtimes, providers and the agent registry are fields of per-worker objects (the worker's
``Resources``), not module globals: two workers whose agents share a name but not a prompt each
send their own prompt, and closing one worker's runtimes leaves the other's serving.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

import toren.providers.anthropic  # noqa: F401  (the SDK import is paid here, not in a step)
from tests.conftest import running_worker, wait_for
from toren import Agent, Client
from toren.actors.channels.runtime import Channels
from toren.actors.runs.models import Providers
from toren.actors.sandboxes.runtime import Sandboxes
from toren.directory import Directory
from toren.runs import PROCESS_AGENTS, Agents, read_run, start_run
from toren.testing import AnthropicServer, Reply

pytestmark = pytest.mark.anyio

MODEL = "anthropic/claude-sonnet-4-6"
PROMPT_A = "You are the twin of worker A."
PROMPT_B = "You are the twin of worker B."


def twin(system: str) -> Agents:
    """An app of one agent, ``twin``, with the prompt ``system``."""
    agents = Agents()
    agents.register([Agent(name="twin", model=MODEL, system=system)])
    return agents


async def completed(client: Client, text: str) -> str:
    run_id = await start_run(client, "twin", text)

    async def done() -> bool:
        return (await read_run(client, run_id)).status == "completed"

    await wait_for(done, what=f"run {text!r} completed")
    return run_id


def prompt(body: dict[str, Any]) -> str:
    """Whose system prompt a request carried (``A``, ``B``, or ``?``)."""
    system = json.dumps(body.get("system", ""))
    return "A" if PROMPT_A in system else "B" if PROMPT_B in system else "?"


async def test_two_workers_run_their_own_agents_and_one_closing_leaves_the_other_serving(
    client: Client, db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    a_agents, b_agents = twin(PROMPT_A), twin(PROMPT_B)
    script = [Reply("from a"), Reply("from b")]
    async with AnthropicServer(script) as server:
        for name, value in server.env().items():
            monkeypatch.setenv(name, value)
        async with running_worker(db_url, a_agents) as a:
            # A alone serves agent twin: its run is A's.
            first = await completed(client, "first")
            assert [prompt(r.body) for r in server.received] == ["A"]
            async with running_worker(db_url, b_agents) as b:
                for kind in (Agents, Directory, Providers, Channels, Sandboxes):
                    assert a.resources.get(kind) is not b.resources.get(kind), kind
                assert a.resources.get(Agents) is a_agents
                assert b.resources.get(Agents) is b_agents
                assert PROCESS_AGENTS.named("twin") is None  # neither used the process's

                # A's channel and sandbox runtimes close; then A stops (its providers close).
                b_why = b.resources.get(Sandboxes).why
                await a.resources.get(Channels).close()
                await a.resources.get(Sandboxes).close()
                assert a.resources.get(Sandboxes).why == "this worker's sandboxes are closed"
                assert b.resources.get(Sandboxes).why == b_why
                await a.stop()

                # B still serves: the next run is B's, with B's prompt, through B's providers.
                second = await completed(client, "second")
                assert [prompt(r.body) for r in server.received] == ["A", "B"]
    assert (await read_run(client, first)).output == "from a"
    assert (await read_run(client, second)).output == "from b"
