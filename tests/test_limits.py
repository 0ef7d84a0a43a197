"""Concurrency limits across workers (toren._core.limits, toren.runs.limits): a key's runs one at
a time and in order, an agent's cap never exceeded and reached, calls between capped agents
that do not deadlock, a cancel that frees a queued run's place, a killed worker's run keeping
its slot until its takeover, bad caps and keys refused with nothing stored, and mutations that
drop the hand-off or the cap check caught.

Overlap and order are read from the journals' timestamps (the database's clock at each step's
commit), never from timing: a run's ``run.started`` to its ``run.completed`` lies within the
time it held its permits.
"""

from __future__ import annotations

import contextlib
import itertools
import uuid
from collections.abc import AsyncIterator
from typing import Any

import anyio
import pytest

import toren.providers.anthropic  # noqa: F401  (the SDK import is paid here, not in a step)
from tests import limits_app
from tests.conftest import WorkerFactory, person, running_worker, wait_for
from tests.fuzz_mutations import LIMIT_MUTATIONS
from toren import Agent, Client, ConfigError
from toren._agent.model import ToolCall
from toren._core.limits import permits_of, usage
from toren.actors.runs.actor import RunActor
from toren.runs import (
    RUN_KIND,
    Agents,
    InvalidStart,
    StartRun,
    agent_route,
    cancel,
    read_run,
    run_status,
    start_run,
)
from toren.runs.limits import concurrency, set_agent_caps
from toren.testing import AnthropicServer, Reply

pytestmark = pytest.mark.anyio


def _results(body: dict[str, Any]) -> list[str]:
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


def script(body: dict[str, Any], n: int) -> Reply:
    """Each agent, by its system prompt: work a little (or call the callee), then answer."""
    system = body.get("system") or ""
    if isinstance(system, list):
        system = "".join(b.get("text", "") for b in system)
    seen = _results(body)
    if seen:
        return Reply(f"{system}: done ({seen[0]})")
    if system == "caller":
        return Reply([ToolCall(id="c1", name="call_callee", arguments={"input": "hi"})])
    if system == "callee":
        return Reply("callee: hello")
    return Reply([ToolCall(id="w1", name="work", arguments={"seconds": 0.05})])


def app() -> Agents:
    agents = Agents()
    agents.register([limits_app.serial, limits_app.capped, limits_app.caller, limits_app.callee])
    return agents


@contextlib.asynccontextmanager
async def model(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[AnthropicServer]:
    async with AnthropicServer(script) as server:
        for name, value in server.env().items():
            monkeypatch.setenv(name, value)
        yield server


@contextlib.asynccontextmanager
async def fleet(db_url: str, n: int = 3) -> AsyncIterator[None]:
    async with contextlib.AsyncExitStack() as stack:
        for _ in range(n):
            await stack.enter_async_context(running_worker(db_url, app()))
        yield


async def ended(client: Client, run_ids: list[str], timeout: float = 60.0) -> None:
    async def all_ended() -> bool:
        for rid in run_ids:
            if await run_status(client, rid) not in ("completed", "failed", "cancelled"):
                return False
        return True

    await wait_for(all_ended, timeout=timeout, what=f"{len(run_ids)} runs ended")


async def in_flight(client: Client, run_id: str) -> tuple[Any, Any]:
    """When the run started and completed, by the database's clock (its journal)."""
    entries = {e.type: e.at for e in await client.journal(run_id)}
    return entries["run.started"], entries["run.completed"]


async def test_a_keys_runs_never_overlap_and_keep_their_order_across_three_workers(
    client: Client, db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with model(monkeypatch), fleet(db_url):
        runs = [
            await start_run(client, "serial", f"job {i}", concurrency_key="chat-1")
            for i in range(6)
        ]
        other = await start_run(client, "serial", "elsewhere", concurrency_key="chat-2")
        await ended(client, [*runs, other])
    spans = [await in_flight(client, rid) for rid in runs]
    for (_, done), (start, _) in itertools.pairwise(spans):
        assert done < start  # the next run of the key started after this one completed
    assert [(await read_run(client, rid)).status for rid in runs] == ["completed"] * 6
    assert (await concurrency(client, runs[0])).key == "chat-1"
    [held] = await usage(client.pool, ["key/serial/chat-1"])
    assert (held.cap, held.held, held.queued) == (1, 0, 0)  # every permit handed back


def most_at_once(spans: list[tuple[Any, Any]]) -> int:
    """The most spans open at one instant (an end before a start at the same instant)."""
    edges = sorted([(s, 1) for s, _ in spans] + [(e, -1) for _, e in spans])
    most = now = 0
    for _, step in edges:
        now += step
        most = max(most, now)
    return most


async def test_an_agents_cap_holds_across_workers_and_is_reached_with_50_queued(
    client: Client, db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    await set_agent_caps(client.pool, app().registered())  # as a worker does at its boot
    runs = [await start_run(client, "capped", f"job {i}") for i in range(50)]
    [limit] = await usage(client.pool, ["agent/capped"])
    assert (limit.cap, limit.held, limit.queued) == (3, 3, 47)
    async with model(monkeypatch), fleet(db_url):
        await ended(client, runs, timeout=120)
    spans = [await in_flight(client, rid) for rid in runs]
    assert most_at_once(spans) == 3  # never more, and reached


async def test_a_keys_cap_and_its_agents_hold_together(
    client: Client, db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Runs under a key's cap of 1 and their agent's cap of 3: a run waiting for its agent's
    slot holds its key's; no two runs of a key overlap, no more than three run at once."""
    await set_agent_caps(client.pool, app().registered())
    keys = [f"k{i % 4}" for i in range(12)]
    runs = [
        await start_run(client, "capped", f"job {i}", concurrency_key=key)
        for i, key in enumerate(keys)
    ]
    usages = {u.name: u for u in await usage(client.pool, prefix="key/capped/")}
    assert [usages[f"key/capped/k{i}"].held for i in range(4)] == [1, 1, 1, 1]
    [agent] = await usage(client.pool, ["agent/capped"])
    assert (agent.held, agent.queued) == (3, 1)  # k3's first run holds its key, waits here
    async with model(monkeypatch), fleet(db_url):
        await ended(client, runs, timeout=120)
    spans = [await in_flight(client, rid) for rid in runs]
    assert most_at_once(spans) <= 3
    for key in set(keys):
        ordered = [span for span, k in zip(spans, keys, strict=True) if k == key]
        for (_, done), (start, _) in itertools.pairwise(ordered):
            assert done < start


async def test_capped_agents_calling_each_other_do_not_deadlock(
    client: Client, db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with model(monkeypatch), fleet(db_url, 2):
        runs = [await start_run(client, "caller", f"ask {i}") for i in range(3)]
        await ended(client, runs)
    for rid in runs:
        state = await read_run(client, rid)
        assert state.status == "completed", state.error
        assert state.output == "caller: done (callee: hello)"


async def test_a_run_cancelled_while_queued_ends_and_frees_its_place(
    client: Client, db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with model(monkeypatch) as server:
        hold = server.hold(1)  # the first run's first model call: it stays in flight
        async with fleet(db_url, 1):
            first = await start_run(client, "serial", "first", concurrency_key="k")
            await hold.arrived.wait()
            second = await start_run(client, "serial", "second", concurrency_key="k")
            third = await start_run(client, "serial", "third", concurrency_key="k")
            assert await run_status(client, second) == "queued"
            waiting = (await concurrency(client, third)).wait
            assert waiting is not None
            assert (waiting.limit, waiting.position) == ("key/serial/k", 2)

            await cancel(client, second, reason="not needed")

            async def cancelled() -> bool:
                return (await read_run(client, second)).status == "cancelled"

            await wait_for(cancelled, what="the queued run cancelled")
            assert await run_status(client, second) == "cancelled"

            async def third_is_next() -> bool:
                w = (await concurrency(client, third)).wait
                return w is not None and w.position == 1

            await wait_for(third_is_next, what="the third run first in line")
            assert await permits_of(client.pool, first) == ["key/serial/k"]
            hold.release()
            await ended(client, [first, third])
    assert (await read_run(client, second)).calls == ()
    [limit] = await usage(client.pool, ["key/serial/k"])
    assert (limit.held, limit.queued) == (0, 0)  # the cancelled run took no place again
    (_, first_done), (third_start, _) = (
        await in_flight(client, first),
        await in_flight(client, third),
    )
    assert first_done < third_start


async def test_a_killed_workers_run_keeps_its_slot_until_its_takeover(
    client: Client, db_url: str, monkeypatch: pytest.MonkeyPatch, workers: WorkerFactory
) -> None:
    async with model(monkeypatch) as server:
        hold = server.hold(1)
        doomed = workers("tests.limits_app")
        first = await start_run(client, "serial", "first", concurrency_key="k")
        second = await start_run(client, "serial", "second", concurrency_key="k")
        with anyio.fail_after(30):
            await hold.arrived.wait()  # the first run is in flight at the doomed worker
        doomed.kill()
        hold.release()
        # The permit is the run's, not the worker's: nobody else takes the slot meanwhile.
        assert await permits_of(client.pool, first) == ["key/serial/k"]
        assert await run_status(client, second) == "queued"
        async with fleet(db_url, 1):
            await ended(client, [first, second])
    (_, first_done), (second_start, _) = (
        await in_flight(client, first),
        await in_flight(client, second),
    )
    assert first_done < second_start
    assert await permits_of(client.pool, first) == []


async def test_the_step_that_ends_a_run_hands_its_slot_on(
    client: Client, db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In the commit that completes the first run, the second is given its permit: once the
    first is seen completed, the second is no longer queued (no worker polls the queue)."""
    monkeypatch.setattr(RunActor, "idle_seconds", 30.0)  # no passivation hands it on instead
    async with model(monkeypatch), fleet(db_url, 1):
        first = await start_run(client, "serial", "first", concurrency_key="k")
        second = await start_run(client, "serial", "second", concurrency_key="k")
        await ended(client, [first])
        assert await run_status(client, second) != "queued"
        await ended(client, [second])


async def test_a_dropped_hand_off_leaves_the_queue_waiting(
    client: Client, db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The mutation ``no-limit-handoff`` (the step's ``limits`` fragment without its release
    and hand-off) is caught: once the first run of a key completed, the second still waits."""
    monkeypatch.setattr(RunActor, "idle_seconds", 30.0)
    with LIMIT_MUTATIONS["no-limit-handoff"]():
        async with model(monkeypatch), fleet(db_url, 1):
            first = await start_run(client, "serial", "first", concurrency_key="k")
            second = await start_run(client, "serial", "second", concurrency_key="k")
            await ended(client, [first])
            assert await run_status(client, second) == "queued"  # the test above turns red


async def _beside(client: Client, server: AnthropicServer) -> tuple[str, str, Any]:
    """A run holding key ``k``'s slot (its model call held), and a run spawned under that key
    as a child run is (its permit taken at its first claim, not at its start)."""
    hold = server.hold(1)
    first = await start_run(client, "serial", "first", concurrency_key="k")
    await hold.arrived.wait()
    second = f"run/{uuid.uuid4()}"
    await client.spawn(
        RUN_KIND, second, {"agent": "serial"}, route=agent_route("serial"), limits=["key/serial/k"]
    )
    await client.send(second, StartRun(agent="serial", input="second", by=person("t")))
    return first, second, hold


async def test_a_run_woken_under_a_full_limit_waits_at_its_claim(
    client: Client, db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with model(monkeypatch) as server, fleet(db_url, 1):
        first, second, hold = await _beside(client, server)

        async def queued() -> bool:
            return await run_status(client, second) == "queued"

        await wait_for(queued, what="the second run queued at its claim")
        hold.release()
        await ended(client, [first, second])
    (_, first_done), (second_start, _) = (
        await in_flight(client, first),
        await in_flight(client, second),
    )
    assert first_done < second_start


async def test_a_dropped_cap_check_lets_a_woken_run_past_the_cap(
    client: Client, db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The mutation ``no-limit-check`` (the claim's ``limits`` fragment without the cap check)
    is caught: the second run completes while the first still holds the key's only slot."""
    with LIMIT_MUTATIONS["no-limit-check"]():
        async with model(monkeypatch) as server, fleet(db_url, 1):
            first, second, hold = await _beside(client, server)
            await ended(client, [second])
            assert await run_status(client, first) == "running"  # the cap of 1 is exceeded
            hold.release()
            await ended(client, [first])


async def test_bad_caps_and_keys_are_refused_with_nothing_stored(client: Client) -> None:
    for cap in (0, -1):
        with pytest.raises(ConfigError, match="max_runs must be at least 1"):
            Agent(name="a", model="anthropic/claude-sonnet-4-6", max_runs=cap)
    with pytest.raises(ConfigError, match="max_runs_per_key must be at least 1"):
        Agent(name="a", model="anthropic/claude-sonnet-4-6", max_runs_per_key=0)
    with pytest.raises(ConfigError, match="whole number"):
        Agent(name="a", model="anthropic/claude-sonnet-4-6", max_runs=True)
    before = await client.pool.fetchval("SELECT count(*) FROM toren.actors")
    for key, problem in (
        ("x" * 100_000, "at most 200 bytes"),
        ("é" * 101, "at most 200 bytes"),
        ("a\x00b", "NUL"),
        ("\ud800", "surrogates"),
        ("", "non-empty"),
    ):
        with pytest.raises(InvalidStart, match=problem):
            await start_run(client, "serial", "hi", concurrency_key=key)
    assert await client.pool.fetchval("SELECT count(*) FROM toren.actors") == before
    assert await usage(client.pool) == []


def test_limits_leave_the_request_digest_as_it_was() -> None:
    from toren.actors.runs.request import parameters

    plain = Agent(name="a", model="anthropic/claude-sonnet-4-6")
    capped = Agent(name="a", model="anthropic/claude-sonnet-4-6", max_runs=2, max_runs_per_key=3)
    assert parameters(plain) == parameters(capped)


async def test_a_settings_file_sets_caps(tmp_path: Any) -> None:
    from toren._agent.tables import read_agent_tables

    tables = read_agent_tables({"serial": {"max_runs": 4, "max_runs_per_key": 2}}, "toren.toml")
    assert dict(tables["serial"]) == {"max_runs": 4, "max_runs_per_key": 2}
    agents = Agents()
    [serial] = agents.register([limits_app.serial], tables)
    assert (serial.max_runs, serial.max_runs_per_key) == (4, 2)
    with pytest.raises(ConfigError, match="max_runs must be at least 1"):
        Agents().register([limits_app.serial], {"serial": {"max_runs": 0}})


async def test_surfaces_show_a_queued_run_and_refuse_bad_keys(client: Client, db_url: str) -> None:
    import aiohttp

    from tests.test_cli import toren
    from toren._surfaces.serve import serving
    from toren._surfaces.tokens import SCOPES, create_token

    await set_agent_caps(client.pool, app().registered())
    first = await start_run(client, "serial", "first", concurrency_key="k")
    second = await start_run(client, "serial", "second", concurrency_key="k")
    before = await client.pool.fetchval("SELECT count(*) FROM toren.actors")
    _, token = await create_token(client.pool, "ops", scopes=SCOPES)
    headers = {"Authorization": f"Bearer {token}"}
    async with serving(db_url, port=0) as base, aiohttp.ClientSession(headers=headers) as http:
        async with http.get(f"{base}/runs/{second.removeprefix('run/')}") as r:
            run = await r.json()
        assert run["status"] == "queued"
        assert run["concurrency_key"] == "k"
        assert run["queued"] == {"limit": "key/serial/k", "position": 1, "cap": 1}
        async with http.get(f"{base}/runs") as r:
            listed = {row["id"]: row for row in (await r.json())["runs"]}
        assert listed[second]["status"] == "queued"
        assert listed[second]["queue_position"] == 1
        assert listed[first]["status"] == "running"
        for key in ("é" * 150, "x" * 100_000, "a\x00b"):
            body = {"agent": "serial", "input": "hi", "concurrency_key": key}
            async with http.post(f"{base}/runs", json=body) as r:
                assert r.status == 422, key[:10]
                problem = await r.json()
            assert [e["field"] for e in problem["errors"]] == ["concurrency_key"]
    shown = await anyio.to_thread.run_sync(lambda: toren("jobs", "show", second, db_url=db_url))
    assert "status queued (waiting for key/serial/k (cap 1): position 1" in shown.stdout
    assert "concurrency key: k" in shown.stdout
    bad = await anyio.to_thread.run_sync(
        lambda: toren("run", "serial", "hi", "--concurrency-key", "é" * 150, db_url=db_url)
    )
    assert bad.returncode == 2, bad.stderr
    assert "200 bytes" in bad.stderr
    assert await client.pool.fetchval("SELECT count(*) FROM toren.actors") == before
