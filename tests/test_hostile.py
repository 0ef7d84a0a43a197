"""Hostile data and Toren's own failures: each test reproduces a defect issue 11 found on main.

Decisions bound to their call; NUL, lone surrogates and huge text recorded exactly (or cut with
a marker) and never paid or run twice; exceptions in Toren's code, in an approval predicate, and
refused writes ending the run visibly; typed tool arguments identical live and after a replay;
one run per idempotency key under concurrent starts; the resume check redone after a failed
step; consecutive tool failures counted toward the attempts cap.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from decimal import Decimal
from typing import Any

import anyio
import attrs
import pytest

import toren.providers.anthropic  # noqa: F401  (an SDK import takes seconds; paid once here)
from tests import hostile_app
from tests.conftest import person, running_worker, wait_for
from toren import Client
from toren._agent.app import load_app
from toren._surfaces.http.states import RunStates
from toren.runs import (
    IdempotencyConflict,
    MessageTooLarge,
    RunState,
    decide,
    read_run,
    receipt,
    retry,
    say,
    start_run,
    waiting_on,
)
from toren.runs.listing import list_runs
from toren.testing import AnthropicServer, Reply, Text, ToolCall

pytestmark = pytest.mark.anyio


@contextlib.asynccontextmanager
async def model(script: Any, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[AnthropicServer]:
    load_app("tests.hostile_app")
    hostile_app.ledger.clear()
    async with AnthropicServer(script) as server:
        for name, value in server.env().items():
            monkeypatch.setenv(name, value)
        yield server


def by_position(*steps: Reply) -> Any:
    """Answer by conversation position, so that a repeated call gets the same answer."""

    def respond(request: dict[str, Any], n: int) -> Reply:
        position = sum(1 for m in request["messages"] if m["role"] == "assistant")
        return steps[min(position, len(steps) - 1)]

    return respond


async def settled(client: Client, run_id: str, status: str) -> RunState | None:
    state = await read_run(client, run_id)
    return state if state.status == status else None


async def waits_for(client: Client, run_id: str, call_id: str) -> bool:
    state = await read_run(client, run_id)
    return [c.id for c in waiting_on(state)] == [call_id]


async def agree(client: Client, run_id: str) -> tuple[str, str | None]:
    """The status and error class, checked equal in the journal's fold (CLI), the API's view
    and the list's summary."""
    state = await read_run(client, run_id)
    api_state, _ = await RunStates().read(client.pool, run_id)
    [row] = [r for r in await list_runs(client, limit=200) if r.id == run_id]
    seen = {
        (state.status, state.error_class),
        (api_state.status, api_state.error_class),
        (row.status, row.error_class),
    }
    assert len(seen) == 1, seen
    return state.status, state.error_class


# --- decisions are bound to their call ------------------------------------------------------


async def test_a_decision_for_another_call_is_refused_and_never_applied(
    client: Client, db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    script = by_position(
        Reply([ToolCall(id="p1", name="pay", arguments={"to": "alice", "amount": 1})]),
        Reply([ToolCall(id="p2", name="pay", arguments={"to": "mallory", "amount": 9999})]),
        Reply("Done."),
    )
    async with model(script, monkeypatch), running_worker(db_url):
        run_id = await start_run(client, "payer", "pay alice")
        await wait_for(lambda: waits_for(client, run_id, "p1"), what="asks about p1")
        first = await decide(client, run_id, call_id="p1", approved=True, by=person("alice"))
        assert first is not None
        assert first.outcome == "applied"
        await wait_for(lambda: waits_for(client, run_id, "p2"), what="asks about p2")
        # A stale page, a retried request, a second approver: the decision names p1.
        stale = await decide(client, run_id, call_id="p1", approved=True, by=person("bob"))
        assert stale is not None
        assert stale.outcome == "repeated"  # p1 was approved already
        other = await decide(client, run_id, call_id="p1", approved=False, by=person("carol"))
        assert other is not None
        assert other.outcome == "conflict"
        unknown = await decide(client, run_id, call_id="nope", approved=True, by=person("dave"))
        assert unknown is not None
        assert unknown.outcome == "not_waiting"
        assert "pay (call p2)" in unknown.detail  # it names what does wait
        assert await waits_for(client, run_id, "p2")
        denied = await decide(client, run_id, call_id="p2", approved=False, by=person("erin"))
        assert denied is not None
        assert denied.outcome == "applied"
        state = await wait_for(lambda: settled(client, run_id, "completed"), what="completed")
    assert [e["to"] for e in hostile_app.ledger] == ["alice"]  # mallory was never paid
    assert {k: (d.who, d.approved) for k, d in state.decisions.items()} == {
        "p1": ("alice", True),
        "p2": ("erin", False),
    }
    journal = await client.journal(run_id)
    refused = [
        (e.data["call_id"], e.data["outcome"]) for e in journal if e.type == "decision.refused"
    ]
    assert refused == [("p1", "conflict"), ("nope", "not_waiting")]


async def test_a_flood_of_refused_decisions_records_twenty_then_one_and_the_run_goes_on(
    client: Client, db_url: str, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> None:
    script = by_position(
        Reply([ToolCall(id="p1", name="pay", arguments={"to": "alice", "amount": 1})]),
        Reply("Done."),
    )
    async with model(script, monkeypatch), running_worker(db_url):
        run_id = await start_run(client, "payer", "pay alice")
        await wait_for(lambda: waits_for(client, run_id, "p1"), what="asks about p1")
        for i in range(30):
            bogus = await decide(
                client,
                run_id,
                call_id=f"bogus-{i}",
                approved=True,
                by=person("mallory"),
                reason="r" * 2000,
            )
            assert bogus is not None
            assert bogus.outcome == "not_waiting"  # every one answered, recorded or not
        applied = await decide(client, run_id, call_id="p1", approved=True, by=person("alice"))
        assert applied is not None
        assert applied.outcome == "applied"
        await wait_for(lambda: settled(client, run_id, "completed"), what="completed")
    journal = await client.journal(run_id)
    refused = [e.data["call_id"] for e in journal if e.type == "decision.refused"]
    assert refused == [f"bogus-{i}" for i in range(20)]
    [muted] = [e.data for e in journal if e.type == "decision.refusals_muted"]
    assert muted["recorded"] == 20
    assert muted["until"] - muted["since"] == 3600
    if request.config.getoption("--record-journals", default=False):
        from tests.test_runs import _record_fixture

        _record_fixture(journal, "run_v1_refusals.json")


async def test_a_decision_nobody_answers_is_pending_and_applies_only_to_its_call(
    client: Client, db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    script = by_position(
        Reply([ToolCall(id="p1", name="pay", arguments={"to": "alice", "amount": 1})]),
        Reply("Done."),
    )
    async with model(script, monkeypatch):
        async with running_worker(db_url):
            run_id = await start_run(client, "payer", "pay alice")
            await wait_for(lambda: waits_for(client, run_id, "p1"), what="asks about p1")
        # No worker: nobody answers within the bound, and the decisions stay queued.
        pending = await decide(
            client, run_id, call_id="p0", approved=True, by=person("x"), wait=0.5
        )
        assert pending is None
        await decide(client, run_id, call_id="p1", approved=True, by=person("alice"), wait=None)
        async with running_worker(db_url):
            state = await wait_for(lambda: settled(client, run_id, "completed"), what="done")
    assert [e["call_id"] for e in hostile_app.ledger] == ["p1"]
    assert [d.who for d in state.decisions.values()] == ["alice"]


# --- data that Postgres' jsonb refuses, huge data -------------------------------------------


async def test_nul_and_lone_surrogates_are_recorded_exactly_and_nothing_runs_or_is_paid_twice(
    client: Client, db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    said = "I say \x00 and \udc80 here"
    script = by_position(
        Reply([Text(text=said), ToolCall(id="h1", name="hostile_result", arguments={"x": "\x00"})]),
        Reply("done \x00\ud800"),
    )
    async with model(script, monkeypatch) as server, running_worker(db_url):
        run_id = await start_run(client, "hostile", "hi \x00")
        state = await wait_for(lambda: settled(client, run_id, "completed"), what="completed")
        assert len(server.requests) == 2
    assert len(hostile_app.ledger) == 1  # the external, unkeyed tool ran once
    assert hostile_app.ledger[0]["x"] == "\x00"
    assert state.input == "hi \x00"
    assert state.calls[0].response.content[0] == Text(text=said)
    assert state.results["h1"].content == "a\x00b\ud800c"
    assert state.output == "done \x00\ud800"
    r = receipt(state)
    assert (r.calls_made, r.unpriced_calls) == (2, 0)
    assert r.usd_paid > 0
    assert await agree(client, run_id) == ("completed", None)
    assert await client.pool.fetchval("SELECT count(*) FROM toren.deadletters") == 0


async def test_a_3mb_answer_holding_a_nul_is_recorded_and_paid_once(
    client: Client, db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    answer = "x" * 3_000_000 + "\x00"
    async with model(by_position(Reply(answer)), monkeypatch) as server, running_worker(db_url):
        run_id = await start_run(client, "hostile", "write a lot")
        state = await wait_for(lambda: settled(client, run_id, "completed"), what="completed")
        assert len(server.requests) == 1
    assert state.output == answer
    assert receipt(state).calls_made == 1


async def test_an_answer_over_the_cap_is_cut_with_a_marker_and_paid_once(
    client: Client, db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    answer = "z" * 200_000  # over the agent's 64 KiB response cap
    async with model(by_position(Reply(answer)), monkeypatch) as server, running_worker(db_url):
        run_id = await start_run(client, "capped", "write a lot")
        state = await wait_for(lambda: settled(client, run_id, "completed"), what="completed")
        assert len(server.requests) == 1
    assert state.output is not None
    assert len(state.output.encode()) <= 64 * 1024
    assert state.output.endswith(
        "[Toren cut this response: the response was 200000 bytes, over the 65536-byte cap]"
    )


async def test_a_tool_result_over_the_cap_is_cut_and_the_model_told(
    client: Client, db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    script = by_position(
        Reply([ToolCall(id="b1", name="big_result", arguments={"size": 300_000})]),
        Reply("Read it."),
    )
    async with model(script, monkeypatch) as server, running_worker(db_url):
        run_id = await start_run(client, "capped", "read a lot")
        state = await wait_for(lambda: settled(client, run_id, "completed"), what="completed")
        second = server.requests[1]
    result = state.results["b1"]
    assert result.truncated_from == 300_000
    assert len(result.content.encode()) <= 4096
    marker = "[Toren cut this tool result at 4096 bytes: it was 300000 bytes]"
    assert result.content.endswith(marker)
    sent = second["messages"][-1]["content"][0]["content"]
    assert (sent if isinstance(sent, str) else sent[0]["text"]).endswith(marker)


async def test_a_sleep_past_30_days_goes_back_to_the_model_as_an_error(
    client: Client, db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    script = by_position(
        Reply([ToolCall(id="s1", name="sleep", arguments={"seconds": 1e300})]),
        Reply("I will not wait, then."),
    )
    async with model(script, monkeypatch) as server, running_worker(db_url):
        run_id = await start_run(client, "hostile", "wait a while")
        state = await wait_for(lambda: settled(client, run_id, "completed"), what="completed")
        assert len(server.requests) == 2
    result = state.results["s1"]
    assert result.is_error
    assert "less than or equal to 2592000" in result.content


async def test_a_human_message_over_the_cap_is_refused_and_one_with_a_nul_is_kept(
    client: Client, db_url: str
) -> None:
    run_id = await start_run(client, "payer", "hello")
    with pytest.raises(MessageTooLarge, match="65536"):
        await say(client, run_id, "m" * 70_000, by=person("alice"))
    with pytest.raises(MessageTooLarge):
        await start_run(client, "payer", "i" * 70_000)
    await say(client, run_id, "a\x00b", by=person("alice"))
    bodies = await client.pool.fetch("SELECT body FROM toren.mailbox WHERE kind = 'run.say'")
    assert [b["body"]["text"] for b in bodies] == ["a\x00b"]


# --- our own failures end the run visibly ---------------------------------------------------


async def test_an_approval_predicate_that_raises_fails_the_run_visibly_and_retry_resumes_it(
    client: Client, db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    script = by_position(
        Reply([ToolCall(id="g1", name="guarded", arguments={"what": "the thing"})]),
        Reply("Done."),
    )
    monkeypatch.setattr(hostile_app, "predicate_broken", True)
    async with model(script, monkeypatch) as server, running_worker(db_url):
        run_id = await start_run(client, "policy", "do the thing")
        state = await wait_for(
            lambda: settled(client, run_id, "failed"), timeout=30, what="failed, visibly"
        )
        assert state.error_class == "internal"
        assert "the approval policy service is down" in (state.error or "")
        assert await agree(client, run_id) == ("failed", "internal")
        assert hostile_app.ledger == []
        # The model step asks the predicate too, to ask in its own commit (actors/runs/ahead.py):
        # raising there, it left the call to its own step and committed the call it paid for.
        assert len(server.requests) == 1
        assert [c.step for c in state.calls] == [1]
        monkeypatch.setattr(hostile_app, "predicate_broken", False)  # the cause is fixed
        await retry(client, run_id, by=person("ops"))
        await wait_for(lambda: settled(client, run_id, "completed"), what="completed on retry")
    assert [e["call_id"] for e in hostile_app.ledger] == ["g1"]
    assert await agree(client, run_id) == ("completed", None)


async def test_a_child_run_failed_by_a_dead_letter_tells_its_parent_which_goes_on(
    client: Client, db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    def respond(request: dict[str, Any], n: int) -> Reply:
        caller = any(t["name"] == "call_policy" for t in request.get("tools", ()))
        position = sum(1 for m in request["messages"] if m["role"] == "assistant")
        if caller:
            ask = ToolCall(id="k1", name="call_policy", arguments={"input": "do the thing"})
            return Reply([ask]) if position == 0 else Reply("The child could not.")
        guarded = ToolCall(id="g1", name="guarded", arguments={"what": "the thing"})
        return Reply([guarded]) if position == 0 else Reply("Done.")

    monkeypatch.setattr(hostile_app, "predicate_broken", True)
    async with model(respond, monkeypatch), running_worker(db_url):
        run_id = await start_run(client, "policy_caller", "ask the child")
        # The child's step raises past its retries: dead-lettered, the child fails (internal)
        # in the same transaction, and tells its parent, which takes the failure as the call's
        # result and answers.
        state = await wait_for(
            lambda: settled(client, run_id, "completed"), timeout=40, what="the parent completed"
        )
    [child] = state.finished.values()
    assert child.status == "failed"
    assert state.output == "The child could not."
    assert hostile_app.ledger == []


async def test_a_refused_write_fails_the_run_visibly_without_running_the_effect_again(
    client: Client, db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The database refuses to record this tool's result (a trigger stands in for any refusal
    # that is not the connection's fault).
    await client.pool.execute(
        """
        CREATE FUNCTION refuse_results() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN RAISE EXCEPTION 'no results today'; END $$;
        CREATE TRIGGER refuse_results BEFORE INSERT ON toren.journal
        FOR EACH ROW WHEN (NEW.type = 'tool.result') EXECUTE FUNCTION refuse_results();
        """
    )
    script = by_position(
        Reply([ToolCall(id="h1", name="hostile_result", arguments={"x": "once"})]),
        Reply("Done."),
    )
    async with model(script, monkeypatch) as server, running_worker(db_url):
        run_id = await start_run(client, "hostile", "do it")
        state = await wait_for(
            lambda: settled(client, run_id, "failed"), timeout=30, what="failed, visibly"
        )
        assert len(server.requests) == 1
    assert state.error_class == "internal"
    assert "no results today" in (state.error or "")
    assert len(hostile_app.ledger) == 1  # the unkeyed external effect was not made again
    assert await agree(client, run_id) == ("failed", "internal")


async def test_a_run_the_kernel_gives_up_on_fails_with_class_crashloop_and_can_be_retried(
    client: Client, db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from toren.actors.runs import RunActor

    script = by_position(
        Reply([ToolCall(id="p1", name="pay", arguments={"to": "alice", "amount": 1})]),
        Reply("Done."),
    )
    broken: set[str] = set()
    original = RunActor.apply

    def apply(self: RunActor, state: RunState, event: Any) -> RunState:
        if self.actor_id in broken:
            raise RuntimeError("this version cannot read its own journal")
        return original(self, state, event)

    monkeypatch.setattr(RunActor, "apply", apply)
    async with model(script, monkeypatch), running_worker(db_url, actor_restart_intensity=1):
        run_id = await start_run(client, "payer", "pay alice")
        await wait_for(lambda: waits_for(client, run_id, "p1"), what="asks about p1")
        broken.add(run_id)  # a bad deploy: the run cannot be rebuilt any more
        await decide(client, run_id, call_id="p1", approved=True, by=person("alice"), wait=None)
        state = await wait_for(
            lambda: settled(client, run_id, "failed"), timeout=30, what="given up on"
        )
        assert state.error_class == "crashloop"
        assert "cannot read its own journal" in (state.error or "")
        assert await agree(client, run_id) == ("failed", "crashloop")
        broken.clear()  # fixed
        await retry(client, run_id, by=person("ops"))
        # The decision sent before the crash loop is refused now (the run had failed); the
        # retried run asks again, and waits.
        await wait_for(lambda: waits_for(client, run_id, "p1"), what="asks again")
        assert await agree(client, run_id) == ("parked", None)
        await decide(client, run_id, call_id="p1", approved=True, by=person("alice"))
        await wait_for(lambda: settled(client, run_id, "completed"), what="completed")
    assert [e["call_id"] for e in hostile_app.ledger] == ["p1"]


async def test_tool_turns_that_all_fail_count_toward_the_attempts_cap(
    client: Client, db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    def confused(request: dict[str, Any], n: int) -> Reply:
        return Reply([ToolCall(id=f"u{n}", name="no_such_tool", arguments={})])

    async with model(confused, monkeypatch) as server, running_worker(db_url):
        run_id = await start_run(client, "confused", "loop")  # max_attempts = 3
        state = await wait_for(lambda: settled(client, run_id, "failed"), what="failed")
        assert len(server.requests) == 3
    assert state.error_class == "tool"
    assert "3 model turns in a row" in (state.error or "")
    assert receipt(state).calls_made == 3


# --- typed arguments, keys, starts, resumes -------------------------------------------------


async def test_typed_arguments_reach_the_tool_identically_live_and_after_a_replay(
    client: Client, db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    arguments = {
        "when": "2026-12-01T10:00:00+00:00",
        "amount": "10.10",
        "color": "red",
        "ident": "7c1f4f7e-3b0a-4f59-9a55-2f1c9b1d8e42",
        "pair": [1, 2],
        "inner": {"name": "n", "tags": ["a", "b"]},
    }
    script = by_position(
        Reply([ToolCall(id="b1", name="book", arguments=arguments)]),
        Reply([ToolCall(id="p1", name="pay", arguments={"to": "alice", "amount": 1})]),
        Reply([ToolCall(id="b2", name="book", arguments=arguments)]),  # the same call again
        Reply("Booked twice."),
    )
    async with model(script, monkeypatch), running_worker(db_url):
        run_id = await start_run(client, "booker", "book twice")
        await wait_for(lambda: waits_for(client, run_id, "p1"), what="parked on p1")

        async def passivated() -> bool:
            return (await client.actor(run_id))["owner"] is None

        await wait_for(passivated, what="left the worker: the rest is a replay")
        await decide(client, run_id, call_id="p1", approved=True, by=person("alice"))
        state = await wait_for(lambda: settled(client, run_id, "completed"), what="completed")
    booked = [e for e in hostile_app.ledger if e["tool"] == "book"]
    expected = {
        "when": "datetime",
        "amount": "Decimal",
        "color": "Color",
        "ident": "UUID",
        "pair": "tuple",
        "inner": "Inner",
    }
    assert [e["types"] for e in booked] == [expected, expected]
    assert [e["amount"] for e in booked] == [Decimal("10.10"), Decimal("10.10")]
    # Two identical calls are two effects: the second (after the replay) has its own key.
    assert booked[0]["key"] != booked[1]["key"]
    assert [state.intents[c].idempotency_key for c in ("b1", "b2")] == [
        booked[0]["key"],
        booked[1]["key"],
    ]


async def test_concurrent_starts_with_one_key_and_different_inputs_start_one_run(
    client: Client,
) -> None:
    async def start(text: str, key: str, outcomes: list[str]) -> None:
        try:
            outcomes.append(await start_run(client, "payer", text, idempotency_key=key))
        except IdempotencyConflict:
            outcomes.append("conflict")

    for attempt in range(25):
        outcomes: list[str] = []
        async with anyio.create_task_group() as tg:
            tg.start_soon(start, "first input", f"key-{attempt}", outcomes)
            tg.start_soon(start, "second input", f"key-{attempt}", outcomes)
        assert sorted(o == "conflict" for o in outcomes) == [False, True], outcomes
    starts = await client.pool.fetch("SELECT body FROM toren.mailbox WHERE kind = 'run.start'")
    assert len(starts) == 25


# --- found by the review ------------------------------------------------------------------


async def test_a_decision_for_a_voided_call_never_fits_a_new_call_that_reuses_its_id(
    client: Client, db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import toren.actors.runs.request

    answers = [
        Reply([ToolCall(id="call_1", name="pay", arguments={"to": "alice", "amount": 1})]),
        # After the invalidation, a model (or gateway) that reuses ids asks for another payment.
        Reply([ToolCall(id="call_1", name="pay", arguments={"to": "mallory", "amount": 9999})]),
    ]

    def script(request: dict[str, Any], n: int) -> Reply:
        return answers[min(n, 2) - 1]

    async with model(script, monkeypatch):
        async with running_worker(db_url):
            run_id = await start_run(client, "payer", "pay alice")
            await wait_for(lambda: waits_for(client, run_id, "call_1"), what="asks about alice")
        original = toren.actors.runs.request.build_request

        def redeployed(agent: Any, messages: Any, callees: Any = None) -> Any:
            # a new system prompt: step 1 is void
            return attrs.evolve(original(agent, messages, callees), system="Pay with care.")

        monkeypatch.setattr(toren.actors.runs.request, "build_request", redeployed)
        # The approver's page still shows alice's payment, call_1.
        await decide(
            client, run_id, call_id="call_1", approved=True, by=person("approver"), wait=None
        )
        async with running_worker(db_url):

            async def asks_again() -> list[str]:
                state = await read_run(client, run_id)
                return [c.id for c in waiting_on(state)] if state.voided else []

            [new_id] = await wait_for(asks_again, what="invalidated, then asks about mallory")
            assert new_id != "call_1"  # the voided call's id is not given to the new call
            again = await decide(
                client, run_id, call_id="call_1", approved=True, by=person("approver")
            )
    assert again is not None
    assert again.outcome == "not_waiting"
    assert hostile_app.ledger == []  # neither payment was made
    state = await read_run(client, run_id)
    assert state.decisions == {}


async def test_a_denial_holds_when_the_approval_predicate_changes_its_mind(
    client: Client, db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    script = by_position(
        Reply([ToolCall(id="t1", name="transfer", arguments={"to": "mallory", "amount": 5000})]),
        Reply("Not transferred."),
    )
    monkeypatch.setattr(hostile_app, "policy_says_ask", True)
    async with model(script, monkeypatch), running_worker(db_url):
        run_id = await start_run(client, "banker", "transfer")
        await wait_for(lambda: waits_for(client, run_id, "t1"), what="asks about t1")
        monkeypatch.setattr(hostile_app, "policy_says_ask", False)  # the policy changed
        denied = await decide(client, run_id, call_id="t1", approved=False, by=person("boss"))
        assert denied is not None
        assert denied.outcome == "applied"
        state = await wait_for(lambda: settled(client, run_id, "completed"), what="completed")
    assert hostile_app.ledger == []
    assert state.results["t1"].denied


async def test_an_answer_the_sdk_cannot_read_is_counted_once_and_not_asked_again(
    client: Client, db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from aiohttp import web

    from toren.testing import ReceivedRequest

    class Garbling(AnthropicServer):
        """Answers the first call with a 5,000-digit integer in a tool's input: Python's JSON
        reader refuses it (the int-string limit) after the provider answered, so the call was
        paid for."""

        async def render_reply(
            self, request: web.Request, received: ReceivedRequest, step: Reply
        ) -> web.StreamResponse:
            if received.n > 1:
                return await super().render_reply(request, received, step)
            body = (
                b'{"id":"msg_1","type":"message","role":"assistant","model":"claude-sonnet-4-6",'
                b'"content":[{"type":"tool_use","id":"x1","name":"pay","input":{"to":"a",'
                b'"amount":' + b"9" * 5000 + b'}}],"stop_reason":"tool_use",'
                b'"stop_sequence":null,"usage":{"input_tokens":10,"output_tokens":5}}'
            )
            return web.Response(body=body, content_type="application/json")

    load_app("tests.hostile_app")
    hostile_app.ledger.clear()
    async with Garbling(by_position(Reply("Fine now."))) as server:
        for name, value in server.env().items():
            monkeypatch.setenv(name, value)
        async with running_worker(db_url):
            run_id = await start_run(client, "payer", "pay")
            state = await wait_for(lambda: settled(client, run_id, "failed"), what="failed")
            assert len(server.requests) == 1  # not asked again by itself
            assert state.error_class == "provider"
            r = receipt(state)
            assert (r.calls_made, r.unpriced_calls) == (1, 1)
            await retry(client, run_id, by=person("ops"))  # a person decides to pay for a try
            state = await wait_for(lambda: settled(client, run_id, "completed"), what="completed")
            assert len(server.requests) == 2
    assert receipt(state).calls_made == 2
    assert state.output == "Fine now."


@pytest.mark.parametrize("how", ["cancel", "unshowable"])
async def test_a_tool_that_leaks_a_cancellation_or_returns_the_unshowable_runs_once(
    client: Client, db_url: str, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    script = by_position(
        Reply([ToolCall(id="m1", name="misbehave", arguments={"how": how})]),
        Reply("Moving on."),
    )
    async with model(script, monkeypatch), running_worker(db_url):
        run_id = await start_run(client, "misfit", how)
        state = await wait_for(lambda: settled(client, run_id, "completed"), what="completed")
    assert len(hostile_app.ledger) == 1  # the external, unkeyed effect was not made again
    result = state.results["m1"]
    if how == "cancel":
        assert result.is_error
        assert "misbehave failed" in result.content
    else:
        assert "cannot be shown" in result.content


async def test_the_mcp_server_shows_a_run_whose_text_holds_lone_surrogates(
    client: Client, db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from toren._surfaces.mcp_server import build

    script = by_position(Reply("out \ud800 here"))
    async with model(script, monkeypatch), running_worker(db_url):
        run_id = await start_run(client, "hostile", "in \udc80")
        await wait_for(lambda: settled(client, run_id, "completed"), what="completed")
    server = build(client)
    shown = await server.call_tool("read_run", {"run_id": run_id})
    assert not shown.is_error, shown
    assert json.loads(shown.content[0].text)["output"] == "out \\ud800 here"  # escaped
    listed = await server.call_tool("list_runs", {})
    assert not listed.is_error, listed
