"""The schedule actor on a real worker (issue 30): a slot starts one run, on time, with its
key and its input; slots missed while no worker ran are counted or caught up under each
overlap policy; buffered slots start as the runs before them end; a backfill starts a range's
slots once; a failed run pauses a schedule that asks for it; declared schedules are reconciled
at a worker's start without firing twice. The clock is a test's (``ShiftedClock``): no test
waits for a slot of the real one."""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Any

import pytest

from tests.conftest import person, running_worker, wait_for
from tests.run_app import refund
from toren import Agent, Client
from toren._agent.model import ToolCall
from toren.kernel import ShiftedClock, actor_row, actors_of_kind, events
from toren.runs import RUN_KIND, Agents, cancel, read_run
from toren.runs.client import keyed_run_id
from toren.schedules import Schedule, slot_key
from toren.schedules import client as schedules
from toren.schedules.events import Tick, schedule_id, slot_idempotency_key
from toren.testing import AnthropicServer, Fail, Reply

pytestmark = pytest.mark.anyio

MODEL = "anthropic/claude-sonnet-4-6"
HOUR = 3600.0
T0 = datetime(2026, 3, 2, 8, 0, tzinfo=UTC).timestamp()  # a Monday, on the hour
ME = person("ops")


def respond(request: dict[str, Any], n: int) -> Reply | Fail:
    """``park`` in the input: ask for a refund that needs approval (the run waits, in flight);
    ``fail``: a model error that fails the run; anything else: answer and end."""
    first = request["messages"][0]["content"]
    text = first if isinstance(first, str) else first[0]["text"]
    answered = any(m["role"] == "assistant" for m in request["messages"])
    if "park" in text and not answered:
        return Reply([ToolCall(id="r1", name="refund", arguments={"amount": 500})])
    if "fail" in text:
        return Fail(status=400, message="scripted: a request the model refuses")
    return Reply("Done.")


def agents_with(*schedules_: Schedule, name: str = "ticker") -> Agents:
    agents = Agents()
    agents.register([Agent(name=name, model=MODEL, tools=[refund], schedules=list(schedules_))])
    return agents


@pytest.fixture
async def model(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[AnthropicServer]:
    async with AnthropicServer(respond) as server:
        for key, value in server.env().items():
            monkeypatch.setenv(key, value)
        yield server


async def summary(client: Client, name: str) -> dict[str, Any]:
    row = await actor_row(client.pool, schedule_id(name), fields=("summary",))
    assert row is not None
    return row.summary_dict


async def just_before(client: Client, clock: ShiftedClock, name: str, slot: float) -> None:
    """Once ``name`` is declared (at the worker's start, on ``clock``), move ``clock`` to a
    second before ``slot`` and wake the schedule (its timer was set on the clock before)."""
    await wait_for(lambda: summary_of(client, name), what=f"{name} declared")
    clock.advance(slot - 1.0 - clock.now())
    await client.send(schedule_id(name), Tick())


async def runs_of(client: Client, name: str) -> list[Any]:
    rows = await actors_of_kind(
        client.pool, RUN_KIND, fields=("args", "summary"), args={"schedule": name}
    )
    return sorted(rows, key=lambda r: str(r.args_dict["slot"]))  # one step may start several


async def test_a_slot_starts_one_run_on_time_with_its_key_and_input(
    client: Client, db_url: str, model: AnthropicServer
) -> None:
    clock = ShiftedClock.at(T0 - HOUR / 2)
    hourly = Schedule(
        name="hourly", cron="0 * * * *", timezone="Europe/Berlin", input="report for {slot}"
    )
    async with running_worker(db_url, agents_with(hourly), clock=clock):
        await just_before(client, clock, "ticker/hourly", T0)  # 08:59:59 in Berlin
        [run] = await wait_for(lambda: runs_of(client, "ticker/hourly"), what="the slot's run")
        key = slot_key(T0)
        assert run.actor_id == keyed_run_id("ticker", slot_idempotency_key("ticker/hourly", key))
        assert run.args_dict["slot"] == key

        async def ended() -> bool:
            s = await summary(client, "ticker/hourly")
            return bool(s["recent"]) and s["recent"][-1]["status"] == "completed"

        await wait_for(ended, what="the schedule hearing its run end")
        state = await read_run(client, run.actor_id)
        assert state.input == "report for 2026-03-02T09:00:00+01:00"
        [view] = await schedules.list_schedules(client, clock=clock)
        assert view.name == "ticker/hourly"
        assert view.started == 1
        assert view.missed == 0
        assert view.next[0] == T0 + HOUR  # the next slot, an hour on
        assert view.recent[-1].run_status == "completed"
    assert len(await runs_of(client, "ticker/hourly")) == 1


POLICIES = ("skip", "buffer_one", "buffer_all", "cancel_other", "allow_all")


async def test_three_missed_slots_are_counted_or_caught_up_under_each_overlap_policy(
    client: Client, db_url: str, model: AnthropicServer
) -> None:
    """Declared just after a slot; the clock then jumps 3.5 hours (three slots came while no
    worker looked). With no catch-up window they are missed; within one, they go through the
    overlap policy against runs that park (take longer than the interval)."""
    clock = ShiftedClock.at(T0 + 10.0)
    every = [
        Schedule(name=p.replace("_", "-"), every=HOUR, input="park {slot_utc}", overlap=p,
                 catch_up=4 * HOUR)
        for p in POLICIES
    ]  # fmt: skip
    none = Schedule(name="no-catch-up", every=HOUR, input="park {slot_utc}")
    async with running_worker(db_url, agents_with(*every, none), clock=clock):

        async def declared() -> bool:
            rows = await actors_of_kind(client.pool, "schedule", fields=("summary",))
            return len([r for r in rows if r.summary_dict.get("schedule")]) == 6

        await wait_for(declared, what="six schedules declared")
        clock.advance(3.5 * HOUR)
        for s in (*every, none):
            await client.send(schedule_id(f"ticker/{s.name}"), Tick())

        async def dealt(name: str, slots: int) -> dict[str, Any]:
            async def done() -> dict[str, Any] | None:
                s = await summary(client, f"ticker/{name}")
                n = s["started"] + s["skipped"] + s["buffered"] + s["missed"]
                return s if n == slots else None

            return await wait_for(done, what=f"{name} dealing with {slots} slots")

        missed = await dealt("no-catch-up", 3)
        assert (missed["missed"], missed["started"]) == (3, 0)
        assert "3 slot(s) missed" in missed["last_reason"]
        skip = await dealt("skip", 3)
        assert (skip["started"], skip["skipped"]) == (1, 2)
        assert "still in flight (overlap: skip)" in skip["last_reason"]
        one = await dealt("buffer-one", 3)
        assert (one["started"], one["buffered"], one["skipped"]) == (1, 1, 1)
        everything = await dealt("buffer-all", 3)
        assert (everything["started"], everything["buffered"]) == (1, 2)
        assert (await dealt("allow-all", 3))["started"] == 3
        assert (await dealt("cancel-other", 3))["started"] == 3

        # cancel_other: the first two runs are cancelled by the slots after them
        async def cancelled_by_slots() -> bool:
            rows = await runs_of(client, "ticker/cancel-other")
            return [r.summary_dict.get("status") for r in rows] == [
                "cancelled", "cancelled", "parked"
            ]  # fmt: skip

        await wait_for(cancelled_by_slots, timeout=60, what="cancel_other cancelling the others")

        # buffered slots start, one at a time, as the run before them ends
        async def parked() -> list[Any]:
            rows = await runs_of(client, "ticker/buffer-all")
            return [r for r in rows if r.summary_dict.get("status") == "parked"]

        for _ in range(2):
            [running] = await wait_for(parked, timeout=60, what="the run in flight parked")
            before = len(await runs_of(client, "ticker/buffer-all"))
            await cancel(client, running.actor_id, by=ME, reason="next")

            async def next_started(before: int = before) -> bool:
                return len(await runs_of(client, "ticker/buffer-all")) == before + 1

            await wait_for(next_started, timeout=60, what="the buffered slot starting")
        rows = await runs_of(client, "ticker/buffer-all")
        assert [r.args_dict["slot"] for r in rows] == [slot_key(T0 + k * HOUR) for k in (1, 2, 3)]


async def test_a_backfill_starts_a_ranges_slots_once_and_a_trigger_starts_one_run(
    client: Client, db_url: str, model: AnthropicServer
) -> None:
    clock = ShiftedClock.at(T0 + 10.0)
    daily = Schedule(name="daily", cron="0 9 * * *", timezone="Europe/Berlin", input="{date}")
    async with running_worker(db_url, agents_with(daily), clock=clock):
        await wait_for(lambda: summary_of(client, "ticker/daily"), what="declared")
        start = T0 - 3 * 86400 - 10  # three mornings back
        n = await schedules.backfill(
            client, "ticker/daily", start, T0 - 10, overlap="allow_all", by=ME, clock=clock
        )
        assert n == 3

        async def three() -> bool:
            return len(await runs_of(client, "ticker/daily")) == 3

        await wait_for(three, what="three backfilled runs")
        again = await schedules.backfill(
            client, "ticker/daily", start, T0 - 10, overlap="allow_all", by=ME, clock=clock
        )
        assert again == 3
        run = await schedules.trigger(client, "ticker/daily", by=ME, id="by-hand")
        same = await schedules.trigger(client, "ticker/daily", by=ME, id="by-hand")
        assert run == same

        async def four() -> bool:
            rows = await runs_of(client, "ticker/daily")
            return len(rows) == 4 and all(r.summary_dict.get("status") for r in rows)

        await wait_for(four, what="the triggered run")

        async def all_dealt() -> bool:
            s = await summary(client, "ticker/daily")
            return s["started"] + s["skipped"] == 7  # 3 backfilled, 3 again (skipped), 1

        await wait_for(all_dealt, what="the second backfill dealt with")
        assert len(await runs_of(client, "ticker/daily")) == 4


async def summary_of(client: Client, name: str) -> dict[str, Any] | None:
    row = await actor_row(client.pool, schedule_id(name), fields=("summary",))
    return row.summary_dict if row is not None and row.summary_dict.get("schedule") else None


async def test_a_failed_run_pauses_a_schedule_that_asks_and_resume_starts_from_now(
    client: Client, db_url: str, model: AnthropicServer
) -> None:
    clock = ShiftedClock.at(T0 - HOUR / 2)
    fragile = Schedule(name="fragile", every=HOUR, input="fail", pause_on_failure=True)
    async with running_worker(db_url, agents_with(fragile), clock=clock):
        await just_before(client, clock, "ticker/fragile", T0)

        async def paused() -> dict[str, Any] | None:
            s = await summary_of(client, "ticker/fragile")
            return s if s and s["paused"] else None

        s = await wait_for(paused, what="the schedule pausing on its failed run")
        assert "failed" in s["paused_reason"]
        [view] = await schedules.list_schedules(client, clock=clock)
        assert view.paused
        assert view.next == []
        clock.advance(2 * HOUR)
        await schedules.resume(client, "ticker/fragile", by=ME)

        async def resumed() -> dict[str, Any] | None:
            s = await summary_of(client, "ticker/fragile")
            return s if s and not s["paused"] else None

        s = await wait_for(resumed, what="resumed")
        assert s["cursor"] >= T0 + 2 * HOUR  # the slots of the pause are not fired
        assert s["started"] == 1
        assert s["missed"] == 0


async def test_declared_schedules_are_reconciled_at_each_start_without_firing_twice(
    client: Client, db_url: str, model: AnthropicServer
) -> None:
    clock = ShiftedClock.at(T0 - HOUR / 2)
    hourly = Schedule(name="hourly", every=HOUR, input="tick")
    async with running_worker(db_url, agents_with(hourly), clock=clock):
        await just_before(client, clock, "ticker/hourly", T0)
        await wait_for(lambda: runs_of(client, "ticker/hourly"), what="the slot's run")
    async with running_worker(db_url, agents_with(hourly), clock=clock):  # declared again
        await wait_for(lambda: runs_of(client, "ticker/hourly"), what="the slot's run")
    declared = await events(client.pool, schedule_id("ticker/hourly"), types=("schedule.declared",))
    assert len(declared) == 1
    assert len(await runs_of(client, "ticker/hourly")) == 1
    # declared no more: a start of a worker without it deletes it
    async with running_worker(db_url, agents_with(), clock=clock):

        async def deleted() -> bool:
            s = await summary_of(client, "ticker/hourly")
            return s is not None and bool(s.get("deleted"))

        await wait_for(deleted, what="the schedule deleted")
        assert await schedules.list_schedules(client, clock=clock) == []


async def test_a_schedules_runs_under_its_concurrency_key_go_one_at_a_time(
    client: Client, db_url: str, model: AnthropicServer
) -> None:
    """Three slots caught up at once (``allow_all``) under one key (a cap of 1, the default):
    their runs, spawned in one step, start one at a time, each once the one before has parked
    (a parked run holds no slot). Runs spawned in one step queue in the order of their claims,
    not of their slots."""
    clock = ShiftedClock.at(T0 + 10.0)
    keyed = Schedule(
        name="keyed", every=HOUR, input="park {slot_utc}", overlap="allow_all",
        catch_up=4 * HOUR, concurrency_key="nightly",
    )  # fmt: skip
    async with running_worker(db_url, agents_with(keyed), clock=clock):
        await wait_for(lambda: summary_of(client, "ticker/keyed"), what="declared")
        clock.advance(3.5 * HOUR)
        await client.send(schedule_id("ticker/keyed"), Tick())

        async def three_parked() -> list[Any] | None:
            rows = await runs_of(client, "ticker/keyed")
            parked = [r for r in rows if r.summary_dict.get("status") == "parked"]
            return rows if len(parked) == 3 else None

        rows = await wait_for(three_parked, timeout=60, what="three runs, one after another")
    assert [r.args_dict["concurrency_key"] for r in rows] == ["nightly"] * 3
    started = [(await events(client.pool, r.actor_id, types=("run.started",)))[0].at for r in rows]
    parked = [
        (await events(client.pool, r.actor_id, types=("approval.requested",)))[0].at for r in rows
    ]
    order = sorted(range(3), key=lambda k: started[k])  # type: ignore[arg-type,return-value]
    started, parked = [started[k] for k in order], [parked[k] for k in order]
    for k in range(2):  # the next began only once the one before had parked
        assert parked[k] is not None
        assert started[k + 1] is not None
        assert parked[k] <= started[k + 1]
