"""Forks of a run from a step: the prefix served from the fork's own journal (nothing before the
step asked of the model again), the rest run live (tool calls under new keys, approvals asked
again), edited human messages, forks of forks, of ended runs, and bad requests that store
nothing. The source's journal is never touched."""

from __future__ import annotations

from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest

import toren.providers.anthropic  # noqa: F401  (the SDK import is paid here, not in a step)
from tests import run_app
from tests.conftest import running_worker, wait_for
from tests.sandbox_support import docker_fixture  # noqa: F401  (the fixture)
from tests.steps import bash, results, settled, tool
from toren import Client, UnknownActor
from toren._agent.app import load_app
from toren._agent.model import ToolCall
from toren.actors.sandboxes.docker import Docker
from toren.runs import (
    InvalidFork,
    RunForked,
    RunStarted,
    RunState,
    cancel,
    fold,
    fork_run,
    read_run,
    receipt,
    run_status,
    say,
    start_run,
    waiting_on,
)
from toren.testing import AnthropicServer, Fail, Reply

pytestmark = pytest.mark.anyio

CALLS = 10


def _turn(body: dict[str, Any]) -> int:
    """How many answers of the model the request carries (its step, less one)."""
    return sum(1 for m in body["messages"] if m["role"] == "assistant")


def _texts(body: dict[str, Any]) -> list[str]:
    """The text blocks of the request's user turns, in order."""
    out = []
    for m in body["messages"]:
        if m["role"] != "user":
            continue
        content = m["content"] if isinstance(m["content"], list) else [m["content"]]
        out += [b if isinstance(b, str) else b.get("text", "") for b in content]
    return [t for t in out if t]


def ten_calls(body: dict[str, Any], n: int) -> Reply:
    """Nine turns that each open a ticket, then an answer: a run of ten model calls."""
    turn = _turn(body)
    if turn < CALLS - 1:
        ticket = {"title": f"t{turn + 1}"}
        return Reply([ToolCall(id=f"c{turn + 1}", name="create_ticket", arguments=ticket)])
    return Reply("done")


async def _serve(script: Any, monkeypatch: pytest.MonkeyPatch) -> AnthropicServer:
    server = AnthropicServer(script)
    await server.__aenter__()
    for name, value in server.env().items():
        monkeypatch.setenv(name, value)
    return server


async def _ended(client: Client, run_id: str) -> str:
    status: str = await wait_for(lambda: settled(client, run_id), timeout=60, what=run_id)
    return status


async def _rows(client: Client, run_id: str) -> list[tuple[Any, ...]]:
    rows = await client.pool.fetch(
        "SELECT seq, epoch, type, data::text, created_at FROM toren.journal "
        "WHERE actor_id = $1 ORDER BY seq",
        run_id,
    )
    return [tuple(r) for r in rows]


async def test_a_fork_replays_the_steps_before_it_and_runs_the_rest_again(
    client: Client, db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    load_app("tests.run_app")
    run_app.applied.clear()
    server = await _serve(ten_calls, monkeypatch)
    try:
        async with running_worker(db_url):
            source = await start_run(client, "support", "open ten tickets")
            assert await _ended(client, source) == "completed"
            assert len(server.received) == CALLS
            before = await _rows(client, source)

            fork = await fork_run(client, source, at=4)
            assert await _ended(client, fork) == "completed"
            # Steps 4 to 10 asked again, and nothing before step 4.
            asked = server.requests[CALLS:]
            assert [_turn(b) for b in asked] == list(range(3, CALLS))
            # A fork of the fork, from a step the first fork made itself.
            again = await fork_run(client, fork, at=6)
            assert await _ended(client, again) == "completed"
            assert [_turn(b) for b in server.requests[2 * CALLS - 3 :]] == list(range(5, CALLS))
        assert await _rows(client, source) == before  # the source untouched, byte for byte
    finally:
        await server.__aexit__(None, None, None)

    src, one, two = [await read_run(client, r) for r in (source, fork, again)]
    assert [len(s.calls) for s in (src, one, two)] == [CALLS] * 3
    assert one.calls[:3] == src.calls[:3]
    assert two.calls[:5] == one.calls[:5]
    assert one.forked is not None
    assert (one.forked.source, one.forked.step) == (source, 4)
    assert two.forked is not None
    assert (two.forked.source, two.forked.step) == (fork, 6)
    assert (await client.actor(fork))["args"]["forked_from"] == {"run": source, "step": 4}
    # Its receipt: the calls it took by value are not re-paid, and not its spend.
    r = receipt(one)
    assert (r.calls_made, r.calls_inherited) == (CALLS - 3, 3)
    assert r.calls_replayed >= 3
    assert r.usd_inherited == src.kept_cost[2] > 0
    own = sum((Decimal(c.cost_usd or 0) for c in one.calls[3:]), Decimal(0))
    assert r.usd_paid == own < receipt(src).usd_paid
    assert receipt(two).calls_made == CALLS - 5
    # Tool calls after the step ran again, under keys of the fork's own.
    src_keys = {i.idempotency_key for i in src.intents.values()}
    fork_keys = {one.intents[f"c{k}"].idempotency_key for k in range(4, CALLS)}
    assert one.intents["c1"].idempotency_key in src_keys
    assert not fork_keys & src_keys
    assert fork_keys <= set(run_app.applied)


def _chat(body: dict[str, Any], n: int) -> Reply:
    """Asks a name, then greets whoever the last human message names."""
    if _turn(body) == 0:
        return Reply("What is your name?")
    return Reply(f"Hello {_texts(body)[-1]}")


async def test_a_fork_with_an_edited_message_asks_the_model_with_it(
    client: Client, db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    load_app("tests.run_app")
    server = await _serve(_chat, monkeypatch)
    try:
        async with running_worker(db_url):
            source = await start_run(client, "support", "hi")
            assert await _ended(client, source) == "completed"
            await say(client, source, "Alice")

            async def answered() -> bool:
                return len((await read_run(client, source)).calls) == 2

            await wait_for(answered, what="the second answer")
            assert await _ended(client, source) == "completed"
            fork = await fork_run(client, source, at=2, message="Bob")
            assert await _ended(client, fork) == "completed"
            # A new input, from the first step.
            other = await fork_run(client, source, at=1, input="hello there")
            assert await _ended(client, other) == "completed"
    finally:
        await server.__aexit__(None, None, None)
    assert len(server.received) == 4
    edited = server.requests[2]
    assert _texts(edited) == ["hi", "Bob"]
    assert _texts(server.requests[3]) == ["hello there"]
    state = await read_run(client, fork)
    assert state.output == "Hello Bob"
    assert (await read_run(client, source)).output == "Hello Alice"


def _fails_once(body: dict[str, Any], n: int, failed: list[int]) -> Reply | Fail:
    """A ticket, then (the first time only) a refusal the provider will not take back."""
    if _turn(body) == 0:
        return Reply([ToolCall(id="c1", name="create_ticket", arguments={"title": "x"})])
    if not failed:
        failed.append(n)
        return Fail(status=400, message="bad request")
    return Reply("done")


async def test_failed_parked_and_cancelled_runs_fork_and_approvals_are_asked_again(
    client: Client, db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    load_app("tests.run_app")
    failed: list[int] = []
    refund = ToolCall(id="r1", name="refund", arguments={"amount": 500})

    def script(body: dict[str, Any], n: int) -> Reply | Fail:
        if "refund me" in _texts(body)[0]:
            return Reply([refund]) if _turn(body) == 0 else Reply("refunded")
        return _fails_once(body, n, failed)

    server = await _serve(script, monkeypatch)
    try:
        async with running_worker(db_url):
            broken = await start_run(client, "support", "open a ticket")
            assert await _ended(client, broken) == "failed"
            fork = await fork_run(client, broken, at=1)
            assert await _ended(client, fork) == "completed"

            asking = await start_run(client, "support", "refund me")

            async def parked() -> bool:
                return await run_status(client, asking) == "parked"

            await wait_for(parked, what="waiting for approval")
            live = await fork_run(client, asking, at=1)  # a run not ended: what it committed
            await cancel(client, asking)
            assert await _ended(client, asking) == "cancelled"
            again = await fork_run(client, asking, at=1)

            async def asks(run_id: str) -> list[ToolCall]:
                return waiting_on(await read_run(client, run_id))

            for run_id in (live, again):
                [call] = await wait_for(lambda r=run_id: asks(r), what="asking approval again")
                assert call.name == "refund"
    finally:
        await server.__aexit__(None, None, None)
    assert (await read_run(client, fork)).output == "done"
    assert (await read_run(client, broken)).status == "failed"


async def _counts(client: Client) -> tuple[int, int, int]:
    row = await client.pool.fetchrow(
        "SELECT (SELECT count(*) FROM toren.actors) AS a, (SELECT count(*) FROM toren.journal) "
        "AS j, (SELECT count(*) FROM toren.mailbox) AS m"
    )
    return row["a"], row["j"], row["m"]


async def test_bad_forks_are_refused_and_store_nothing(
    client: Client, db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    load_app("tests.run_app")

    def two_calls(body: dict[str, Any], n: int) -> Reply:
        if _turn(body) == 0:
            return Reply([ToolCall(id="c1", name="create_ticket", arguments={"title": "x"})])
        return Reply("done")

    server = await _serve(two_calls, monkeypatch)
    try:
        async with running_worker(db_url):
            source = await start_run(client, "support", "one ticket")
            assert await _ended(client, source) == "completed"
    finally:
        await server.__aexit__(None, None, None)
    await client.spawn("toren.other", "other/1")
    counts = await _counts(client)
    bad: list[tuple[str, dict[str, Any], str]] = [
        (source, {"at": 0}, "numbered from 1"),
        (source, {"at": -3}, "numbered from 1"),
        (source, {"at": 3}, "2 model calls"),
        (source, {"at": "2"}, "a step number"),
        (source, {"at": 1.0}, "a step number"),
        (source, {"at": True}, "a step number"),
        ("other/1", {"at": 1}, "not a run"),
        (source, {"at": 2, "message": "no human message"}, "no human message"),
        (source, {"at": 1, "input": "a\x00b"}, "NUL"),
        (source, {"at": 1, "input": "a\ud800b"}, "lone surrogates"),
        (source, {"at": 1, "input": ""}, "non-empty"),
        (source, {"at": 1, "input": "x" * 65}, "over the cap"),
        (source, {"at": 2, "message": "m", "input": "i"}, "not both"),
    ]
    for run_id, values, says in bad:
        with pytest.raises(InvalidFork, match=says):
            await fork_run(client, run_id, cap=64, **values)
    with pytest.raises(UnknownActor):
        await fork_run(client, "run/00000000-0000-0000-0000-000000000000", at=1)
    assert await _counts(client) == counts


def _workspace(body: dict[str, Any], n: int, asked: dict[int, int]) -> Reply:
    """A file written before the step forked from, one after it; a fork lists what it finds."""
    turn = _turn(body)
    asked[turn] = asked.get(turn, 0) + 1
    if turn == 0:
        return Reply([tool("write_file", "w1", path="early.txt", content="before")])
    if turn == 1:  # the step forked from: the fork looks instead
        again = asked[turn] > 1
        return Reply([tool("list_files", "l1", path=".") if again else bash("true", "b1")])
    if turn == 2 and "early.txt" not in results(body)[-1]:
        return Reply([tool("write_file", "w2", path="late.txt", content="after")])
    return Reply("done")


async def test_a_sandboxed_runs_fork_starts_from_the_workspace_at_its_step(
    client: Client,
    db_url: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    docker: Docker,
) -> None:
    load_app("tests.sandbox_app")
    asked: dict[int, int] = {}
    server = await _serve(lambda body, n: _workspace(body, n, asked), monkeypatch)
    store = str(tmp_path / "workspaces")
    try:
        async with running_worker(db_url, sandboxes=True, workspace_store=store):
            source = await start_run(client, "coder", "write two files")
            assert await _ended(client, source) == "completed"
            fork = await fork_run(client, source, at=2)
            assert await _ended(client, fork) == "completed"
    finally:
        await server.__aexit__(None, None, None)
    src, state = await read_run(client, source), await read_run(client, fork)
    assert "late.txt" in src.results["w2"].content
    listing = state.results["l1"].content
    assert "early.txt" in listing
    assert "late.txt" not in listing
    assert state.forked is not None
    assert state.forked.checkpoint == src.results["w1"].checkpoint
    assert state.sandbox == "sandbox/" + fork.removeprefix("run/")


def test_a_fork_answers_to_no_parent_watcher_or_chat() -> None:
    """A fork of a child run (or of a schedule's, or of a conversation) is a run of its own: its
    end goes to no parent or watcher, its chain starts anew, and no channel reads it as the
    source's conversation (channels bind conversations by run id)."""
    started = RunStarted(
        agent="support",
        input="hi",
        at=1.0,
        parent="run/p",
        parent_call="call-1",
        watcher="schedule/s",
        chain=("support", "support"),
        depth_limit=3,
        budget_usd="1.5",
    )
    state = fold(fold(RunState(), started), RunForked(source="run/c", step=1, calls=0, at=9.0))
    assert (state.parent, state.parent_call, state.watcher, state.chain) == ("", "", "", ())
    assert state.depth_limit is None
    assert state.started_at == 9.0  # its wall clock starts at the fork
    assert state.budget_cap == Decimal("1.5")  # its own budget, for its own spend


def _answer(step: int, text: str, sent: int) -> Any:
    from toren.runs import ModelCalled, ModelResponse, Text, Usage

    response = ModelResponse(
        content=(Text(text=text),),
        stop_reason="end",
        usage=Usage(input_tokens=1, output_tokens=1),
        model="m",
    )
    return ModelCalled(
        step=step,
        digest=f"d{step}",
        model="m",
        response=response,
        cost_usd="0.5",
        latency_ms=1,
        messages_len=sent,
    )


async def test_a_fork_cuts_after_invalidations_and_keeps_messages_its_step_heard(
    client: Client,
) -> None:
    """Step numbers are those of the calls in effect: after ``steps.invalidated``, step 2 is the
    call made again. A human message heard between the step's announcement and its answer was in
    its request: the fork keeps it. Nothing is asked of a worker here."""
    from toren._core.codec import encode
    from toren.runs import (
        MessageReceived,
        ModelCalling,
        RunCompleted,
        StepsInvalidated,
    )

    def calling(step: int) -> Any:
        return ModelCalling(step=step, model="m", input_tokens=1, cost_usd=None)

    said = MessageReceived(text="also this", who="ann", channel="cli", at=3.0)
    journal = [
        RunStarted(agent="support", input="go", at=1.0),
        calling(1),
        _answer(1, "one", 1),
        RunCompleted(output="one", at=2.0),
        MessageReceived(text="more", who="ann", channel="cli", at=2.5),
        calling(2),
        _answer(2, "two, voided", 3),
        StepsInvalidated(from_step=2, reason="changed"),
        calling(2),
        said,
        _answer(2, "two", 3),
        RunCompleted(output="two", at=4.0),
    ]
    source = "run/00000000-0000-0000-0000-0000000000aa"
    await client.spawn("toren.run", source, {"agent": "support"}, route="agent:support")
    await client.pool.executemany(
        "INSERT INTO toren.journal (actor_id, seq, epoch, type, data) VALUES ($1, $2, 1, $3, $4)",
        [(source, seq, *encode(e)) for seq, e in enumerate(journal, 1)],
    )
    with pytest.raises(InvalidFork, match="2 model calls"):
        await fork_run(client, source, at=3)
    fork = await fork_run(client, source, at=2, message="edited")
    state = await read_run(client, fork)
    assert [c.response.content[0].text for c in state.calls] == ["one"]
    assert [c.response.content[0].text for c in state.voided] == []  # the source's, not its
    assert [t for _, t in state.heard] == ["more", "edited"]
    assert state.messages[-1].content[-1].text == "edited"
    assert [m.role for m in state.messages] == ["user", "assistant", "user"]
    assert [b.text for b in state.messages[-1].content] == ["more", "edited"]
    types = [e.type for e in await client.journal(fork)]
    assert types[-3:] == ["steps.invalidated", "message.received", "run.forked"]
    assert types.count("steps.invalidated") == 1
    assert receipt(state).calls_made == 0
    assert receipt(state).usd_inherited == Decimal("0.5")
