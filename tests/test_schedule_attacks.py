"""Attacks on schedules (issue 30, a reviewer's): stale, repeated and concurrent declarations,
a backfill over slots whose runs ended, garbage sent straight to a schedule's actor, and a
template that outgrows a run's input once filled in. Each test states the promise it holds
the code to; those marked ``xfail(strict=True)`` are open findings (their reason says which)."""

from __future__ import annotations

from typing import Any

import anyio
import pytest

from tests.conftest import person, running_worker, wait_for
from tests.test_schedules import (  # noqa: F401  (model: a fixture)
    HOUR,
    T0,
    agents_with,
    model,
    runs_of,
    summary_of,
)
from toren import Client
from toren.kernel import ShiftedClock, events
from toren.runs import ChildEnded
from toren.schedules import Schedule, ScheduleError
from toren.schedules import client as schedules
from toren.schedules.events import Backfill, Declare, Tick, schedule_id

pytestmark = pytest.mark.anyio

ME = person("ops")


async def settled(client: Client, name: str) -> None:
    """Wait until the schedule's mailbox is empty: every message sent so far was handled
    (or was never stored, a duplicate)."""

    async def empty() -> bool:
        count = await client.pool.fetchval(
            "SELECT count(*) FROM toren.mailbox WHERE actor_id = $1 AND visible_at <= now()",
            schedule_id(name),
        )
        return count == 0

    await wait_for(empty, what=f"{name}'s mailbox handled")


async def live(client: Client, name: str) -> dict[str, Any] | None:
    s = await summary_of(client, name)
    return s if s is not None and not s.get("deleted") else None


async def deleted(client: Client, name: str) -> bool:
    s = await summary_of(client, name)
    return s is not None and bool(s.get("deleted"))


# --- declarations: the same one again after a change is not a duplicate ------------------------


@pytest.mark.usefixtures("model")
async def test_a_schedule_deleted_and_created_again_with_the_same_declaration_comes_back(
    client: Client, db_url: str
) -> None:
    """The declaration's dedupe key once named only the declaration, and a used key is kept
    for days: creating the schedule again after a delete stored no message, and the schedule
    stayed deleted while ``create`` said it was created."""
    hourly = Schedule(name="hourly", every=HOUR, input="tick")
    async with running_worker(db_url, agents_with()):
        await schedules.create(client, "ticker", hourly, by=ME)
        await wait_for(lambda: live(client, "ticker/hourly"), what="created")
        await schedules.delete(client, "ticker/hourly", by=ME)
        await wait_for(lambda: deleted(client, "ticker/hourly"), what="deleted")
        await schedules.create(client, "ticker", hourly, by=ME)
        await settled(client, "ticker/hourly")
        assert await live(client, "ticker/hourly"), "created again, yet still deleted"
        [view] = await schedules.list_schedules(client)
        assert view.name == "ticker/hourly"


@pytest.mark.usefixtures("model")
async def test_a_declared_schedule_deleted_at_run_time_comes_back_at_the_next_start(
    client: Client, db_url: str
) -> None:
    """docs/schedules.md: "A schedule deleted while its agent still declares it comes back at
    the next start of a worker running that agent"."""
    hourly = Schedule(name="hourly", every=HOUR, input="tick")
    async with running_worker(db_url, agents_with(hourly)):
        await wait_for(lambda: live(client, "ticker/hourly"), what="declared")
        await schedules.delete(client, "ticker/hourly", by=ME)
        await wait_for(lambda: deleted(client, "ticker/hourly"), what="deleted")
    async with running_worker(db_url, agents_with(hourly)):
        await wait_for(lambda: live(client, "ticker/hourly"), timeout=15, what="declared again")


@pytest.mark.usefixtures("model")
async def test_a_rolled_back_declaration_is_declared_again(client: Client, db_url: str) -> None:
    """Version 1 declares input "a", version 2 input "b", then a rollback to version 1: the
    schedule runs "a" again (the worker that started last decides, as documented)."""
    for text in ("a", "b", "a"):
        hourly = Schedule(name="hourly", every=HOUR, input=text)
        async with running_worker(db_url, agents_with(hourly)):

            async def declared(text: str = text) -> bool:
                s = await live(client, "ticker/hourly")
                return s is not None and s["schedule"]["input"] == text

            await wait_for(declared, timeout=15, what=f"input {text!r} declared")
    found = await events(client.pool, schedule_id("ticker/hourly"), types=("schedule.declared",))
    assert [e.data["schedule"]["input"] for e in found] == ["a", "b", "a"]


@pytest.mark.xfail(
    strict=True,
    reason="open (medium): create's 409 check reads the row's summary, which holds no "
    "declaration until a worker handled the first Declare; two creates of one name with "
    "different declarations both succeed and the last one wins silently",
)
async def test_two_creates_of_one_name_with_different_declarations_one_is_refused(
    client: Client, db_url: str
) -> None:
    first = Schedule(name="digest", every=HOUR, input="first")
    second = Schedule(name="digest", every=HOUR, input="second")
    outcomes: list[str] = []

    async def create(schedule: Schedule) -> None:
        try:
            await schedules.create(client, "ticker", schedule, by=ME)
            outcomes.append("created")
        except schedules.ScheduleExists:
            outcomes.append("409")

    # No worker is live (so none has handled either declaration): the window a busy worker
    # leaves open between a create and its schedule's next step.
    async with anyio.create_task_group() as tg:
        tg.start_soon(create, first)
        tg.start_soon(create, second)
    assert sorted(outcomes) == ["409", "created"]


# --- slots whose runs ended: never "in flight" again -------------------------------------------


@pytest.mark.xfail(
    strict=True,
    reason="open (high): _start knows a slot's run only from the last 20 slots (state.recent); "
    "a backfill over an older slot, or any slot after a delete and create, records "
    "slot_started for a run that exists and ended, whose end is never told again: it stays "
    "in_flight for ever, and with overlap skip every later slot is skipped",
)
@pytest.mark.usefixtures("model")
async def test_a_backfill_over_a_slot_whose_run_ended_leaves_nothing_in_flight(
    client: Client, db_url: str
) -> None:
    clock = ShiftedClock.at(T0 - HOUR / 2)
    name = "ticker/hourly"
    async with running_worker(db_url, agents_with(), clock=clock):
        first = Schedule(name="hourly", every=HOUR, input="tick")
        await schedules.create(client, "ticker", first, by=ME)
        await wait_for(lambda: live(client, name), what="created")
        clock.advance(T0 - 1.0 - clock.now())
        await client.send(schedule_id(name), Tick())

        async def ended() -> bool:
            s = await live(client, name)
            return bool(s and s["recent"] and s["recent"][-1]["status"] == "completed")

        await wait_for(ended, what="the slot's run ended, and the schedule told")
        await schedules.delete(client, name, by=ME)
        await wait_for(lambda: deleted(client, name), what="deleted")
        again = Schedule(name="hourly", every=HOUR, input="tick again")
        await schedules.create(client, "ticker", again, by=ME)
        await wait_for(lambda: live(client, name), what="created again")
        clock.advance(60.0)
        n = await schedules.backfill(
            client, name, T0 - 10.0, T0 + 10.0, overlap="skip", by=ME, clock=clock
        )
        assert n == 1
        await settled(client, name)
        s = await live(client, name)
        assert s is not None
        assert len(await runs_of(client, name)) == 1  # the slot started no second run
        assert s["in_flight"] == [], "a run that ended is in flight for ever"


# --- garbage sent straight to the actor: nothing happens, the schedule goes on ----------------


@pytest.mark.usefixtures("model")
async def test_garbage_sent_to_a_schedule_changes_nothing_and_it_goes_on(
    client: Client, db_url: str
) -> None:
    clock = ShiftedClock.at(T0 - HOUR / 2)
    name = "ticker/hourly"
    hourly = Schedule(name="hourly", every=HOUR, input="tick {slot_utc}")
    address = schedule_id(name)
    async with running_worker(db_url, agents_with(hourly), clock=clock):
        await wait_for(lambda: live(client, name), what="declared")
        before = await live(client, name)
        bad = {"name": "hourly", "every": float("nan"), "input": "x"}
        await client.send(address, Declare(agent="ticker", schedule=bad, source="api", by=ME))
        odd = {"name": "hourly", "cron": "0 9 * * *", "timezone": "../../etc/passwd"}
        await client.send(address, Declare(agent="ticker", schedule=odd, source="api", by=ME))
        for start, end, overlap in [
            (T0 - 10.0, T0 - 3 * HOUR, "skip"),  # start after end
            (T0 - 3 * HOUR, T0 - 10.0, "whatever"),  # an unknown overlap
            (-1e308, T0 - 10.0, "allow_all"),
        ]:
            await client.send(address, Backfill(by=ME, start=start, end=end, overlap=overlap))
        stranger = ChildEnded(
            call_id="", run_id="run/not-mine", agent="ticker", status="failed", output="",
            error_class="tool", error="", usd_paid="0", calls_made=0, input_tokens=0,
            output_tokens=0, unpriced_calls=0, lost_calls=0, lost_usd="0",
        )  # fmt: skip
        await client.send(address, stranger)
        await settled(client, name)
        after = await live(client, name)
        assert after is not None
        assert before is not None
        assert after["schedule"] == before["schedule"]
        assert after["started"] == 0
        assert after["in_flight"] == []
        dead = await client.pool.fetchval(
            "SELECT count(*) FROM toren.deadletters WHERE actor_id = $1", address
        )
        assert dead == 0
        # and it still fires its next slot
        clock.advance(T0 - 1.0 - clock.now())
        await client.send(address, Tick())
        await wait_for(lambda: runs_of(client, name), what="the next slot's run")


# --- triggers: one id, one run, however many requests at once ---------------------------------


@pytest.mark.usefixtures("model")
async def test_concurrent_triggers_with_one_id_start_one_run(client: Client, db_url: str) -> None:
    name = "ticker/hourly"
    hourly = Schedule(name="hourly", every=HOUR, input="tick")
    async with running_worker(db_url, agents_with(hourly)):
        await wait_for(lambda: live(client, name), what="declared")
        runs: list[str] = []

        async def trigger() -> None:
            runs.append(await schedules.trigger(client, name, by=ME, id="once"))

        async with anyio.create_task_group() as tg:
            for _ in range(8):
                tg.start_soon(trigger)
        assert len(set(runs)) == 1
        await settled(client, name)
        await wait_for(lambda: runs_of(client, name), what="the run")
        assert len(await runs_of(client, name)) == 1
        s = await live(client, name)
        assert s is not None
        assert s["started"] == 1


# --- the input: what a slot fills in must fit a run's input ------------------------------------


def test_a_template_that_outgrows_a_runs_input_once_filled_in_is_refused_when_declared() -> None:
    """docs/schedules.md: a bad input is refused "when the schedule is declared, not when it
    fires". A 64 KiB template of ``{slot}`` placeholders is 4x that once filled in: each slot
    was skipped ("not started: ... too large"), for ever."""
    template = "{slot}" * (64 * 1024 // len("{slot}"))
    with pytest.raises(ScheduleError) as info:
        Schedule(name="big", every=HOUR, input=template)
    assert info.value.field == "input"
    # a template that fits however it is filled in is still taken
    Schedule(name="fits", every=HOUR, input="x" * (60 * 1024) + "{slot} {weekday} {schedule}")
