"""The kernel's own queries on its tables (``toren/_core/rows.py``, ``journal_reads.py``): what
the layers above read and write through, generic over kinds, on a real Postgres."""

from __future__ import annotations

import json
from typing import Any

import pytest

from toren import Client
from toren._core.journal_reads import actor_and_events, events, events_after, last_seq
from toren._core.rows import (
    actor_row,
    actor_rows,
    actors_of_kind,
    descendants,
    queued,
    revive,
    set_args,
)

pytestmark = pytest.mark.anyio


async def _actor(client: Client, actor_id: str, kind: str = "k", **columns: Any) -> None:
    await client.spawn(kind, actor_id, columns.pop("args", {}), route=columns.pop("route", None))
    for column, value in columns.items():
        await client.pool.execute(
            f"UPDATE toren.actors SET {column} = $2 WHERE actor_id = $1", actor_id, value
        )


async def _journal(client: Client, actor_id: str, *entries: tuple[str, Any]) -> None:
    for seq, (kind, data) in enumerate(entries, start=1):
        await client.pool.execute(
            "INSERT INTO toren.journal (actor_id, seq, epoch, type, data) "
            "VALUES ($1, $2, 0, $3, $4)",
            actor_id,
            seq,
            kind,
            data,
        )


async def test_a_row_carries_only_the_large_fields_and_keys_asked_for(client: Client) -> None:
    await _actor(client, "a/1", args={"agent": "x", "big": "y" * 1000}, summary={"status": "s"})
    row = await actor_row(client.pool, "a/1", fields=("args.agent", "summary"))
    assert row is not None
    assert (row.kind, row.status, row.args, row.summary) == (
        "k",
        "live",
        {"agent": "x"},
        {"status": "s"},
    )
    assert row.failure is None
    bare = await actor_row(client.pool, "a/1")
    assert bare is not None
    assert bare.args is None
    assert bare.summary is None
    assert await actor_row(client.pool, "a/1", kind="other") is None
    assert await actor_row(client.pool, "a/2") is None
    for bad in ("args.x'--", "owner", "failure.x", "summary.a b"):
        with pytest.raises(ValueError, match="not a"):
            await actor_row(client.pool, "a/1", fields=(bad,))


async def test_rows_of_a_kind_filter_order_and_page(client: Client) -> None:
    for n in range(5):
        await _actor(
            client, f"r/{n}", "toren.run", args={"agent": "ab"[n % 2]}, route=f"agent:{'ab'[n % 2]}"
        )
    await _actor(client, "other/1", "k")
    newest = await actors_of_kind(client.pool, "toren.run")
    assert [r.actor_id for r in newest] == [f"r/{n}" for n in reversed(range(5))]
    by_route = await actors_of_kind(client.pool, "toren.run", route="agent:a")
    assert [r.actor_id for r in by_route] == ["r/4", "r/2", "r/0"]
    page = await actors_of_kind(client.pool, "toren.run", limit=2)
    last = page[-1]
    rest = await actors_of_kind(client.pool, "toren.run", before=(last.created_at, last.actor_id))
    assert [r.actor_id for r in page + rest] == [r.actor_id for r in newest]
    by_agent = await actors_of_kind(client.pool, "toren.run", args={"agent": "b"}, order="oldest")
    assert [r.actor_id for r in by_agent] == ["r/1", "r/3"]
    since = await actors_of_kind(client.pool, "toren.run", since=newest[1].created_at, order="id")
    assert [r.actor_id for r in since] == ["r/4"]
    await client.pool.execute(
        "UPDATE toren.actors SET summary = '{\"status\": \"completed\"}' WHERE actor_id = 'r/3'"
    )
    done = await actors_of_kind(client.pool, "toren.run", run_status="completed")
    assert [r.actor_id for r in done] == ["r/3"]
    kept = await actors_of_kind(client.pool, "toren.run", summary_not={"status": "completed"})
    assert "r/3" not in {r.actor_id for r in kept}
    assert len(kept) == 4
    assert [r.actor_id for r in await actor_rows(client.pool, ["r/3", "nope", "r/1"])] == [
        "r/1",
        "r/3",
    ]
    # A keyset page is of the newest first; an order misspelled is named.
    with pytest.raises(ValueError, match="newest first only"):
        await actors_of_kind(client.pool, "toren.run", before=(last.created_at, "r/0"), order="id")
    with pytest.raises(ValueError, match="order must be one of newest, oldest, id"):
        await actors_of_kind(client.pool, "toren.run", order="latest")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="not a kind's name"):
        await actors_of_kind(client.pool, "toren.run' OR true --")


async def test_descendants_follow_a_summary_list_in_one_query_nearest_first(client: Client) -> None:
    tree = {"p": ["c1", "c2"], "c1": ["g1"], "g1": ["p"], "c2": "not a list"}
    for actor_id, children in tree.items():
        await _actor(client, actor_id, "t", summary={"children": children, "n": actor_id})
    await _actor(client, "x", "other", summary={"children": []})
    await client.pool.execute(
        "UPDATE toren.actors SET summary = '{\"children\": [\"x\"]}' WHERE actor_id = 'c2'"
    )
    found = await descendants(client.pool, "p", kind="t", fields=("summary.n",))
    assert [(r.actor_id, depth, r.summary) for r, depth in found] == [
        ("c1", 1, {"n": "c1"}),
        ("c2", 1, {"n": None}),
        ("g1", 2, {"n": "g1"}),
        ("p", 3, {"n": "p"}),
    ]  # fmt: skip  (a cycle ends at max_depth; a child of another kind is not followed)
    assert len(await descendants(client.pool, "p", kind="t", max_depth=1)) == 2


async def test_writes_set_arguments_and_revive_a_failed_actor(client: Client) -> None:
    await _actor(client, "w/1", args={"a": 1}, status="failed", failure="boom")
    assert await set_args(client.pool, "w/1", {"a": 2})
    assert not await set_args(client.pool, "w/1", {"a": 2})  # the same already
    assert await revive(client.pool, "w/1", kind="other") is False
    assert await revive(client.pool, "w/1", kind="k")
    row = await actor_row(client.pool, "w/1", fields=("args", "failure"))
    assert row is not None
    assert (row.status, row.failure, row.args) == ("live", None, {"a": 2})
    assert not await revive(client.pool, "w/1", kind="k")  # live already


async def test_journal_reads_filter_by_type_and_data(client: Client) -> None:
    await _actor(client, "j/1")
    await _actor(client, "j/2")
    await _journal(
        client,
        "j/1",
        ("t.a", {"call_id": "c1", "cwd": "/w", "content": "x" * 100}),
        ("t.b", {"call_id": "c2"}),
        ("t.a", {"call_id": "c3"}),
    )
    await _journal(client, "j/2", ("t.a", 7))
    assert [e.seq for e in await events(client.pool, "j/1")] == [1, 2, 3]
    assert [e.seq for e in await events(client.pool, "j/1", after=1, limit=1)] == [2]
    assert [e.seq for e in await events(client.pool, "j/1", types=("t.a",))] == [1, 3]
    asked = await events(
        client.pool,
        "j/1",
        match={"call_id": ["c1", "c3"]},
        present=("cwd",),
        keys=("call_id", "cwd"),
    )
    assert [e.data for e in asked] == [{"call_id": "c1", "cwd": "/w"}]
    [slim] = await events(client.pool, "j/1", types=("t.a",), without=("content",), limit=1)
    assert slim.data == {"call_id": "c1", "cwd": "/w"}
    assert slim.at is not None
    batched = await events_after(client.pool, [("j/2", 0), ("j/1", 1)], limit=1)
    assert [(a, e.seq, e.data) for a, e in batched] == [
        ("j/1", 2, {"call_id": "c2"}),
        ("j/2", 1, 7),
    ]
    assert (await last_seq(client.pool, "j/1"), await last_seq(client.pool, "none")) == (3, None)
    found = await actor_and_events(client.pool, "j/1", after=2)
    assert found is not None
    assert found[0].kind == "k"
    assert [e.seq for e in found[1]] == [3]
    quiet = await actor_and_events(client.pool, "j/1", after=3)
    assert quiet is not None
    assert quiet[1] == []
    assert await actor_and_events(client.pool, "none", after=0) is None
    await client.pool.execute(
        "INSERT INTO toren.mailbox (actor_id, kind, body) VALUES ('j/1', 'm.x', '{}'), "
        "('j/1', 'm.x', '{}'), ('j/2', 'm.y', '{}')"
    )
    assert await queued(client.pool, ["j/1", "j/2", "j/3"], "m.x") == {"j/1"}
    assert await queued(client.pool, [], "m.x") == set()


async def test_the_run_listing_uses_its_indexes(client: Client) -> None:
    """Each filter of the run listing is its own statement, planned for its index."""
    await client.pool.execute(
        "INSERT INTO toren.actors (actor_id, kind, route) "
        "SELECT 'run/' || gen_random_uuid(), 'toren.run', 'agent:a' || (n % 50) "
        "FROM generate_series(1, 5000) n"
    )
    await client.pool.execute("ANALYZE toren.actors")
    statements: list[str] = []
    async with client.pool.acquire() as conn:
        conn.add_query_logger(lambda q: statements.append(q.query))  # (and the type codecs')
        await actors_of_kind(conn, "toren.run", run_status="completed", limit=50)
        await actors_of_kind(conn, "toren.run", route="agent:a3", limit=50)
    ours = [s for s in statements if "FROM toren.actors" in s]
    for statement, index, value in zip(
        ours,
        ("actors_runs_by_status", "actors_runs_by_route"),
        ("completed", "agent:a3"),
        strict=True,
    ):
        plan = await client.pool.fetchval(f"EXPLAIN (FORMAT JSON) {statement}", value, 50)
        assert index in json.dumps(plan), plan
