"""Durability with real worker processes: SIGKILL, SIGSTOP, SIGTERM, a terminated lock session."""

from __future__ import annotations

import datetime as dt
import os
import random
import re
import signal
from pathlib import Path

import anyio
import pytest

from tests import app
from tests.conftest import WorkerFactory, WorkerProcess, wait_for, worker_registered
from toren import Client

pytestmark = [pytest.mark.anyio, pytest.mark.processes]


async def _registered(client: Client, w: WorkerProcess) -> None:
    await wait_for(lambda: worker_registered(client, w.pid), what=f"worker {w.pid} registered")


async def _owner_pid(client: Client, actor_id: str) -> int | None:
    pid: int | None = await client.pool.fetchval(
        "SELECT w.pid FROM toren.actors a JOIN toren.workers w ON w.worker_id = a.owner "
        "WHERE a.actor_id = $1",
        actor_id,
    )
    return pid


async def test_counter_counts_exactly_once_through_three_sigkills(
    client: Client, workers: WorkerFactory
) -> None:
    await client.spawn(app.Counter, "counter/1")
    senders, per_sender = 4, 250
    rng = random.Random(os.environ.get("TOREN_TEST_SEED", "counter"))

    async def sender(i: int) -> None:
        for j in range(per_sender):
            tag = f"s{i}-{j}"
            await client.send("counter/1", app.Add(n=1, tag=tag), dedupe_key=tag)
            # Spread the sends over a few seconds so that the kills land mid-stream.
            await anyio.sleep(rng.uniform(0.0, 0.03))

    async def handled() -> int:
        return int(await client.pool.fetchval("SELECT count(*) FROM toren.journal"))

    w = workers()
    kills = 0
    async with anyio.create_task_group() as tg:
        for i in range(senders):
            tg.start_soon(sender, i)
        await _registered(client, w)
        while kills < 3:
            # Kill at a random moment while messages are being handled.
            before = await handled()
            await wait_for(lambda b=before: _gt(handled(), b), what="progress")
            if await handled() >= senders * per_sender:
                break
            await anyio.sleep(rng.uniform(0.05, 0.4))
            w.kill()
            kills += 1
            w = workers()
    await wait_for(lambda: _eq(handled(), senders * per_sender), timeout=60, what="all handled")

    journal = await client.journal("counter/1")
    assert [e.seq for e in journal] == list(range(1, senders * per_sender + 1))
    tags = [e.data["tag"] for e in journal]
    assert len(set(tags)) == len(tags) == senders * per_sender  # none twice, none lost
    message_ids = [e.data["message_id"] for e in journal]
    assert len(set(message_ids)) == len(message_ids)
    state, _ = await client.state("counter/1")
    assert state.total == senders * per_sender
    assert await client.deadletters() == []
    assert await client.pool.fetchval("SELECT count(*) FROM toren.mailbox") == 0
    epochs = [e.epoch for e in journal]
    assert epochs == sorted(epochs)  # no write from an older owner after a newer one
    assert kills == 3
    assert len(set(epochs)) >= 2  # the kills did move the actor between workers


async def _gt(coro, n):  # type: ignore[no-untyped-def]
    return (await coro) > n


async def _eq(coro, n):  # type: ignore[no-untyped-def]
    return (await coro) == n


async def test_the_surviving_worker_resumes_an_actor_whose_owner_was_killed(
    client: Client, workers: WorkerFactory
) -> None:
    await client.spawn(app.Worker, "w/1")
    a, b = workers(), workers()
    await _registered(client, a)
    await _registered(client, b)
    await client.send("w/1", app.Work(seconds=0, tag="first"))
    owner = await wait_for(lambda: _owner_pid(client, "w/1"), what="an owner")
    victim, survivor = (a, b) if owner == a.pid else (b, a)
    await wait_for(lambda: _has_tags(client, "w/1", 1), what="first handled")
    victim.kill()
    await client.send("w/1", app.Work(seconds=0, tag="second"))
    await wait_for(lambda: _has_tags(client, "w/1", 2), timeout=10, what="second handled")
    journal = await client.journal("w/1")
    assert journal[-1].data["pid"] == survivor.pid
    # Taken over through the dead worker's lock, well before its lease (3 s) could matter.
    assert await _owner_pid(client, "w/1") == survivor.pid


async def _has_tags(client: Client, actor_id: str, n: int) -> bool:
    return len(await client.journal(actor_id)) >= n


async def test_zombie_worker_is_fenced_out_after_sigcont(
    client: Client, workers: WorkerFactory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    marker = tmp_path / "handling"
    monkeypatch.setenv("TOREN_TEST_HANDLING", str(marker))
    await client.spawn(app.Worker, "w/z")
    zombie = workers()
    await _registered(client, zombie)
    await client.send("w/z", app.Work(seconds=0.5, tag="slow", only_first_delivery=True))
    await wait_for(lambda: _marker_says(marker, zombie.pid), what="zombie handling")
    old_epoch = (await client.actor("w/z"))["epoch"]
    zombie.signal(signal.SIGSTOP)
    try:
        survivor = workers()
        # The zombie's lock is still held, so the survivor waits for the lease (3 s) to expire.
        await wait_for(lambda: _has_tags(client, "w/z", 1), timeout=15, what="survivor handled")
        new_epoch = (await client.actor("w/z"))["epoch"]
        assert new_epoch > old_epoch
    finally:
        zombie.signal(signal.SIGCONT)
    # On SIGCONT the zombie's overdue renewal and its handler's commit race. Either its commit
    # is refused by the fence (FencedOut), or its renewal (also a write to the actor's row, fenced
    # by owner) comes back without the actor and the keeper stops it before the commit returns.
    # Statement-level refusal of a stale step is proven in test_fencing.py.
    await wait_for(
        lambda: _log_matches(zombie, rf"w/z: (fenced out at epoch {old_epoch}|lease lost)"),
        timeout=10,
        what="zombie's write refused and the actor stopped",
    )
    await anyio.sleep(1.0)
    journal = await client.journal("w/z")
    assert len(journal) == 1
    assert journal[0].data["pid"] == survivor.pid
    assert all(e.epoch == new_epoch for e in journal)
    assert await client.deadletters() == []


async def _marker_says(marker: Path, pid: int) -> bool:
    return marker.exists() and marker.read_text().startswith(f"{pid} ")


async def _log_matches(w: WorkerProcess, pattern: str) -> bool:
    return re.search(pattern, w.log()) is not None


async def test_sigterm_finishes_the_message_in_hand_and_hands_over_without_expiry(
    client: Client, workers: WorkerFactory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    marker, gate = tmp_path / "handling", tmp_path / "gate"
    monkeypatch.setenv("TOREN_TEST_HANDLING", str(marker))
    monkeypatch.setenv("TOREN_TEST_GATE", str(gate))
    await client.spawn(app.Worker, "w/t")
    # A long lease: a takeover that waited for expiry would blow the test's time bound.
    leaving = workers(lease_seconds=60, renew_seconds=5)
    await _registered(client, leaving)
    await client.send("w/t", app.Work(seconds=0, tag="in-hand", gated=True))
    await client.send("w/t", app.Work(seconds=0, tag="next"))
    await wait_for(lambda: _marker_says(marker, leaving.pid), what="handling")
    staying = workers(lease_seconds=60, renew_seconds=5)
    await _registered(client, staying)
    leaving.signal(signal.SIGTERM)
    # The message stays in hand until the worker is draining: its commit claims nothing more.
    await wait_for(lambda: _log_matches(leaving, r"SIGTERM: draining"), what="draining")
    gate.touch()
    with anyio.fail_after(15):
        code = await anyio.to_thread.run_sync(leaving.wait, 15)
    assert code == 0
    await wait_for(lambda: _has_tags(client, "w/t", 2), timeout=10, what="next handled")
    journal = await client.journal("w/t")
    assert [(e.data["tag"], e.data["pid"]) for e in journal] == [
        ("in-hand", leaving.pid),
        ("next", staying.pid),
    ]
    assert "w/t: stopping; lease released" in leaving.log()
    assert (
        await client.pool.fetchval("SELECT count(*) FROM toren.workers WHERE pid = $1", leaving.pid)
        == 0
    )


async def test_worker_whose_lock_session_is_terminated_stops_its_actors_then_claims_again(
    client: Client, workers: WorkerFactory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    marker = tmp_path / "handling"
    monkeypatch.setenv("TOREN_TEST_HANDLING", str(marker))
    monkeypatch.setenv("TOREN_TEST_GATE", str(tmp_path / "gate"))  # never opened
    await client.spawn(app.Worker, "w/l")
    victim = workers()
    await _registered(client, victim)
    await client.send("w/l", app.Work(seconds=0, tag="slow", only_first_delivery=True, gated=True))
    await wait_for(lambda: _marker_says(marker, victim.pid), what="handling")
    other = workers()
    await _registered(client, other)
    lock_pid = await client.pool.fetchval(
        "SELECT l.pid FROM pg_locks l JOIN toren.workers w ON l.objid = w.lock_key::oid "
        "WHERE l.locktype = 'advisory' AND l.objsubid = 2 AND l.granted AND w.pid = $1",
        victim.pid,
    )
    assert lock_pid is not None
    assert await client.pool.fetchval("SELECT pg_terminate_backend($1)", lock_pid)
    await wait_for(lambda: _has_tags(client, "w/l", 1), timeout=10, what="taken over")
    [entry] = await client.journal("w/l")
    written_at = await client.pool.fetchval(
        "SELECT created_at FROM toren.journal WHERE actor_id = 'w/l'"
    )
    log = victim.log()
    stopped = re.search(
        r"^(\S+)Z ERROR toren.leases: worker \S+ lost its lock connection", log, re.M
    )
    assert stopped is not None, log
    stopped_at = dt.datetime.fromisoformat(stopped.group(1)).replace(tzinfo=dt.UTC)
    assert stopped_at < written_at
    # The handler that was in hand never wrote: the one event is the taker's second delivery.
    assert entry.data["deliveries"] == 2
    # The victim starts a new incarnation and claims again.
    await wait_for(
        lambda: _count(client, "SELECT count(*) FROM toren.workers WHERE pid = $1", victim.pid),
        what="victim re-registered",
    )
    other.kill()
    await client.spawn(app.Worker, "w/l2")
    await client.send("w/l2", app.Work(seconds=0, tag="after"))
    await wait_for(lambda: _has_tags(client, "w/l2", 1), timeout=10, what="victim claims again")
    assert (await client.journal("w/l2"))[0].data["pid"] == victim.pid


async def _count(client: Client, sql: str, *args: object) -> int:
    return int(await client.pool.fetchval(sql, *args))


async def test_durable_timer_fires_once_across_a_worker_kill(
    client: Client, workers: WorkerFactory
) -> None:
    await client.spawn(app.Alarm, "alarm/k")
    w = workers()
    await client.send("alarm/k", app.Arm(seconds=2.0))
    await wait_for(lambda: _states(client, "alarm/k", ["armed"]), what="armed")
    w.kill()
    await anyio.sleep(3.0)  # the timer falls due while no worker runs
    w2 = workers()
    await wait_for(lambda: _states(client, "alarm/k", ["armed", "fired"]), timeout=15)
    await anyio.sleep(1.5)
    state, _ = await client.state("alarm/k")
    assert state == ["armed", "fired"]
    fired = [e for e in await client.journal("alarm/k") if e.data["what"] == "fired"]
    assert fired[0].data["pid"] == w2.pid


async def _states(client: Client, actor_id: str, expected: list[str]) -> bool:
    state, _ = await client.state(actor_id)
    return bool(state == expected)


async def test_a_worker_paused_past_its_lease_makes_no_effect_when_it_wakes(
    client: Client, workers: WorkerFactory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A zombie: the worker is SIGSTOPped inside a tool that waits and then checks its lease
    (ctx.ensure_lease()) right before its effect; another worker takes the run over meanwhile
    and makes the effect; the zombie, continued, makes none."""
    from toren.runs import read_run, start_run
    from toren.testing import AnthropicServer, Reply, ToolCall

    ledger = tmp_path / "effects"
    monkeypatch.setenv("TOREN_TEST_LEDGER", str(ledger))
    monkeypatch.setenv("TOREN_TEST_CAREFUL_WAIT", "2")
    script = [Reply([ToolCall(id="c1", name="careful", arguments={"what": "pay"})]), Reply("Paid.")]
    async with AnthropicServer(script) as server:
        for name, value in server.env().items():
            monkeypatch.setenv(name, value)
        zombie = workers(app="tests.hostile_app")
        run_id = await start_run(client, "zombie", "pay once")
        started = ledger.with_suffix(f".started.{zombie.pid}")
        await wait_for(lambda: anyio.to_thread.run_sync(started.exists), what="the tool waiting")
        zombie.signal(signal.SIGSTOP)  # paused inside the tool, before its effect
        survivor = workers(app="tests.hostile_app")

        async def effect_made() -> bool:
            return ledger.exists() and bool(ledger.read_text().strip())

        await wait_for(effect_made, timeout=30, what="the survivor's effect")
        zombie.signal(signal.SIGCONT)

        async def zombie_stopped() -> bool:
            log = zombie.log()
            return "lease may have lapsed" in log or "lease lost to another worker" in log

        await wait_for(zombie_stopped, timeout=20, what="the zombie gave the run up")

        async def completed() -> bool:
            return (await read_run(client, run_id)).status == "completed"

        await wait_for(completed, timeout=30, what="completed")
        assert len(server.requests) == 2
    effects = [line.split() for line in ledger.read_text().splitlines()]
    assert [e[0] for e in effects] == [str(survivor.pid)]  # the zombie made none
    epochs = [int(t) for t in ledger.with_suffix(f".started.{zombie.pid}").read_text().split()]
    assert int(effects[0][1]) > max(epochs)  # the survivor's fencing token is newer


async def test_a_worker_registers_before_it_imports_its_agents_provider_sdks(
    client: Client, workers: WorkerFactory
) -> None:
    # bench.app's agents call Anthropic: the worker serves first and imports the SDK after.
    w = workers("bench.app")
    imported = "INFO toren.run: imported the anthropic SDK in "
    await wait_for(lambda: _log_matches(w, re.escape(imported)), what="the SDK imported")
    log = w.log()
    registered = re.search(r"INFO toren.leases: worker \S+ registered", log)
    assert registered is not None, log
    assert registered.start() < log.index(imported), log
