"""Honest receipts after a crash: the model call a step makes is announced in the commit before
it, and a call lost in flight (its worker stopped with the request at the provider) is counted
on the receipt and shown on the timeline, so that the calls made and lost are what the provider
received."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from decimal import Decimal
from pathlib import Path
from typing import Any

import anyio
import attrs
import pytest

from tests.conftest import WorkerFactory, running_worker, wait_for
from tests.test_cli import toren as cli
from toren import Client
from toren._agent.app import load_app
from toren._agent.model import ToolCall
from toren._cli.timeline import describe, record
from toren._core.codec import decode
from toren.runs import (
    ChildFinished,
    ContextCompacted,
    ModelCalling,
    ModelLost,
    RunStarted,
    RunState,
    fold,
    read_run,
    receipt,
    start_run,
)
from toren.testing import AnthropicServer, Reply

pytestmark = pytest.mark.anyio

STEPS = 4  # three tickets, then the answer


def _by_position(request: dict[str, Any], n: int) -> Reply:
    """Answer by conversation position, so that a call made again gets the same answer."""
    position = sum(1 for m in request["messages"] if m["role"] == "assistant")
    if position < STEPS - 1:
        return Reply([ToolCall(id=f"t{position}", name="create_ticket", arguments={"title": "x"})])
    return Reply("Three tickets opened.")


@contextlib.asynccontextmanager
async def _server(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> AsyncIterator[AnthropicServer]:
    monkeypatch.setenv("TOREN_TEST_LEDGER", str(tmp_path / "ledger"))
    async with AnthropicServer(_by_position) as server:
        for name, value in server.env().items():
            monkeypatch.setenv(name, value)
        yield server


async def _status(client: Client, run_id: str, status: str) -> bool:
    return (await read_run(client, run_id)).status == status


async def _announced_before(client: Client, run_id: str, step: int) -> bool:
    """The call for ``step`` is announced and not recorded, and its announcement committed with
    another event (the step before it's): no commit of its own."""
    rows = await client.pool.fetch(
        "SELECT type, data, xmin::text AS tx FROM toren.journal WHERE actor_id = $1 ORDER BY seq",
        run_id,
    )
    calling = [r for r in rows if r["type"] == "model.calling" and r["data"]["step"] == step]
    called = [r for r in rows if r["type"] == "model.called" and r["data"]["step"] == step]
    if len(calling) != 1 or called:
        return False
    shared = [r for r in rows if r["tx"] == calling[0]["tx"] and r["type"] != "model.calling"]
    return bool(shared)


def _positions(server: AnthropicServer) -> list[int]:
    return sorted(
        sum(1 for m in r["messages"] if m["role"] == "assistant") for r in server.requests
    )


async def _check_lost_once(client: Client, run_id: str, server: AnthropicServer) -> None:
    """What a run that lost its third call in flight once shows, on every surface."""
    assert _positions(server) == [0, 1, 2, 2, 3]  # the lost call was made again, once
    state = await read_run(client, run_id)
    assert state.output == "Three tickets opened."
    r = receipt(state)
    assert (r.calls_made, r.calls_lost) == (STEPS, 1)
    assert r.calls_made + r.calls_lost == len(server.requests)
    assert r.usd_lost_estimated > 0  # the model is priced: the estimate is a price
    assert r.usd_paid == sum((Decimal(c.cost_usd or 0) for c in state.calls), Decimal(0))
    journal = await client.journal(run_id)
    [lost] = [e for e in journal if e.type == "model.lost"]
    assert (lost.data["step"], lost.data["count"]) == (3, 1)
    assert Decimal(lost.data["cost_usd"]) == r.usd_lost_estimated
    # Recorded with the call made again, before it.
    [again] = [e for e in journal if e.type == "model.called" and e.data["step"] == 3]
    assert lost.seq < again.seq
    assert "lost in flight once" in describe(lost.type, lost.data)
    shown = record(run_id, state)["receipt"]
    assert (shown["calls_lost"], shown["usd_lost_estimated"]) == (1, str(r.usd_lost_estimated))


@pytest.mark.processes
async def test_a_call_lost_in_flight_at_a_sigkill_is_counted_on_the_receipt(
    client: Client,
    db_url: str,
    workers: WorkerFactory,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    request: pytest.FixtureRequest,
) -> None:
    async with _server(monkeypatch, tmp_path) as server:
        held = server.hold(3)  # the third call: two calls and two tickets are done
        first = workers(app="tests.run_app")
        run_id = await start_run(client, "support", "Open three tickets.")
        with anyio.fail_after(30):
            await held.arrived.wait()
        # The call at the provider was announced by the commit before it.
        assert await _announced_before(client, run_id, 3)
        first.kill()
        held.release()
        workers(app="tests.run_app")
        await wait_for(lambda: _status(client, run_id, "completed"), timeout=30, what="completed")
        await _check_lost_once(client, run_id, server)
    if request.config.getoption("--record-journals", default=False):
        from tests.test_runs import _record_fixture

        _record_fixture(await client.journal(run_id), "run_v1_lost.json")
    # The CLI's timeline and receipt say so.
    shown = await anyio.to_thread.run_sync(lambda: cli("jobs", "show", run_id, db_url=db_url))
    assert shown.returncode == 0, shown.stderr
    assert "model call 3 (anthropic/claude-sonnet-4-6) lost in flight once" in shown.stdout
    r = receipt(await read_run(client, run_id))
    assert f"receipt: {STEPS} calls made" in shown.stdout
    assert f"1 lost in flight (about ${r.usd_lost_estimated} estimated" in shown.stdout
    as_json = await anyio.to_thread.run_sync(
        lambda: cli("jobs", "show", run_id, "--json", db_url=db_url)
    )
    assert json.loads(as_json.stdout)["calls_lost"] == 1
    # So do the API's run (its receipt) and events.
    from tests.test_api import _token, _uuid, api, session

    async with api(db_url) as base, session(await _token(client)) as http:
        async with http.get(f"{base}/runs/{_uuid(run_id)}") as resp:
            assert resp.status == 200, await resp.text()
            shown_receipt = (await resp.json())["receipt"]
        async with http.get(f"{base}/runs/{_uuid(run_id)}/events") as resp:
            events = (await resp.json())["events"]
    assert (shown_receipt["calls_made"], shown_receipt["calls_lost"]) == (STEPS, 1)
    assert shown_receipt["usd_lost_estimated"] == str(r.usd_lost_estimated)
    assert shown_receipt["usd_total"] == str(r.usd_paid)  # the estimate is not paid
    [lost] = [e for e in events if e["type"] == "model.lost"]
    assert (lost["data"]["step"], lost["data"]["count"]) == (3, 1)


@pytest.mark.processes
async def test_a_call_lost_when_the_workers_sessions_are_terminated_is_counted(
    client: Client,
    workers: WorkerFactory,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Its database sessions cut while the call is at the provider, the worker stops the run
    before the answer can be recorded; it (or another) makes the call again, and counts the
    first as lost."""
    async with _server(monkeypatch, tmp_path) as server:
        held = server.hold(3)
        victim = workers(app="tests.run_app")
        run_id = await start_run(client, "support", "Open three tickets.")
        with anyio.fail_after(30):
            await held.arrived.wait()
        assert await _announced_before(client, run_id, 3)
        offset = len(victim.log())
        ended = await client.pool.fetchval(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
            "WHERE application_name LIKE 'toren-worker%' AND datname = current_database()"
        )
        assert ended

        async def noticed() -> bool:
            return "lost its lock connection" in victim.log()[offset:]

        await wait_for(noticed, timeout=15, what="the worker noticed the loss")
        held.release()  # the answer comes to a step that was stopped: it is never recorded
        await wait_for(lambda: _status(client, run_id, "completed"), timeout=30, what="completed")
        await _check_lost_once(client, run_id, server)


async def test_a_run_without_a_crash_announces_each_call_and_loses_none(
    client: Client, db_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    load_app("tests.run_app")
    async with _server(monkeypatch, tmp_path) as server, running_worker(db_url):
        run_id = await start_run(client, "support", "Open three tickets.")
        await wait_for(lambda: _status(client, run_id, "completed"), what="completed")
    state = await read_run(client, run_id)
    r = receipt(state)
    assert (r.calls_made, r.calls_lost, r.usd_lost_estimated) == (STEPS, 0, Decimal(0))
    assert r.calls_made == len(server.requests)
    rows = await client.pool.fetch(
        "SELECT seq, type, data, xmin::text AS tx FROM toren.journal WHERE actor_id = $1 "
        "ORDER BY seq",
        run_id,
    )
    assert not [row for row in rows if row["type"] == "model.lost"]
    announced = [row for row in rows if row["type"] == "model.calling"]
    called = [row for row in rows if row["type"] == "model.called"]
    assert [a["data"]["step"] for a in announced] == [1, 2, 3, 4]
    for a, c in zip(announced, called, strict=True):
        assert a["seq"] < c["seq"]
        assert a["tx"] != c["tx"]  # before the step that makes the call, not with it
        # In a commit that holds the step before (no transaction of its own).
        assert any(row["tx"] == a["tx"] and row["type"] != "model.calling" for row in rows)
        # The estimate is of the right size: the request as the provider counted it.
        actual = c["data"]["response"]["usage"]["input_tokens"]
        assert actual / 2 <= a["data"]["input_tokens"] <= actual * 2
        assert Decimal(a["data"]["cost_usd"]) > 0
    # The receipt is the one the journal gives without the announcements.
    without = RunState()
    for entry in await client.journal(run_id):
        if entry.type != "model.calling":
            without = fold(without, decode(entry.type, entry.data))
    assert receipt(without) == r


def _calling(step: int) -> ModelCalling:
    return ModelCalling(step=step, model="m", input_tokens=10, cost_usd="0.5")


def test_a_journal_without_announcements_folds_with_nothing_lost() -> None:
    """Journals of earlier versions (no ``model.calling``) fold as before: nothing lost."""
    fixture = Path(__file__).parent / "fixtures" / "journals" / "run_v1.json"
    state = RunState()
    for entry in json.loads(fixture.read_text()):
        state = fold(state, decode(entry["type"], entry["data"]))
    r = receipt(state)
    assert (state.calling, r.calls_lost, r.usd_lost_estimated) == (None, 0, Decimal(0))
    assert r.calls_made == 3


def test_lost_calls_and_their_estimate_add_up_on_the_receipt() -> None:
    state = fold(RunState(), RunStarted(agent="a", input="go"))
    state = fold(state, _calling(1))
    assert state.calling == _calling(1)
    state = fold(state, ModelLost(step=1, model="m", count=2, input_tokens=10, cost_usd="1.0"))
    state = fold(state, ModelLost(step=1, model="m", count=1, input_tokens=10, cost_usd=None))
    assert state.calling == _calling(1)  # still unanswered: the call is made again
    r = receipt(state)
    assert (r.calls_lost, r.usd_lost_estimated, r.calls_made) == (3, Decimal("1.0"), 0)


def test_a_summary_call_answers_the_announcement_and_a_soft_compaction_does_not() -> None:
    from toren._agent.model import ModelResponse, Text, Usage

    state = fold(fold(RunState(), RunStarted(agent="a", input="go")), _calling(2))
    soft = ContextCompacted(
        tier="soft",
        reason="threshold",
        after_calls=1,
        base=0,
        prefix=(),
        tokens_before=9,
        tokens_after=5,
    )
    assert fold(state, soft).calling == _calling(2)
    summary = ModelResponse(
        content=(Text(text="s"),),
        stop_reason="end",
        usage=Usage(input_tokens=1, output_tokens=1),
        model="m",
    )
    hard = attrs.evolve(soft, tier="hard", model="m", summary=summary, cost_usd="0.1")
    assert fold(state, hard).calling is None


def test_a_childs_lost_calls_count_in_its_parents_receipt() -> None:
    """A child run's calls lost in flight reach its parent with its end (and a child's end
    recorded by an earlier version, without them, counts none)."""
    state = fold(RunState(), RunStarted(agent="a", input="go"))
    ended = ChildFinished(
        call_id="c1",
        run_id="run/x",
        agent="b",
        status="completed",
        usd_paid="0.2",
        calls_made=2,
        lost_calls=1,
        lost_usd="0.05",
    )
    state = fold(state, ended)
    old = decode(
        "child.finished",
        {
            "call_id": "c2",
            "run_id": "run/y",
            "agent": "b",
            "status": "completed",
            "usd_paid": "0.1",
            "calls_made": 1,
        },
    )
    state = fold(state, old)
    r = receipt(state)
    assert (r.child_calls_made, r.child_calls_lost) == (3, 1)
    assert r.child_usd_lost_estimated == Decimal("0.05")
    assert (r.calls_lost, r.usd_total) == (0, Decimal("0.3"))  # the estimate is not paid


async def _killed_mid_call(
    client: Client, workers: WorkerFactory, server: AnthropicServer
) -> tuple[str, Any]:
    """A run whose worker was SIGKILLed with its third call at the provider (then answered)."""
    held = server.hold(3)
    victim = workers(app="tests.run_app")
    run_id = await start_run(client, "support", "Open three tickets.")
    with anyio.fail_after(30):
        await held.arrived.wait()
    assert await _announced_before(client, run_id, 3)
    victim.kill()
    return run_id, held


@pytest.mark.processes
async def test_a_run_cancelled_after_its_call_was_lost_in_flight_counts_it(
    client: Client, workers: WorkerFactory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The cancel (system lane) is handled before the step that was in flight is claimed
    again: the run ends, and the call its dead worker sent is still counted lost."""
    from toren.runs import cancel

    async with _server(monkeypatch, tmp_path) as server:
        run_id, held = await _killed_mid_call(client, workers, server)
        await cancel(client, run_id, reason="enough")
        held.release()
        workers(app="tests.run_app")
        await wait_for(lambda: _status(client, run_id, "cancelled"), timeout=30, what="cancelled")

        async def consumed() -> bool:
            left = await client.pool.fetchval(
                "SELECT count(*) FROM toren.mailbox WHERE actor_id = $1", run_id
            )
            return left == 0

        await wait_for(consumed, timeout=30, what="the step in flight handled again")
        state = await read_run(client, run_id)
        assert state.error_class == "cancelled"
        r = receipt(state)
        assert (r.calls_made, r.calls_lost) == (2, 1)
        assert r.calls_made + r.calls_lost == len(server.requests)


@pytest.mark.processes
async def test_a_step_dead_lettered_after_many_deliveries_counts_its_lost_calls(
    client: Client, workers: WorkerFactory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A step whose worker keeps dying mid-call is dead-lettered past max_deliveries: each
    earlier claim may have sent the request, and the receipt counts them."""
    async with _server(monkeypatch, tmp_path) as server:
        run_id, held = await _killed_mid_call(client, workers, server)
        # As if 24 more workers had died in that step (each claim raises the count).
        await client.pool.execute(
            "UPDATE toren.mailbox SET deliveries = 25 WHERE actor_id = $1", run_id
        )
        held.release()
        workers(app="tests.run_app")
        await wait_for(lambda: _status(client, run_id, "failed"), timeout=30, what="failed")
        state = await read_run(client, run_id)
        assert state.error_class == "internal"
        r = receipt(state)
        assert (r.calls_made, r.calls_lost) == (2, 25)
        assert r.usd_lost_estimated > 0
        journal = await client.journal(run_id)
        [lost] = [e for e in journal if e.type == "model.lost"]
        assert (lost.data["step"], lost.data["count"]) == (3, 25)


def test_a_hostile_lost_record_never_makes_the_receipt_negative() -> None:
    state = fold(RunState(), RunStarted(agent="a", input="go"))
    for cost in ("-1", "NaN", "-Infinity", "junk"):
        state = fold(state, ModelLost(step=1, model="m", count=-3, input_tokens=-1, cost_usd=cost))
    ended = ChildFinished(
        call_id="c1",
        run_id="run/x",
        agent="b",
        status="completed",
        usd_paid="0",
        calls_made=0,
        lost_calls=-2,
        lost_usd="-5",
    )
    r = receipt(fold(state, ended))
    assert (r.calls_lost, r.usd_lost_estimated) == (0, Decimal(0))
    assert (r.child_calls_lost, r.child_usd_lost_estimated) == (0, Decimal(0))


@pytest.mark.processes
async def test_a_hostile_announcement_in_the_journal_never_stops_the_run(
    client: Client, workers: WorkerFactory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An announcement whose estimated cost is not a number (a journal written by hand, or by
    something else) counts the call lost, unpriced: the run goes on."""
    async with _server(monkeypatch, tmp_path) as server:
        run_id, held = await _killed_mid_call(client, workers, server)
        await client.pool.execute(
            "UPDATE toren.journal SET data = jsonb_set(data, '{cost_usd}', '\"junk\"') "
            "WHERE actor_id = $1 AND type = 'model.calling' AND (data->>'step')::int = 3",
            run_id,
        )
        held.release()
        workers(app="tests.run_app")
        await wait_for(lambda: _status(client, run_id, "completed"), timeout=30, what="completed")
        r = receipt(await read_run(client, run_id))
        assert (r.calls_made, r.calls_lost, r.usd_lost_estimated) == (STEPS, 1, Decimal(0))
