"""Cross-agent calls: mutual consent checked at call time, a child run per call that parks its
parent, results and failures back as tool results, budgets, cancel cascading, receipts rolled
up, a callee in another worker process."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable
from decimal import Decimal
from typing import Any

import pytest

import toren.providers.anthropic  # noqa: F401  (the SDK import is paid here, not in a step)
from tests.conftest import WorkerFactory, running_worker, wait_for
from toren import Client
from toren._agent.app import load_app
from toren._agent.model import ToolCall, Usage
from toren.runs import ENDED, cancel, read_run, receipt, run_status, start_run
from toren.testing import AnthropicServer, Reply

pytestmark = pytest.mark.anyio

Plan = dict[str, Callable[[dict[str, Any]], Reply]]


def results(body: dict[str, Any]) -> list[str]:
    """The tool results the request's last user turn carries, in order."""
    last = body["messages"][-1]
    blocks = last["content"] if isinstance(last["content"], list) else []
    out = []
    for b in blocks:
        if b.get("type") == "tool_result":
            content = b.get("content")
            if isinstance(content, list):
                content = "".join(c.get("text", "") for c in content)
            out.append(str(content))
    return out


def call(tool: str, text: str, call_id: str) -> Reply:
    return Reply([ToolCall(id=call_id, name=tool, arguments={"input": text})])


def relay(prefix: str, tool: str, text: str, call_id: str) -> Callable[[dict[str, Any]], Reply]:
    """An agent's script: call ``tool`` with ``text``, then answer ``<prefix>: <its result>``."""

    def answer(b: dict[str, Any]) -> Reply:
        seen = results(b)
        return Reply(f"{prefix}: {seen[0]}") if seen else call(tool, text, call_id)

    return answer


def publisher(b: dict[str, Any]) -> Reply:
    """The editor's script: publish (a call that waits for approval), then say what it did."""
    seen = results(b)
    if seen:
        return Reply(f"editor: {seen[0]}")
    return Reply([ToolCall(id="pub1", name="publish", arguments={"text": "n"})])


def scripted(plan: Plan) -> Callable[[dict[str, Any], int], Reply]:
    """Answer each request by the agent it comes from (its system prompt names it)."""

    def answer(body: dict[str, Any], n: int) -> Reply:
        system = body.get("system") or ""
        if isinstance(system, list):
            system = "".join(b.get("text", "") for b in system)
        return plan[system.split(":")[0]](body)

    return answer


@contextlib.asynccontextmanager
async def model(plan: Plan, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[AnthropicServer]:
    async with AnthropicServer(scripted(plan)) as server:
        for name, value in server.env().items():
            monkeypatch.setenv(name, value)
        yield server


def by_agent(server: AnthropicServer, name: str) -> list[dict[str, Any]]:
    return [b for b in server.requests if str(b.get("system", "")).split(":")[0] == name]


async def settled(client: Client, run_id: str) -> str | None:
    status = await run_status(client, run_id)
    return status if status in ENDED else None


async def test_a_call_starts_one_child_parks_the_parent_and_returns_its_output(
    client: Client, db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    load_app("tests.calls_app")
    plan: Plan = {
        "desk": relay("desk heard", "call_researcher", "tides", "d1"),
        "researcher": lambda b: Reply("The moon pulls the sea."),
    }
    async with model(plan, monkeypatch) as server:
        hold = server.hold(2)  # the child's model call waits: the parent must be parked
        async with running_worker(db_url):
            run_id = await start_run(client, "desk", "Why are there tides?")
            await hold.arrived.wait()

            async def parked_without_lease() -> bool:
                row = await client.actor(run_id)
                return row["owner"] is None and row["summary"]["status"] == "parked"

            await wait_for(parked_without_lease, what="the parent parked, holding no lease")
            hold.release()
            assert await wait_for(lambda: settled(client, run_id)) == "completed"

    state = await read_run(client, run_id)
    assert state.output == "desk heard: The moon pulls the sea."
    [child] = state.children.values()
    child_state = await read_run(client, child.run_id)
    assert child_state.parent == run_id
    assert child_state.chain == ("desk",)
    assert child_state.input == "tides"
    assert child_state.output == "The moon pulls the sea."
    started = await client.pool.fetchval(
        "SELECT data FROM toren.journal WHERE actor_id = $1 AND type = 'run.started'",
        child.run_id,
    )
    assert started["by"]["kind"] == "run"
    assert started["by"]["id"] == run_id
    # The caller's model sees the callee's description, never its system prompt.
    first = by_agent(server, "desk")[0]
    tools = {t["name"]: t for t in first["tools"]}
    assert tools["call_researcher"]["description"] == (
        "Finds facts about a topic; give it the topic."
    )
    assert "SECRET PROMPT" not in str(by_agent(server, "desk"))
    # Receipts roll up: the parent's own calls, and its child's once.
    r, rc = receipt(state), receipt(child_state)
    assert (r.calls_made, r.child_runs, r.child_calls_made) == (2, 1, 1)
    assert r.child_usd_paid == rc.usd_paid > 0
    assert r.usd_total == r.usd_paid + rc.usd_paid
    assert len(server.requests) == 3


async def test_consent_cycles_depth_and_unknown_callees_are_error_results(
    client: Client, db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    load_app("tests.calls_app")

    def desk(b: dict[str, Any]) -> Reply:
        seen = results(b)
        if not seen:
            return Reply(
                [
                    ToolCall(id="g1", name="call_ghost", arguments={"input": "boo"}),
                    ToolCall(id="k1", name="call_gatekeeper", arguments={"input": "open"}),
                    ToolCall(id="r1", name="call_researcher", arguments={"input": ""}),
                ]
            )
        return Reply(" | ".join(seen))

    plan: Plan = {
        "desk": desk,
        "ping": lambda b: Reply(results(b)[0]) if results(b) else call("call_pong", "hi", "p1"),
        "pong": relay("pong saw", "call_ping", "back", "q1"),
        "chain0": lambda b: Reply(results(b)[0]) if results(b) else call("call_chain1", "x", "c0"),
        "chain1": relay("chain1 saw", "call_chain2", "y", "c1"),
    }
    async with model(plan, monkeypatch) as server, running_worker(db_url):
        desk_run = await start_run(client, "desk", "try them all")
        ping_run = await start_run(client, "ping", "start")
        chain_run = await start_run(client, "chain0", "start")
        for run_id in (desk_run, ping_run, chain_run):
            assert await wait_for(lambda r=run_id: settled(client, r)) == "completed"

    unknown, one_sided, empty = (await read_run(client, desk_run)).output.split(" | ")
    assert unknown == "refused: no live worker runs an agent named 'ghost'"
    assert "'gatekeeper' does not accept calls from 'desk'" in one_sided
    assert "takes one argument, input: a non-empty text" in empty
    assert not (await read_run(client, desk_run)).children
    assert (await read_run(client, ping_run)).output == (
        "pong saw: refused: calling 'ping' would make a cycle (ping -> pong -> ping)"
    )
    assert (await read_run(client, chain_run)).output.startswith(
        "chain1 saw: refused: this run is 1 call(s) deep and 'chain1' may call at most 1 deep"
    )
    assert not by_agent(server, "chain2")
    assert not by_agent(server, "ghost")


async def test_a_callers_max_call_depth_binds_every_run_below_it(
    client: Client, db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    load_app("tests.calls_app")
    plan: Plan = {
        "da": relay("da heard", "call_db", "go on", "a1"),
        "db": relay("db saw", "call_dc", "deeper", "b1"),
        "dc": lambda b: Reply("dc ran"),
    }
    async with model(plan, monkeypatch) as server, running_worker(db_url):
        run_id = await start_run(client, "da", "start")
        assert await wait_for(lambda: settled(client, run_id)) == "completed"
    state = await read_run(client, run_id)
    # db's call is refused as an error result; db goes on and answers with it.
    assert state.output == (
        "da heard: db saw: refused: this run is 1 call(s) deep and the chain above it "
        "(da -> db) may go at most 1 deep (the smallest max_call_depth in it)"
    )
    [child] = state.children.values()
    child_state = await read_run(client, child.run_id)
    assert (child_state.chain, child_state.depth_limit) == (("da",), 1)
    assert not child_state.children
    assert not by_agent(server, "dc")
    runs = await client.pool.fetch("SELECT args->>'agent' AS agent FROM toren.actors")
    assert sorted(r["agent"] for r in runs) == ["da", "db"]


def test_a_child_started_by_an_earlier_version_keeps_its_own_depth_limit() -> None:
    """A recorded child start has no depth limit from above: only the caller's own
    ``max_call_depth`` counts, as when it was recorded."""
    import json
    from pathlib import Path

    from toren import Agent
    from toren._core.codec import decode
    from toren.actors.runs.calls import depth_refusal
    from toren.runs import RunState, fold

    recorded = Path(__file__).parent / "fixtures" / "journals" / "run_v1_calls_child.json"
    entries = json.loads(recorded.read_text())
    state = fold(RunState(), decode(entries[0]["type"], entries[0]["data"]))
    assert (state.chain, state.depth_limit) == (("desk",), None)
    editor = Agent(name="editor", model="anthropic/claude-sonnet-4-6", max_call_depth=2)
    assert depth_refusal(state, editor) is None  # one deep: it may call one deeper
    shallow = Agent(name="editor", model="anthropic/claude-sonnet-4-6", max_call_depth=1)
    assert depth_refusal(state, shallow) == (
        "refused: this run is 1 call(s) deep and 'editor' may call at most 1 deep (max_call_depth)"
    )


async def test_the_childs_spend_stops_the_parent_at_its_budget(
    client: Client, db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    load_app("tests.calls_app")
    expensive = Usage(input_tokens=20_000, output_tokens=10)  # $0.06 at $3 per million
    plan: Plan = {
        "spender": lambda b: Reply("never") if results(b) else call("call_researcher", "x", "s1"),
        "researcher": lambda b: Reply("costly facts", usage=expensive),
    }
    async with model(plan, monkeypatch), running_worker(db_url):
        run_id = await start_run(client, "spender", "spend")
        assert await wait_for(lambda: settled(client, run_id)) == "failed"
    state = await read_run(client, run_id)
    [child] = state.children.values()
    child_state = await read_run(client, child.run_id)
    # The child's budget was what the parent had left; its spend counts in the parent's.
    assert child_state.budget_cap is not None
    assert child_state.budget_cap < Decimal("0.05")
    assert (child_state.status, child_state.error_class) == ("failed", "budget")
    assert state.error_class == "budget"
    assert receipt(state).usd_total > Decimal("0.05")
    assert receipt(state).child_usd_paid == receipt(child_state).usd_paid
    # Its failure went to its parent, which took it: the child is not retried on its own.
    from toren.runs import RunNotInState, retry

    with pytest.raises(RunNotInState, match="child run of"):
        await retry(client, child.run_id)


async def test_cancelling_a_parent_cancels_the_child_it_waits_on(
    client: Client, db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    load_app("tests.calls_app")
    plan: Plan = {
        "desk": lambda b: call("call_editor", "the news", "e1"),
        "editor": lambda b: Reply([ToolCall(id="pub1", name="publish", arguments={"text": "n"})]),
    }
    async with model(plan, monkeypatch), running_worker(db_url):
        run_id = await start_run(client, "desk", "publish the news")

        async def child_waiting() -> str | None:
            state = await read_run(client, run_id)
            for c in state.children.values():
                if (await read_run(client, c.run_id)).status == "parked":
                    return c.run_id
            return None

        child_id = await wait_for(child_waiting, what="the child parked on its approval")

        async def asked_on_parent() -> bool:
            rows = await client.pool.fetch(
                "SELECT data FROM toren.journal WHERE actor_id = $1 "
                "AND type = 'child.approval_requested'",
                run_id,
            )
            return bool(rows) and rows[0]["data"]["child_call_id"] == "pub1"

        await wait_for(asked_on_parent, what="the child's approval on the parent's timeline")
        await cancel(client, run_id, reason="changed my mind")
        assert await wait_for(lambda: settled(client, child_id)) == "cancelled"
        child_state = await read_run(client, child_id)
        assert child_state.error_class == "cancelled"
        assert run_id in (child_state.error or "")

        async def child_counted() -> bool:
            return receipt(await read_run(client, run_id)).child_runs == 1

        await wait_for(child_counted, what="the cancelled child's cost in the parent's receipt")
    parent = await read_run(client, run_id)
    assert (parent.status, parent.error_class) == ("cancelled", "cancelled")
    assert [f.status for f in parent.finished.values()] == ["cancelled"]


async def test_a_callee_served_by_another_worker_process(
    client: Client,
    db_url: str,
    monkeypatch: pytest.MonkeyPatch,
    workers: WorkerFactory,
) -> None:
    load_app("tests.calls_app")
    plan: Plan = {
        "desk": relay("desk", "call_remote_helper", "help", "h1"),
        "remote_helper": lambda b: Reply("helped from afar"),
    }
    async with model(plan, monkeypatch):
        workers("tests.calls_remote")

        async def published() -> bool:
            from toren._core.workers import published_cards

            return bool(await published_cards(client.pool, "remote_helper"))

        await wait_for(published, timeout=60, what="the other worker publishing remote_helper")
        # This process's worker does not load remote_helper: only the other one can run the
        # child (runs are claimed by the route of their agent).
        async with running_worker(db_url):
            run_id = await start_run(client, "desk", "ask the remote one")
            assert await wait_for(lambda: settled(client, run_id), timeout=60) == "completed"
    state = await read_run(client, run_id)
    assert state.output == "desk: helped from afar"
    [child] = state.children.values()
    child_state = await read_run(client, child.run_id)
    assert (child_state.agent, child_state.parent) == ("remote_helper", run_id)


async def test_a_childs_approval_is_decided_from_the_parents_page_by_the_childs_agent(
    client: Client, db_url: str, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> None:
    from tests.test_authorization import _token, api, bearer

    load_app("tests.calls_app")
    plan: Plan = {
        "desk": relay("desk", "call_editor", "the news", "e1"),
        "editor": publisher,
        "researcher": lambda b: Reply("unrelated facts"),
    }
    _, desk_only = await _token(client, "desk-only", ["read", "approve"], agents=["desk"])
    _, editor_only = await _token(client, "editor-only", ["read", "approve"], agents=["editor"])
    async with model(plan, monkeypatch), running_worker(db_url), api(db_url) as base:
        run_id = await start_run(client, "desk", "publish the news")
        uuid = run_id.removeprefix("run/")

        async def shown_on_parent() -> dict[str, Any] | None:
            async with bearer(desk_only) as http, http.get(f"{base}/runs/{uuid}") as r:
                body: dict[str, Any] = await r.json()
            return body if body["waiting_on"] else None

        page = await wait_for(shown_on_parent, what="the child's call on the parent's page")
        [waiting] = page["waiting_on"]
        [child] = page["children"]
        assert (waiting["call_id"], waiting["tool"], waiting["agent"]) == (
            "pub1",
            "publish",
            "editor",
        )
        assert waiting["run"] == child["run"] != run_id
        assert (child["agent"], child["call_id"], child["status"]) == ("editor", "e1", "parked")
        decision = {"call_id": "pub1", "approved": True, "reason": "fine"}
        # A token limited to the parent's agent may not decide the child's call.
        approvals = f"{base}/runs/{uuid}/approvals"
        async with bearer(desk_only) as http, http.post(approvals, json=decision) as r:
            assert r.status == 403, await r.text()
        # A run named that is not one the parent waits on: refused, nothing sent anywhere.
        stranger = await start_run(client, "researcher", "unrelated")
        elsewhere = {**decision, "run": stranger}
        async with bearer(editor_only) as http, http.post(approvals, json=elsewhere) as r:
            assert r.status == 409, await r.text()
            assert "is not" in (await r.json())["detail"]
        decision["run"] = child["run"]  # named, as the console sends it
        async with bearer(editor_only) as http, http.post(approvals, json=decision) as r:
            assert r.status == 200, await r.text()
            answer = await r.json()
        assert (answer["run"], answer["outcome"]) == (child["run"], "applied")
        assert await wait_for(lambda: settled(client, run_id)) == "completed"
    assert (await read_run(client, run_id)).output == "desk: editor: published 'n'"
    if request.config.getoption("--record-journals", default=False):
        from tests.test_runs import _record_fixture

        _record_fixture(await client.journal(run_id), "run_v1_calls_parent.json")
        _record_fixture(await client.journal(child["run"]), "run_v1_calls_child.json")
    decided = await read_run(client, child["run"])
    assert decided.decisions["pub1"].by is not None
    assert decided.decisions["pub1"].by.name == "editor-only"


async def test_the_cli_approves_a_childs_call_from_the_parent_and_shows_both(
    client: Client, db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import anyio

    from tests.test_cli import toren

    load_app("tests.calls_app")
    plan: Plan = {
        "desk": relay("desk", "call_editor", "the news", "e1"),
        "editor": publisher,
    }
    async with model(plan, monkeypatch), running_worker(db_url):
        run_id = await start_run(client, "desk", "publish the news")

        async def child_parked() -> str | None:
            for c in (await read_run(client, run_id)).children.values():
                if await run_status(client, c.run_id) == "parked":
                    return c.run_id
            return None

        child_id = await wait_for(child_parked, what="the child parked on its approval")
        approved = await anyio.to_thread.run_sync(
            lambda: toren("jobs", "approve", run_id, "--reason", "ok", db_url=db_url)
        )
        assert approved.returncode == 0, approved.stderr
        assert f'approving publish {{"text": "n"}} (call pub1 of child run {child_id})' in (
            approved.stdout
        )
        assert await wait_for(lambda: settled(client, run_id)) == "completed"
    shown = await anyio.to_thread.run_sync(lambda: toren("jobs", "show", run_id, db_url=db_url))
    assert f"child run {child_id}: editor, call e1 (completed" in shown.stdout
    assert "child runs: 1, 2 calls" in shown.stdout
    child_shown = await anyio.to_thread.run_sync(
        lambda: toren("jobs", "show", child_id, db_url=db_url)
    )
    assert f"started by run {run_id}" in child_shown.stdout


async def test_an_ended_child_is_not_revived_and_a_callee_refuses_a_caller_it_does_not_accept(
    client: Client, db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from toren.runs import RunNotInState, StartRun, say

    load_app("tests.calls_app")
    plan: Plan = {
        "desk": relay("desk", "call_researcher", "tides", "d1"),
        "researcher": lambda b: Reply("The moon."),
    }
    async with model(plan, monkeypatch) as server, running_worker(db_url):
        run_id = await start_run(client, "desk", "Why tides?")
        assert await wait_for(lambda: settled(client, run_id)) == "completed"
        [child] = (await read_run(client, run_id)).children.values()
        # Its end went to its parent, which took it: continuing or retrying the child would
        # act and spend where no receipt counts it.
        with pytest.raises(RunNotInState, match="child run of"):
            await say(client, child.run_id, "and the sun?")
        # A start that names a caller the callee does not accept (consent is checked at call
        # time; the callee checks its own definition too): the child fails, class config.
        intruder = "run/00000000-0000-4000-8000-000000000001"
        await client.spawn("toren.run", intruder, {"agent": "desk"})
        forged = "run/00000000-0000-4000-8000-000000000002"
        await client.spawn("toren.run", forged, {"agent": "researcher"}, route="agent:researcher")
        start = StartRun(
            agent="researcher", input="x", parent=intruder, parent_call="c9", chain=("gatekeeper",)
        )
        await client.send(forged, start, dedupe_key="start")
        assert await wait_for(lambda: settled(client, forged)) == "failed"
        state = await read_run(client, forged)
        assert state.error_class == "config"
        assert "does not accept calls from 'gatekeeper'" in (state.error or "")
        served = len(server.requests)
    assert served == 3  # desk twice, researcher once: the refused child made no call
