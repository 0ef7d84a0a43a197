"""Durable agent runs: the model loop, tools with intents, approvals that park, the receipt."""

from __future__ import annotations

import contextlib
import json
import time
import weakref
from collections.abc import AsyncIterator
from decimal import Decimal
from pathlib import Path
from typing import Any

import anyio
import attrs
import pytest

# Paid once here: an SDK import takes seconds (the run actor does it in a thread, but a test that
# times a budget should not measure it).
import toren.providers.anthropic  # noqa: F401
from tests import run_app
from tests.conftest import WorkerFactory, decide_waiting, person, running_worker, wait_for
from toren import Client
from toren._agent.app import load_app
from toren._agent.model import Text, ToolCall
from toren.runs import cancel, read_run, receipt, retry, say, start_run
from toren.testing import AnthropicServer, BedrockServer, Fail, OpenAIServer, Reply, ScriptedServer

pytestmark = pytest.mark.anyio


@contextlib.asynccontextmanager
async def anthropic(
    script: list[Reply], monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[AnthropicServer]:
    async with AnthropicServer(script) as server:
        for name, value in server.env().items():
            monkeypatch.setenv(name, value)
        yield server


async def _status(client: Client, run_id: str, status: str) -> bool:
    return (await read_run(client, run_id)).status == status


async def test_a_run_calls_tools_parks_for_approval_and_completes(
    client: Client, db_url: str, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> None:
    load_app("tests.run_app")
    run_app.applied.clear()
    ticket = ToolCall(id="c1", name="create_ticket", arguments={"title": "broken"})
    script = [
        Reply([Text(text="Opening a ticket."), ticket]),
        Reply([ToolCall(id="c2", name="refund", arguments={"amount": 500})]),
        Reply("All done."),
    ]
    async with anthropic(script, monkeypatch) as server, running_worker(db_url):
        run_id = await start_run(client, "support", "My order is broken.")
        await wait_for(lambda: _status(client, run_id, "parked"), what="parked on approval")

        async def passivated() -> bool:
            return (await client.actor(run_id))["owner"] is None

        await wait_for(passivated, what="lease released while parked")
        await decide_waiting(client, run_id, approved=True, by=person("alice"), reason="ok")
        await wait_for(lambda: _status(client, run_id, "completed"), what="completed")
        assert len(server.requests) == 3

    state = await read_run(client, run_id)
    assert state.output == "All done."
    assert [c.step for c in state.calls] == [1, 2, 3]
    # External tools: the intent is committed before the tool runs, the result after.
    assert await _tool_commits(client, run_id) == {"c1": 2, "c2": 2}
    assert state.results["c1"].content == "ticket for 'broken'"
    assert state.results["c2"].content == "refunded 500"
    [decision] = state.decisions.values()
    assert (decision.who, decision.approved, decision.reason) == ("alice", True, "ok")
    assert len(run_app.applied) == 1
    assert state.intents["c1"].idempotency_key == run_app.applied[0]
    # The second request carried the tool result of the first call back to the model.
    second = server.requests[1]["messages"]
    assert second[-1]["content"][0]["type"] == "tool_result"
    if request.config.getoption("--record-journals", default=False):
        _record_fixture(await client.journal(run_id), "run_v1.json")
    r = receipt(state)
    assert r.calls_made == 3
    # The model server reports its estimate of each request as the call's input tokens.
    assert r.input_tokens == sum(req.input_tokens for req in server.received)
    assert r.usd_paid > 0
    assert r.unpriced_calls == 0


async def test_denied_calls_and_bad_calls_go_back_to_the_model_as_errors(
    client: Client, db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    load_app("tests.run_app")
    script = [
        Reply([
            ToolCall(id="u1", name="no_such_tool", arguments={}),
            ToolCall(id="m1", name="create_ticket", arguments={"titel": "typo"}),
            ToolCall(id="r1", name="refund", arguments={"amount": 1000}),
        ]),
        Reply("Sorry."),
    ]  # fmt: skip
    async with anthropic(script, monkeypatch) as server, running_worker(db_url):
        run_id = await start_run(client, "support", "Refund me.")
        await wait_for(lambda: _status(client, run_id, "parked"), what="parked")
        await decide_waiting(client, run_id, approved=False, by=person("bob"), reason="too much")
        await wait_for(lambda: _status(client, run_id, "completed"), what="completed")
        results = server.requests[1]["messages"][-1]["content"]
    assert [r["is_error"] for r in results] == [True, True, True]
    texts = [
        r["content"] if isinstance(r["content"], str) else r["content"][0]["text"] for r in results
    ]
    assert "unknown tool 'no_such_tool'" in texts[0]
    assert "invalid arguments for create_ticket" in texts[1]
    assert texts[2] == "denied by bob: too much"


async def test_an_idempotency_key_starts_one_run(client: Client) -> None:
    from toren.runs import IdempotencyConflict

    first = await start_run(client, "support", "hello", idempotency_key="k1")
    again = await start_run(client, "support", "hello", idempotency_key="k1")
    assert again == first
    assert await client.pool.fetchval("SELECT count(*) FROM toren.mailbox") == 1
    with pytest.raises(IdempotencyConflict):
        await start_run(client, "support", "other input", idempotency_key="k1")


def _by_position(steps: int) -> Any:
    """Answer by conversation position (assistant turns so far), not by arrival order, so that a
    call repeated after a crash gets the same answer."""

    def respond(request: dict[str, Any], n: int) -> Reply:
        position = sum(1 for m in request["messages"] if m["role"] == "assistant")
        if position < steps - 1:
            call = ToolCall(
                id=f"t{position}", name="create_ticket", arguments={"title": f"#{position}"}
            )
            return Reply([call])
        return Reply("Five tickets opened.")

    return respond


@pytest.mark.processes
async def test_sigkill_while_a_model_call_is_in_flight_repays_only_that_call(
    client: Client,
    workers: WorkerFactory,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    ledger = tmp_path / "ledger"
    monkeypatch.setenv("TOREN_TEST_LEDGER", str(ledger))
    async with AnthropicServer(_by_position(6)) as server:
        for name, value in server.env().items():
            monkeypatch.setenv(name, value)
        held = server.hold(4)  # the fourth model call: three calls and three tickets are done
        first = workers(app="tests.run_app")
        run_id = await start_run(client, "support", "Open five tickets.")
        with anyio.fail_after(30):
            await held.arrived.wait()
        first.kill()
        held.release()
        workers(app="tests.run_app")
        await wait_for(lambda: _status(client, run_id, "completed"), timeout=30, what="completed")
        positions = [
            sum(1 for m in r["messages"] if m["role"] == "assistant") for r in server.requests
        ]
    # Every distinct call once, the one in flight at the kill twice, nothing else again.
    assert sorted(positions) == [0, 1, 2, 3, 3, 4, 5]
    state = await read_run(client, run_id)
    assert state.output == "Five tickets opened."
    r = receipt(state)
    assert (r.calls_made, r.calls_replayed) == (6, 3)
    assert (r.calls_lost, r.calls_made + r.calls_lost) == (1, len(positions))  # the server's
    assert r.usd_not_repaid == sum(
        (Decimal(c.cost_usd) for c in state.calls[:3] if c.cost_usd), Decimal(0)
    )
    assert r.usd_not_repaid > 0
    keys = [line.split()[0] for line in ledger.read_text().splitlines()]
    assert len(set(keys)) == 5  # each ticket applied once (by key), none lost


@pytest.mark.processes
async def test_a_keyed_tool_cut_between_intent_and_result_reruns_under_the_same_key(
    client: Client,
    workers: WorkerFactory,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    ledger = tmp_path / "ledger"
    monkeypatch.setenv("TOREN_TEST_LEDGER", str(ledger))
    script = [
        Reply([ToolCall(id="s1", name="slow_ticket", arguments={"title": "slow"})]),
        Reply("Opened."),
    ]
    async with AnthropicServer(script) as server:
        for name, value in server.env().items():
            monkeypatch.setenv(name, value)
        first = workers(app="tests.run_app")
        run_id = await start_run(client, "support", "Open a ticket.")

        async def running() -> bool:
            return ledger.exists() and ledger.with_suffix(".first").exists()

        await wait_for(running, what="the tool running")
        first.kill()
        workers(app="tests.run_app")
        await wait_for(lambda: _status(client, run_id, "completed"), timeout=30, what="completed")
        assert len(server.requests) == 2
    attempts = [line.split()[0] for line in ledger.read_text().splitlines()]
    assert len(attempts) == 2  # the tool ran again after the kill...
    assert len(set(attempts)) == 1  # ...under the same key: the tracker applies it once
    state = await read_run(client, run_id)
    assert state.intents["s1"].idempotency_key == attempts[0]


async def test_a_429_is_retried_and_a_400_fails_the_run_with_class_provider(
    client: Client, db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    load_app("tests.run_app")
    monkeypatch.setenv("TOREN_MODEL_RETRY_BASE_SECONDS", "0.01")
    script = [
        Fail(status=429, retry_after=0.05),
        Reply("fine"),
        Fail(status=400, message="bad tool schema"),
    ]
    async with anthropic(script, monkeypatch) as server, running_worker(db_url):
        ok = await start_run(client, "support", "hi")
        await wait_for(lambda: _status(client, ok, "completed"), what="completed after a 429")
        assert len(server.requests) == 2
        bad = await start_run(client, "support", "hi again")
        await wait_for(lambda: _status(client, bad, "failed"), what="failed on a 400")
    state = await read_run(client, bad)
    assert state.error_class == "provider"
    assert "bad tool schema" in (state.error or "")


async def test_attempts_cap_fails_the_run_and_retry_finishes_it_without_repaying(
    client: Client, db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    load_app("tests.run_app")
    monkeypatch.setenv("TOREN_MODEL_RETRY_ATTEMPTS", "1")
    ticket = ToolCall(id="k1", name="create_ticket", arguments={"title": "x"})
    script = [Reply([ticket]), Fail(status=500), Fail(status=500), Reply("Done after all.")]
    async with anthropic(script, monkeypatch) as server, running_worker(db_url):
        run_id = await start_run(client, "strict", "open one")
        await wait_for(lambda: _status(client, run_id, "failed"), timeout=30, what="attempts cap")
        state = await read_run(client, run_id)
        assert state.error_class == "attempts"
        assert len(server.requests) == 3
        await retry(client, run_id, by=person("ops"))
        await wait_for(lambda: _status(client, run_id, "completed"), what="completed on retry")
        assert len(server.requests) == 4  # the completed first call was not paid again
    state = await read_run(client, run_id)
    assert [c.step for c in state.calls] == [1, 2]
    assert state.output == "Done after all."


async def test_dollar_budget_fails_the_run_with_class_budget(
    client: Client, db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    load_app("tests.run_app")
    ticket = ToolCall(id="b1", name="create_ticket", arguments={"title": "x"})
    async with anthropic([Reply([ticket])], monkeypatch), running_worker(db_url):
        run_id = await start_run(client, "cheap", "go")
        await wait_for(lambda: _status(client, run_id, "failed"), what="budget")
    state = await read_run(client, run_id)
    assert state.error_class == "budget"
    assert state.results == {}  # it stopped before running the tool


async def test_cancel_a_parked_run_and_talk_to_a_completed_one(
    client: Client, db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    load_app("tests.run_app")
    refund_call = ToolCall(id="p1", name="refund", arguments={"amount": 900})
    script = [Reply([refund_call]), Reply("Hello."), Reply("Still here.")]
    async with anthropic(script, monkeypatch) as server, running_worker(db_url):
        parked = await start_run(client, "support", "refund please")
        await wait_for(lambda: _status(client, parked, "parked"), what="parked")
        await cancel(client, parked, by=person("carol"), reason="duplicate")
        await wait_for(lambda: _status(client, parked, "cancelled"), what="cancelled")
        chat = await start_run(client, "support", "hi")
        await wait_for(lambda: _status(client, chat, "completed"), what="first answer")
        await say(client, chat, "are you there?", by=person("dave"))
        await wait_for(lambda: _output(client, chat, "Still here."), what="second answer")
        last_request = server.requests[-1]["messages"]
    state = await read_run(client, parked)
    assert (state.error_class, state.error) == ("cancelled", "cancelled by carol: duplicate")
    assert last_request[-1]["content"][0]["text"] == "are you there?"


async def test_a_message_sent_before_the_run_started_is_heard_after_its_input(
    client: Client, db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    load_app("tests.run_app")
    async with anthropic([Reply("Both read.")], monkeypatch) as server:
        # No worker yet: the start and the message wait together, the message on the lane a
        # run takes first.
        run_id = await start_run(client, "support", "first words")
        await say(client, run_id, "and a second thought", by=person("erin"))
        async with running_worker(db_url):
            await wait_for(lambda: _status(client, run_id, "completed"), what="completed")
    [request] = server.requests
    [turn] = request["messages"]
    assert [b["text"] for b in turn["content"]] == ["first words", "and a second thought"]
    rows = await client.pool.fetch(
        "SELECT type FROM toren.journal WHERE actor_id = $1 ORDER BY seq", run_id
    )
    kinds = [r["type"] for r in rows]
    assert kinds.count("message.received") == 1
    first = kinds.index
    assert first("run.started") < first("message.received") < first("model.called")


async def test_a_message_to_a_run_made_without_a_start_is_dropped_not_sent_round_for_ever(
    client: Client, db_url: str
) -> None:
    from toren.runs import RUN_KIND, agent_route

    load_app("tests.run_app")
    run_id = "run/00000000-0000-4000-8000-00000000c0de"
    await client.spawn(RUN_KIND, run_id, {"agent": "support"}, route=agent_route("support"))
    await say(client, run_id, "anyone there?", by=person("erin"))
    async with running_worker(db_url):

        async def drained() -> bool:
            left = await client.pool.fetchval(
                "SELECT count(*) FROM toren.mailbox WHERE actor_id = $1", run_id
            )
            return left == 0

        await wait_for(drained, what="the message dropped")
    assert await client.journal(run_id) == []


async def _output(client: Client, run_id: str, text: str) -> bool:
    state = await read_run(client, run_id)
    return state.status == "completed" and state.output == text


def _ticket_refund_done(request: dict[str, Any], n: int) -> Reply:
    """A ticket, then a refund (needs approval), then done; by conversation position."""
    ticket = ToolCall(id="c1", name="create_ticket", arguments={"title": "a"})
    refund_call = ToolCall(id="c2", name="refund", arguments={"amount": 500})
    position = sum(1 for m in request["messages"] if m["role"] == "assistant")
    return [Reply([ticket]), Reply([refund_call]), Reply("Done.")][min(position, 2)]


def _shouting(original: Any) -> Any:
    """A build_request that renders tool results in capitals (version 2 of the code): the
    request of step 2, which carries the first tool result, changes; step 1's does not."""
    from toren._agent.model import Message, ToolResult

    def shout(agent: Any, messages: tuple[Message, ...], callees: Any = None) -> Any:
        loud = tuple(
            Message(
                role=m.role,
                content=tuple(
                    attrs.evolve(b, content=b.content.upper()) if isinstance(b, ToolResult) else b
                    for b in m.content
                ),
            )
            for m in messages
        )
        return original(agent, loud, callees)

    return shout


async def test_a_changed_request_invalidates_from_that_step_and_reapplies_human_messages(
    client: Client, db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import toren.actors.runs.request

    load_app("tests.run_app")
    async with anthropic(_ticket_refund_done, monkeypatch) as server:  # type: ignore[arg-type]
        async with running_worker(db_url):  # version 1
            run_id = await start_run(client, "support", "Fix my order.")
            await wait_for(lambda: _status(client, run_id, "parked"), what="parked")
            await say(client, run_id, "Also check order B-2.", by=person("erin"))

            async def heard() -> bool:
                return bool((await read_run(client, run_id)).heard)

            await wait_for(heard, what="message recorded")

        # Version 2 renders tool results differently.
        shout = _shouting(toren.actors.runs.request.build_request)
        monkeypatch.setattr(toren.actors.runs.request, "build_request", shout)
        await decide_waiting(client, run_id, approved=True, by=person("alice"), wait=None)
        async with running_worker(db_url):  # version 2

            async def asked_again() -> bool:
                state = await read_run(client, run_id)
                return bool(state.voided) and state.status == "parked"

            await wait_for(asked_again, what="invalidated, then asked again")
            await decide_waiting(client, run_id, approved=True, by=person("alice"))
            await wait_for(lambda: _status(client, run_id, "completed"), what="completed")
        requests = server.requests

    journal = await client.journal(run_id)
    [invalidated] = [e for e in journal if e.type == "steps.invalidated"]
    assert invalidated.data["from_step"] == 2
    shapes = [
        [(m["role"], [b.get("type") for b in m["content"]]) for m in r["messages"]]
        for r in requests
    ]
    assert len(requests) == 4, shapes  # steps 1, 2 (void), 2 again, 3: step 1 not paid again
    repeated = requests[2]["messages"]
    assert repeated[-1]["content"][-1] == {"type": "text", "text": "Also check order B-2."}
    assert "TICKET FOR 'A'" in str(repeated)
    state = await read_run(client, run_id)
    assert [c.step for c in state.calls] == [1, 2, 3]
    assert len(state.voided) == 1
    assert receipt(state).calls_made == 4


async def test_a_step_that_invalidated_and_then_failed_checks_the_journal_again_on_retry(
    client: Client, db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import toren.actors.runs.request
    from toren.actors.runs import deciding

    load_app("tests.run_app")
    async with anthropic(_ticket_refund_done, monkeypatch):  # type: ignore[arg-type]
        async with running_worker(db_url):  # version 1
            run_id = await start_run(client, "support", "Fix my order.")
            await wait_for(lambda: _status(client, run_id, "parked"), what="parked")
        shout = _shouting(toren.actors.runs.request.build_request)  # version 2
        monkeypatch.setattr(toren.actors.runs.request, "build_request", shout)
        decide_once = deciding.decide
        failures: list[str] = []

        def failing_once(ctx: Any, msg: Any) -> None:
            decide_once(ctx, msg)
            if not failures:
                failures.append(msg.call_id)
                raise RuntimeError("a bug after the resume check")  # the step is discarded

        monkeypatch.setattr(deciding, "decide", failing_once)
        await decide_waiting(client, run_id, approved=True, by=person("early"), wait=None)
        async with running_worker(db_url):  # version 2

            async def asked_again() -> bool:
                state = await read_run(client, run_id)
                return bool(state.voided) and state.status == "parked"

            await wait_for(asked_again, what="invalidated (on the retry too), then asked again")
            await decide_waiting(client, run_id, approved=True, by=person("later"))
            await wait_for(lambda: _status(client, run_id, "completed"), what="completed")
    assert failures == ["c2"]
    journal = await client.journal(run_id)
    assert [e.data["from_step"] for e in journal if e.type == "steps.invalidated"] == [2]
    # The early decision was for the voided step: refused, never applied to the new one.
    refused = [e.data["who"] for e in journal if e.type == "decision.refused"]
    assert refused == ["early"]
    state = await read_run(client, run_id)
    assert [d.who for d in state.decisions.values()] == ["later"]


async def test_calls_checked_under_one_system_prompt_are_checked_again_under_another(
    client: Client, db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An activation skips the calls already checked under the same request parameters; a
    changed system prompt changes the parameters, so every call is checked again (and, the
    prompt being in every request, invalidated from step 1)."""
    import toren._agent.registry

    load_app("tests.run_app")
    script = [Reply("Hello."), Reply("Again."), Reply("Fresh."), Reply("Still fresh.")]
    async with anthropic(script, monkeypatch) as server:  # type: ignore[arg-type]
        async with running_worker(db_url, default_version_policy="upgrade"):
            run_id = await start_run(client, "support", "hi")
            await wait_for(lambda: _output(client, run_id, "Hello."), what="first answer")
        async with running_worker(
            db_url, default_version_policy="upgrade"
        ):  # a new activation, the same code
            await say(client, run_id, "again", by=person("dave"))
            await wait_for(lambda: _output(client, run_id, "Again."), what="second answer")
        state = await read_run(client, run_id)
        # Both calls count as checked under this code's parameters: the first by the check of
        # this activation, the second as made by it.
        assert (state.checked_calls, len(state.calls), bool(state.checked_as)) == (2, 2, True)
        support = toren._agent.registry.agent_named("support")
        assert support is not None
        changed = attrs.evolve(support, system="You are terse.")
        monkeypatch.setitem(toren._agent.registry.PROCESS_AGENTS._registry, "support", changed)
        async with running_worker(db_url, default_version_policy="upgrade"):  # the new prompt
            await say(client, run_id, "third", by=person("dave"))
            await wait_for(lambda: _output(client, run_id, "Fresh."), what="third answer")
        async with running_worker(
            db_url, default_version_policy="upgrade"
        ):  # the new prompt still: nothing voided again
            await say(client, run_id, "fourth", by=person("dave"))
            await wait_for(lambda: _output(client, run_id, "Still fresh."), what="fourth answer")
        requests = server.requests
    journal = await client.journal(run_id)
    assert [e.data["from_step"] for e in journal if e.type == "steps.invalidated"] == [1]
    assert len(requests) == 4  # steps 1 and 2, step 1 again, step 2: none paid twice
    assert [r["system"] for r in requests[2:]] == ["You are terse."] * 2
    state = await read_run(client, run_id)
    assert (len(state.voided), len(state.calls), state.checked_calls) == (2, 2, 2)


async def test_the_wall_clock_budget_counts_work_not_time_parked_on_a_human(
    client: Client, db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    load_app("tests.run_app")
    refund_call = ToolCall(id="w1", name="refund", arguments={"amount": 500})
    script = [Reply([refund_call]), Reply("slow answer", latency=2.5), Reply("never asked")]
    async with anthropic(script, monkeypatch) as server, running_worker(db_url):
        run_id = await start_run(client, "hasty", "refund")  # wall_clock = 2 s
        await wait_for(lambda: _status(client, run_id, "parked"), what="parked")
        await anyio.sleep(3)  # parked: not charged to the budget
        await decide_waiting(client, run_id, approved=True, by=person("alice"))
        await wait_for(lambda: _status(client, run_id, "failed"), what="timed out")
        # Had the parked time counted, the run would have failed before its second call.
        assert len(server.requests) == 2
    state = await read_run(client, run_id)
    assert state.error_class == "timeout"
    assert "parked on approvals not counted" in (state.error or "")


@pytest.mark.processes
async def test_a_thousand_parked_runs_hold_no_lease_and_no_object(
    client: Client, db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import gc

    from toren.actors.runs import RunActor

    load_app("tests.run_app")
    refund_call = ToolCall(id="p1", name="refund", arguments={"amount": 900})

    def respond(request: dict[str, Any], n: int) -> Reply:
        done = any(m["role"] == "assistant" for m in request["messages"])
        return Reply("Refunded.") if done else Reply([refund_call])

    count = 1000
    instances: list[weakref.ref[RunActor]] = []
    original_init = RunActor.__init__

    def tracked_init(self: RunActor, actor_id: str, args: Any) -> None:
        original_init(self, actor_id, args)
        instances.append(weakref.ref(self))

    monkeypatch.setattr(RunActor, "__init__", tracked_init)
    async with anthropic(respond, monkeypatch) as server, running_worker(db_url, max_actors=200):
        ids = [await start_run(client, "support", f"refund {i}") for i in range(count)]

        async def all_parked() -> bool:
            parked = await client.pool.fetchval(
                "SELECT count(*) FROM toren.journal WHERE type = 'approval.requested'"
            )
            return parked == count

        await wait_for(all_parked, timeout=240, interval=0.5, what="all runs parked")

        async def all_released() -> bool:
            owned = await client.pool.fetchval(
                "SELECT count(*) FROM toren.actors WHERE kind = 'toren.run' AND owner IS NOT NULL"
            )
            return owned == 0

        await wait_for(all_released, timeout=30, what="no lease held")
        gc.collect()
        assert len(instances) >= count
        assert [ref for ref in instances if ref() is not None] == []  # no run object left
        assert len(server.requests) == count

        async def worker_reports_none_in_memory() -> bool:
            stats = await client.pool.fetchval("SELECT stats FROM toren.workers")
            return (  # None: no row (the worker is between incarnations on a loaded machine)
                stats is not None
                and stats.get("actors_in_memory") == 0
                and stats.get("leases_held") == 0
                and stats.get("rss_bytes", 0) > 0
            )

        await wait_for(worker_reports_none_in_memory, what="toren workers shows 0 in memory")

        await decide_waiting(client, ids[7], approved=True, by=person("alice"))
        await wait_for(lambda: _status(client, ids[7], "completed"), what="the approved one")
        assert len(server.requests) == count + 1  # only it went on
    statuses = {(await read_run(client, i)).status for i in ids[:7] + ids[8:20]}
    assert statuses == {"parked"}


FIXTURES = Path(__file__).parent / "fixtures" / "journals"


def _record_fixture(journal: list[Any], name: str) -> None:
    entries = [{"seq": e.seq, "type": e.type, "data": e.data} for e in journal]
    (FIXTURES / name).write_text(json.dumps(entries, indent=1, sort_keys=True) + "\n")


@pytest.mark.parametrize("name", sorted(p.name for p in FIXTURES.glob("*.json")))
def test_recorded_journals_of_every_format_version_replay_to_the_same_run(name: str) -> None:
    """Journals recorded by earlier versions stay readable: an upgrade never strands a run.
    ``run_v1_every_event.json`` holds every event type today's code records (principals,
    refused decisions, unreadable answers, invalidations, timers, crashloops...) but the two
    ``run_v1_lost.json`` records: a call announced (``model.calling``) and lost in flight at a
    SIGKILL (``model.lost``), and the one ``run_v1_refusals.json`` records: a flood of refused
    decisions past the bound (``decision.refusals_muted``), with a turn's end that records its
    time (``run.completed`` with ``at``)."""
    from toren._core.codec import decode, encode
    from toren._core.json_text import dumps, loads
    from toren.runs import RunState, fold

    entries = json.loads((FIXTURES / name).read_text())
    state = RunState()
    for entry in entries:
        event = decode(entry["type"], entry["data"])
        # Every recorded field is read, none dropped: written again, the event holds it still.
        again = loads(dumps(encode(event)[1]))
        assert {k: again.get(k) for k in entry["data"]} == entry["data"], entry
        state = fold(state, event)
    # Through a snapshot at every point (chunks and row as stored), then the rest: the same.
    from toren._core.snapshots import _state as read_state
    from toren._core.snapshots import encode as encode_snapshot

    events = [decode(entry["type"], entry["data"]) for entry in entries]
    for cut in range(len(events) + 1):
        early = RunState()
        for event in events[:cut]:
            early = fold(early, event)
        snap = encode_snapshot(early, cut)
        resumed = read_state(dict(snap.chunks), loads(dumps(snap.row)), RunState)
        for event in events[cut:]:
            resumed = fold(resumed, event)
        assert resumed == state, cut
    expected = json.loads((FIXTURES / name).with_suffix(".expected").read_text())
    r = receipt(state)
    assert {
        "status": state.status,
        "output": state.output,
        "steps": [c.step for c in state.calls],
        "tools": sorted([k, v.content] for k, v in state.results.items()),
        "approvals": sorted([k, v.who, v.approved] for k, v in state.decisions.items()),
        "calls_made": r.calls_made,
        "usd_paid": str(r.usd_paid),
        "calls_lost": r.calls_lost,  # journals before model.calling count none
    } == expected


async def test_the_sleep_tool_parks_the_run_on_a_durable_timer(
    client: Client, db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    load_app("tests.run_app")
    nap = ToolCall(id="z1", name="sleep", arguments={"seconds": 4})
    async with anthropic([Reply([nap]), Reply("Rested.")], monkeypatch), running_worker(db_url):
        run_id = await start_run(client, "sleeper", "take a nap")  # wall clock 3 s < the nap
        await wait_for(lambda: _status(client, run_id, "parked"), what="asleep")

        async def released() -> bool:
            return (await client.actor(run_id))["owner"] is None

        await wait_for(released, what="no lease while asleep")
        await wait_for(lambda: _status(client, run_id, "completed"), what="woke and finished")
    state = await read_run(client, run_id)
    assert state.results["z1"].content == "slept 4s"
    assert state.parked_seconds >= 3.5  # the nap is not charged to the wall clock
    types = [e.type for e in await client.journal(run_id)]
    assert types.index("timer.set") < types.index("timer.fired") < types.index("run.completed")


def _ten_steps(request: dict[str, Any], n: int) -> Reply:
    position = sum(1 for m in request["messages"] if m.get("role") == "assistant")
    if position == 1:
        return Reply([ToolCall(id="a1", name="refund", arguments={"amount": 500})])
    if position < 9:
        title = f"#{position}"
        return Reply(
            [ToolCall(id=f"t{position}", name="create_ticket", arguments={"title": title})]
        )
    return Reply("Ten steps done.")


@pytest.mark.processes
@pytest.mark.parametrize(
    ("agent", "server_class"),
    [
        ("support", AnthropicServer),
        ("support_openai", OpenAIServer),
        ("support_bedrock", BedrockServer),
    ],
)
async def test_ten_steps_with_an_approval_survive_a_sigkill_after_step_five(
    client: Client,
    workers: WorkerFactory,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    agent: str,
    server_class: type[ScriptedServer],
) -> None:
    ledger = tmp_path / "ledger"
    monkeypatch.setenv("TOREN_TEST_LEDGER", str(ledger))
    async with server_class(_ten_steps) as server:
        for name, value in server.env().items():
            monkeypatch.setenv(name, value)
        held = server.hold(6)  # step 5 is recorded when request 6 arrives: kill then
        first = workers(app="tests.run_app")
        run_id = await start_run(client, agent, "Open the tickets.")
        await wait_for(lambda: _status(client, run_id, "parked"), timeout=60, what="approval")
        await decide_waiting(client, run_id, approved=True, by=person("alice"))
        with anyio.fail_after(60):
            await held.arrived.wait()
        first.kill()  # request 6 stays held: it is never answered (never paid)
        workers(app="tests.run_app")
        await wait_for(lambda: _status(client, run_id, "completed"), timeout=60, what="completed")
        assert not held.released
        answered = [
            sum(1 for m in r["messages"] if m.get("role") == "assistant")
            for n, r in enumerate(server.requests, start=1)
            if n != 6
        ]
    # The server answered every distinct call exactly once.
    assert answered == list(range(10))
    state = await read_run(client, run_id)
    assert state.output == "Ten steps done."
    r = receipt(state)
    assert (r.calls_made, r.calls_replayed) == (10, 5)
    # The held request, never answered, is counted as lost in flight: the server's count.
    assert (r.calls_lost, r.calls_made + r.calls_lost) == (1, len(server.requests))
    assert r.usd_not_repaid == sum(
        (Decimal(c.cost_usd) for c in state.calls[:5] if c.cost_usd), Decimal(0)
    )
    keys = [line.split()[0] for line in ledger.read_text().splitlines()]
    assert len(set(keys)) == 8  # eight tickets, each applied once by key


async def test_tool_exceptions_and_timeouts_go_back_to_the_model_as_errors(
    client: Client, db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    load_app("tests.run_app")
    calls = [
        ToolCall(id="x1", name="flaky_lookup", arguments={"what": "explode"}),
        ToolCall(id="x2", name="flaky_lookup", arguments={"what": "hang"}),
        ToolCall(id="x3", name="flaky_lookup", arguments={"what": "order"}),
    ]
    async with anthropic([Reply(calls), Reply("ok")], monkeypatch), running_worker(db_url):
        run_id = await start_run(client, "looker", "look things up")
        await wait_for(lambda: _status(client, run_id, "completed"), what="completed")
    results = (await read_run(client, run_id)).results
    assert results["x1"].is_error
    assert "RuntimeError: the lookup service is down" in results["x1"].content
    assert results["x2"].is_error
    assert "timed out after 0.2s" in results["x2"].content
    assert (results["x3"].content, results["x3"].is_error) == ("found order", False)
    # A read has nothing to protect: its intent and result are committed by one statement.
    assert await _tool_commits(client, run_id) == {"x1": 1, "x2": 1, "x3": 1}


async def _tool_commits(client: Client, run_id: str) -> dict[str, int]:
    """How many distinct commits recorded each tool call's intent and result."""
    rows = await client.pool.fetch(
        "SELECT data->>'call_id' AS call_id, count(DISTINCT xmin::text) AS commits "
        "FROM toren.journal WHERE actor_id = $1 AND type IN ('tool.intent', 'tool.result') "
        "GROUP BY 1",
        run_id,
    )
    return {r["call_id"]: r["commits"] for r in rows}


async def test_only_workers_that_define_an_agent_claim_its_runs(
    client: Client, db_url: str
) -> None:
    from toren._agent.registry import PROCESS_AGENTS

    _registry = PROCESS_AGENTS._registry
    load_app("tests.run_app")
    saved = dict(_registry)
    _registry.clear()  # this worker's app defines no agent at all
    try:
        async with running_worker(db_url):
            run_id = await start_run(client, "support", "anyone there?")
            await anyio.sleep(1.5)
            row = await client.actor(run_id)
            assert row["owner"] is None
            assert row["route"] == "agent:support"
            assert await client.journal(run_id) == []  # untouched, not failed
    finally:
        _registry.update(saved)


async def test_a_completed_run_idle_past_its_wall_clock_still_answers_the_next_message(
    client: Client, db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Time a run spends completed, waiting for someone to write again, is not work: a
    conversation (a Telegram chat's run) that goes on after a pause longer than the agent's
    wall-clock budget answers, rather than failing with ``timeout`` and dropping the message."""
    load_app("tests.run_app")
    script = [Reply("first answer"), Reply("second answer")]
    async with anthropic(script, monkeypatch), running_worker(db_url):
        run_id = await start_run(client, "hasty", "hello")  # wall_clock = 2 s
        await wait_for(lambda: _output(client, run_id, "first answer"), what="first answer")
        started = (await read_run(client, run_id)).started_at

        async def idle_past_the_budget() -> bool:  # the pause is the point of the test
            return time.time() - started > 2.5

        await wait_for(idle_past_the_budget, what="a pause past the wall clock")
        await say(client, run_id, "are you still there?", by=person("erin"))

        async def ended() -> str | None:
            state = await read_run(client, run_id)
            if not state.heard:  # the message is not taken yet
                return None
            if state.status == "failed":
                return f"failed: {state.error_class}: {state.error}"
            return state.output if state.status == "completed" else None

        assert await wait_for(ended, what="the second turn ended") == "second answer"


async def test_a_message_to_a_completed_run_reads_message_then_resumed_then_the_next_call(
    client: Client, db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The journal (and so every timeline drawn from it) tells a reopened conversation in the
    order it happened: the message, the run going on from its journal, then the model call it
    makes, announced and made."""
    load_app("tests.run_app")
    script = [Reply("first answer"), Reply("second answer")]
    async with anthropic(script, monkeypatch), running_worker(db_url):
        run_id = await start_run(client, "support", "hello")
        await wait_for(lambda: _output(client, run_id, "first answer"), what="first answer")

        async def passivated() -> bool:  # the next message activates it again
            return (await client.actor(run_id))["owner"] is None

        await wait_for(passivated, what="lease released once completed")
        await say(client, run_id, "and another thing", by=person("erin"))
        await wait_for(lambda: _output(client, run_id, "second answer"), what="second answer")
    types = [e.type for e in await client.journal(run_id)]
    after = types[types.index("message.received") :]
    shown = ("message.received", "run.resumed", "model.calling", "model.called")
    assert [t for t in after if t in shown] == list(shown)
