"""Idempotency keys are scoped per agent (issue 26): the same key for two agents starts two runs,
a conflict is only ever with a run of the same agent, and a run an earlier version started under
a key (its id derived from the key alone) is still found by a start retried across the upgrade."""

from __future__ import annotations

import json
import uuid
from typing import Any

import aiohttp
import anyio
import pytest

from tests.conftest import person, wait_for
from toren import Client
from toren._surfaces.serve import serving
from toren._surfaces.tokens import create_token
from toren.runs import RUN_KIND, IdempotencyConflict, StartRun, agent_route, start_run
from toren.runs.client import _start_digest

pytestmark = pytest.mark.anyio

# How versions before per-agent keys derived a keyed run's id: uuid5 of the key alone.
OLD_NAMESPACE = uuid.UUID("7c1f4f7e-3b0a-4f59-9a55-2f1c9b1d8e42")


def old_run_id(key: str) -> str:
    return f"run/{uuid.uuid5(OLD_NAMESPACE, key)}"


async def start_as_before(client: Client, agent: str, text: str, key: str) -> str:
    """Start a run as the version before the upgrade did (see :func:`spawn_as_before`)."""
    async with client.pool.acquire() as conn, conn.transaction():
        return await spawn_as_before(client, conn, agent, text, key)


async def spawn_as_before(client: Client, conn: Any, agent: str, text: str, key: str) -> str:
    """What that version's start did in its transaction (``conn``'s): spawn the run under the
    key's old id (its row recording the start's digest) and queue its start."""
    run_id = old_run_id(key)
    args = {"agent": agent, "start": _start_digest(agent, text)}
    assert await client.spawn(RUN_KIND, run_id, args, route=agent_route(agent), conn=conn)
    start = StartRun(agent=agent, input=text, by=person("old"))
    await client.send(run_id, start, dedupe_key="start", conn=conn)
    return run_id


async def _runs(client: Client) -> list[tuple[str, str]]:
    rows = await client.pool.fetch(
        "SELECT actor_id, args->>'agent' AS agent FROM toren.actors WHERE kind = $1 "
        "ORDER BY created_at",
        RUN_KIND,
    )
    return [(r["actor_id"], r["agent"]) for r in rows]


async def _starts(client: Client) -> list[str]:
    rows = await client.pool.fetch(
        "SELECT actor_id FROM toren.mailbox WHERE kind = 'run.start' ORDER BY id"
    )
    return [r["actor_id"] for r in rows]


async def test_one_key_over_http_starts_one_run_per_agent_and_never_shows_the_other(
    client: Client, db_url: str
) -> None:
    scopes = ["read", "operate"]
    _, mine = await create_token(client.pool, "support-ops", scopes=scopes, agents=["support"])
    _, theirs = await create_token(client.pool, "strict-ops", scopes=scopes, agents=["strict"])
    key = "order-17"
    started: dict[str, str] = {}
    async with serving(db_url, port=0) as base:
        for agent, token, text in (
            ("support", mine, "Refund me"),
            ("strict", theirs, "Refund me"),  # the same key and input, another agent
            ("strict", theirs, "Refund me"),  # repeated: its own run again
        ):
            headers = {"Authorization": f"Bearer {token}"}
            body = {"agent": agent, "input": text, "idempotency_key": key}
            async with (
                aiohttp.ClientSession(headers=headers) as http,
                http.post(f"{base}/runs", json=body) as r,
            ):
                answer = await r.text()
                assert r.status == 201, answer
            run_id = json.loads(answer)["id"]
            assert started.get(agent, run_id) == run_id, (agent, answer)
            started[agent] = run_id
            others = [rid for a, rid in started.items() if a != agent]
            assert not any(o.removeprefix("run/") in answer for o in others), answer
    assert started["support"] != started["strict"]
    assert sorted(await _runs(client)) == sorted((rid, a) for a, rid in started.items())
    assert sorted(await _starts(client)) == sorted(started.values())


async def test_a_run_started_before_the_upgrade_is_found_by_the_same_agent_key_and_input(
    client: Client,
) -> None:
    before = await start_as_before(client, "support", "Refund me", "order-17")
    again = await start_run(client, "support", "Refund me", idempotency_key="order-17")
    assert again == before
    assert await _runs(client) == [(before, "support")]
    assert await _starts(client) == [before]  # its start is not queued twice
    with pytest.raises(IdempotencyConflict) as conflict:
        await start_run(client, "support", "Refund me twice", idempotency_key="order-17")
    assert conflict.value.run_id == before
    assert await _runs(client) == [(before, "support")]


async def test_a_key_conflicts_only_with_a_run_of_the_same_agent(client: Client) -> None:
    first = await start_run(client, "support", "Refund me", idempotency_key="k1")
    with pytest.raises(IdempotencyConflict) as conflict:
        await start_run(client, "support", "Refund me twice", idempotency_key="k1")
    assert conflict.value.run_id == first
    other = await start_run(client, "strict", "Refund me twice", idempotency_key="k1")
    assert other != first
    # An earlier version's run of another agent under a key is neither taken nor shown.
    theirs = await start_as_before(client, "strict", "Audit", "k2")
    mine = await start_run(client, "support", "Something else", idempotency_key="k2")
    assert mine not in (theirs, first, other)
    assert await start_run(client, "support", "Something else", idempotency_key="k2") == mine
    assert dict(await _runs(client)) == {
        first: "support",
        other: "strict",
        theirs: "strict",
        mine: "support",
    }


async def test_a_start_waits_for_an_earlier_versions_start_of_the_same_key_in_flight(
    client: Client,
) -> None:
    """During a rolling upgrade a start retried on an upgraded server, while the old server's
    start of the same key is still in its transaction, finds that run once it commits."""
    key = "order-42"
    old_id = old_run_id(key)
    found: list[str] = []

    async def retried() -> None:
        found.append(await start_run(client, "support", "Refund me", idempotency_key=key))

    async def waiting() -> bool:
        n = await client.pool.fetchval(
            "SELECT count(*) FROM pg_stat_activity "
            "WHERE datname = current_database() AND wait_event_type = 'Lock'"
        )
        return bool(n)

    async with client.pool.acquire() as conn:
        tx = conn.transaction()
        await tx.start()
        assert await spawn_as_before(client, conn, "support", "Refund me", key) == old_id
        async with anyio.create_task_group() as tg:
            tg.start_soon(retried)
            await wait_for(waiting, timeout=10, what="the retried start to wait for the old one")
            await tx.commit()
    assert found == [old_id]
    assert await _runs(client) == [(old_id, "support")]
    assert await _starts(client) == [old_id]
