"""Poison messages, dead letters, escalation, timers and spawns, with a worker in this process."""

from __future__ import annotations

import anyio
import pytest

from tests import app
from tests.conftest import running_worker, wait_for
from toren import Client

pytestmark = pytest.mark.anyio


async def _journal_types(client: Client, actor_id: str) -> list[str]:
    return [e.type for e in await client.journal(actor_id)]


async def test_poison_message_is_dead_lettered_the_sender_told_and_the_actor_goes_on(
    client: Client, db_url: str
) -> None:
    await client.spawn(app.Relay, "relay/1")
    await client.spawn(app.Fragile, "fragile/1")
    await client.send("relay/1", app.Forward(to="fragile/1", boom=True, tag="bad"))
    await client.send("relay/1", app.Forward(to="fragile/1", boom=False, tag="good"))
    async with running_worker(db_url):

        async def settled() -> bool:
            state, _ = await client.state("relay/1")
            fragile, _ = await client.state("fragile/1")
            return bool(state) and fragile == ["good"]

        await wait_for(settled, what="poison handled and the next message processed")
    dead = await client.deadletters()
    assert len(dead) == 1
    assert dead[0].actor_id == "fragile/1"
    assert dead[0].sender == "relay/1"
    assert dead[0].attempts == app.Fragile.max_attempts
    assert "cannot handle bad" in dead[0].error
    told, _ = await client.state("relay/1")
    assert told == [f"poison:fragile/1/{dead[0].id}"]
    # One restart of the actor is counted for the dead letter, persisted.
    window = await client.pool.fetchval(
        "SELECT cardinality(restarts) FROM toren.restart_windows WHERE key = 'actors/fragile/1'"
    )
    assert window == 1
    assert await client.pool.fetchval("SELECT count(*) FROM toren.mailbox") == 0


async def test_what_on_dead_letter_records_and_sends_commits_with_the_dead_letter(
    client: Client, db_url: str
) -> None:
    await client.spawn(app.Fragile, "fragile/listener")
    await client.spawn(app.Mourner, "mourner/1")
    await client.send("mourner/1", app.Boom(tag="x"))
    async with running_worker(db_url):

        async def told() -> bool:
            listener, _ = await client.state("fragile/listener")
            return listener == ["news of x"]

        await wait_for(told, what="the listener told of the dead letter")
    mourner, _ = await client.state("mourner/1")
    assert mourner == ["gave up on x"]  # its event, though a recipient does not exist
    [dead] = await client.deadletters()
    assert dead.actor_id == "mourner/1"


async def test_requeued_dead_letter_is_delivered_again_with_fresh_counts(
    client: Client, db_url: str
) -> None:
    await client.spawn(app.Fragile, "fragile/2")
    await client.send("fragile/2", app.Boom(tag="x"))
    async with running_worker(db_url):
        await wait_for(lambda: client.deadletters(), what="dead letter")
        [dead] = await client.deadletters()
        [new_id] = await client.requeue([dead.id])
        assert new_id != dead.id
        assert await client.deadletters() == [] or (await client.deadletters())[0].id == new_id

        async def dead_again() -> bool:
            items = await client.deadletters()
            return len(items) == 1 and items[0].id == new_id

        await wait_for(dead_again, what="second dead letter")
    [again] = await client.deadletters()
    assert again.attempts == app.Fragile.max_attempts
    assert await client.requeue([12345678]) == []


async def test_actor_failing_to_start_escalates_and_the_count_survives_a_worker_restart(
    client: Client, db_url: str
) -> None:
    app.bad_starts.clear()
    await client.spawn(app.Relay, "relay/p")
    await client.spawn(app.BadStart, "bad/1", parent="relay/p")
    await client.send("bad/1", {"go": True})
    key = "actors/bad/1"

    async def restarts() -> int:
        n = await client.pool.fetchval(
            "SELECT cardinality(restarts) FROM toren.restart_windows WHERE key = $1", key
        )
        return int(n or 0)

    async with running_worker(db_url, actor_restart_intensity=3, actor_restart_period=60.0):
        await wait_for(lambda: _at_least(restarts(), 2), what="two restarts")
    starts_first_worker = len(app.bad_starts)
    assert (await client.actor("bad/1"))["status"] == "live"

    async with running_worker(db_url, actor_restart_intensity=3, actor_restart_period=60.0):

        async def failed() -> bool:
            return (await client.actor("bad/1"))["status"] == "failed"

        await wait_for(failed, what="escalation")
        told, _ = await wait_for(lambda: _nonempty_state(client, "relay/p"), what="parent told")
    starts_second_worker = len(app.bad_starts) - starts_first_worker
    assert await restarts() == 4  # intensity 3: the fourth restart within the period escalates
    assert starts_first_worker + starts_second_worker == 4
    assert starts_second_worker < 4  # the second worker went on from the persisted count
    row = await client.actor("bad/1")
    assert "refusing to start" in row["failure"]
    assert told == ["child_failed:bad/1"]


async def _at_least(coro, n):  # type: ignore[no-untyped-def]
    return (await coro) >= n


async def _nonempty_state(client: Client, actor_id: str):  # type: ignore[no-untyped-def]
    state, seq = await client.state(actor_id)
    return (state, seq) if state else None


async def test_durable_timer_fires_once_after_the_actor_passivated(
    client: Client, db_url: str
) -> None:
    await client.spawn(app.Alarm, "alarm/1")
    await client.send("alarm/1", app.Arm(seconds=1.0))
    async with running_worker(db_url) as worker:
        await wait_for(lambda: _has(client, "alarm/1", "armed"))
        await wait_for(lambda: _owner_is_none(client, "alarm/1"), what="passivated while waiting")
        assert "alarm/1" not in worker.hosts.hosts
        await wait_for(lambda: _has(client, "alarm/1", "fired"), timeout=10)
        await anyio.sleep(1.0)
    state, _ = await client.state("alarm/1")
    assert state == ["armed", "fired"]


async def _has(client: Client, actor_id: str, what: str) -> bool:
    state, _ = await client.state(actor_id)
    return what in state


async def _owner_is_none(client: Client, actor_id: str) -> bool:
    return (await client.actor(actor_id))["owner"] is None


async def test_handler_spawns_a_child_and_messages_it_in_the_same_step(
    client: Client, db_url: str
) -> None:
    await client.spawn(app.Relay, "relay/s")
    await client.send("relay/s", {"spawn": "counter/child", "kind": "test.counter"})
    async with running_worker(db_url):

        async def child_handled() -> bool:
            row = await client.pool.fetchrow(
                "SELECT parent, (SELECT count(*) FROM toren.mailbox m"
                " WHERE m.actor_id = a.actor_id) AS pending"
                " FROM toren.actors a WHERE actor_id = 'counter/child'"
            )
            return row is not None and row["parent"] == "relay/s" and row["pending"] == 0

        await wait_for(child_handled, what="child spawned and its message consumed")


async def test_sending_to_an_unknown_actor_from_a_handler_fails_the_message(
    client: Client, db_url: str
) -> None:
    await client.spawn(app.Relay, "relay/u")
    await client.send("relay/u", app.Forward(to="ghost", boom=False, tag="x"))
    async with running_worker(db_url):
        await wait_for(lambda: client.deadletters(), what="dead letter")
    [dead] = await client.deadletters()
    assert "ghost" in dead.error
    assert await client.journal("relay/u") == []


async def test_dropped_database_connections_lose_nothing_and_charge_no_restart(
    client: Client, db_url: str
) -> None:
    await client.spawn(app.Counter, "c/db")
    total, rounds = 60, 3
    cuts = 0

    async def cut() -> int:
        ended: int = await client.pool.fetchval(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
            "WHERE application_name = 'toren-worker' AND datname = current_database()"
        )
        return ended

    async with running_worker(db_url):
        # Cut the worker's pooled connections again and again, mid-statement or idle; blips,
        # not an outage (a renewal failing past the lease's safety margin stops all actors).
        # Each round queues its messages, then cuts until they are all handled, so that every
        # round is cut at least once however fast the worker is.
        per_round = total // rounds
        for r in range(rounds):
            for i in range(r * per_round, (r + 1) * per_round):
                await client.send("c/db", app.Add(n=1, tag=f"t{i}"))

            async def handled(r: int = r) -> bool:
                nonlocal cuts
                cuts += await cut()
                return len(await client.journal("c/db")) >= (r + 1) * per_round

            await wait_for(handled, timeout=60, interval=0.1, what=f"round {r} handled")
    assert cuts >= rounds
    journal = await client.journal("c/db")
    assert [e.seq for e in journal] == list(range(1, total + 1))
    assert len({e.data["tag"] for e in journal}) == total
    assert await client.pool.fetchval("SELECT count(*) FROM toren.restart_windows") == 0
    assert (await client.actor("c/db"))["status"] == "live"
    assert await client.deadletters() == []


async def test_spawning_an_id_held_by_another_kind_fails_the_step(
    client: Client, db_url: str
) -> None:
    await client.spawn(app.Fragile, "taken")
    await client.spawn(app.Relay, "relay/clash")
    await client.send("relay/clash", {"spawn": "taken", "kind": "test.counter"})
    async with running_worker(db_url):
        await wait_for(lambda: client.deadletters(), what="dead letter")
    [dead] = await client.deadletters()
    assert "already exists with kind 'test.fragile'" in dead.error
    assert await client.journal("relay/clash") == []
    assert (await client.actor("taken"))["kind"] == "test.fragile"


async def test_on_start_cannot_emit(client: Client) -> None:
    from toren import Context, EffectOutsideHandler

    actor = app.Counter("c/x", {})
    ctx = Context(actor, actor.initial_state(), 0, 1, None, read_only=True)
    with pytest.raises(EffectOutsideHandler):
        ctx.emit(app.Added(n=1, tag="t", message_id=1))
    with pytest.raises(EffectOutsideHandler):
        ctx.send("elsewhere", app.Get())
