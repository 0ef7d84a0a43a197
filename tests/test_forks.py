"""Forks of a run from a step: the prefix served from the fork's own journal (nothing before the
step asked of the model again), the rest run live (tool calls under new keys, approvals asked
again), edited human messages, forks of forks, of ended runs, and bad requests that store
nothing. The source's journal is never touched."""

from __future__ import annotations

from decimal import Decimal
from typing import Any

import pytest

import toren.providers.anthropic  # noqa: F401  (the SDK import is paid here, not in a step)
from tests import run_app
from tests.conftest import running_worker, wait_for
from tests.steps import settled
from toren import Client, UnknownActor
from toren._agent.app import load_app
from toren._agent.model import ToolCall
from toren.runs import (
    InvalidFork,
    cancel,
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
    assert one.calls[:3] == src.calls[:3] and two.calls[:5] == one.calls[:5]
    assert one.forked is not None and (one.forked.source, one.forked.step) == (source, 4)
    assert two.forked is not None and (two.forked.source, two.forked.step) == (fork, 6)
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


async def test_failed_and_cancelled_runs_fork_and_approvals_are_asked_again(
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
            await cancel(client, asking)
            assert await _ended(client, asking) == "cancelled"
            again = await fork_run(client, asking, at=1)

            async def asks() -> list[ToolCall]:
                return waiting_on(await read_run(client, again))

            [call] = await wait_for(asks, what="the fork asking approval again")
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
