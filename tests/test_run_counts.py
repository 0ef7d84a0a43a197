"""Runs counted by status as they change (migration 0006), read by ``/metrics``: the counts
always equal a count of the runs, a step that keeps its status records nothing, concurrent
changes neither wait for each other nor deadlock, and a scrape reads no run."""

from __future__ import annotations

import contextlib
import json
import random
import uuid
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import anyio
import asyncpg
import pytest

import toren.providers.anthropic  # noqa: F401  (an SDK import takes seconds: paid here once)
from tests.conftest import decide_waiting, person, running_worker, wait_for
from toren import Client
from toren._agent.app import load_app
from toren._agent.model import ToolCall
from toren._core.leases import mark_failed
from toren._core.migrate import available, migrate
from toren._surfaces.serve import serving
from toren._surfaces.tokens import SCOPES, create_token
from toren.runs import RUN_KIND, cancel, read_run, retry, say, start_run
from toren.testing import AnthropicServer, Fail, Reply

pytestmark = pytest.mark.anyio

STATUSES = ("running", "parked", "completed", "failed", "cancelled")
FOLD_EVERY = 64  # toren.count_run_status folds at every 64th change


async def counted(db: asyncpg.Pool | asyncpg.Connection) -> dict[str, int]:
    """What ``/metrics`` reads."""
    rows = await db.fetch("SELECT status, n FROM toren.run_status_counts")
    return {r["status"]: r["n"] for r in rows}


async def actual(db: asyncpg.Pool | asyncpg.Connection) -> dict[str, int]:
    """The runs counted one by one."""
    rows = await db.fetch(
        "SELECT run_status, count(*) AS n FROM toren.actors WHERE kind = $1 GROUP BY 1", RUN_KIND
    )
    return {r["run_status"]: r["n"] for r in rows}


async def pending(db: asyncpg.Pool | asyncpg.Connection) -> int:
    """Changes not folded yet."""
    n: int = await db.fetchval("SELECT count(*) FROM toren.run_status_changes")
    return n


async def changes_ever(db: asyncpg.Pool | asyncpg.Connection) -> int:
    """Changes recorded since the migration, folded or not."""
    n: int = await db.fetchval(
        "SELECT CASE WHEN is_called THEN last_value ELSE 0 END FROM toren.run_status_changes_id_seq"
    )
    return n


async def insert_runs(db: asyncpg.Pool | asyncpg.Connection, statuses: list[str | None]) -> None:
    """Runs written straight into the table, as the benchmark writes them (None: no summary)."""
    await db.execute(
        "INSERT INTO toren.actors (actor_id, kind, summary) "
        "SELECT 'run/' || gen_random_uuid(), $1, "
        "       CASE WHEN s IS NULL THEN NULL ELSE jsonb_build_object('status', s) END "
        "FROM unnest($2::text[]) AS s",
        RUN_KIND,
        statuses,
    )


async def set_status(db: asyncpg.Pool | asyncpg.Connection, run_id: str, status: str) -> None:
    await db.execute(
        "UPDATE toren.actors SET summary = coalesce(summary, '{}') || jsonb_build_object("
        "'status', $2::text) WHERE actor_id = $1",
        run_id,
        status,
    )


@contextlib.asynccontextmanager
async def model(script: list[Reply], monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[None]:
    load_app("tests.run_app")
    async with AnthropicServer(script) as server:
        for name, value in server.env().items():
            monkeypatch.setenv(name, value)
        yield


async def reaches(client: Client, run_id: str, status: str, output: str | None = None) -> bool:
    """The run has the status (and output), and the counts agree with the runs."""
    state = await read_run(client, run_id)
    if state.status != status or (output is not None and state.output != output):
        return False
    return await counted(client.pool) == await actual(client.pool)


async def test_counts_follow_a_run_parked_resumed_completed_and_reopened_by_a_message(
    client: Client, db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    refund = ToolCall(id="r1", name="refund", arguments={"amount": 500})
    script = [Reply([refund]), Reply("Refunded."), Reply("Still here.")]
    async with model(script, monkeypatch):
        run_id = await start_run(client, "support", "refund please")  # before any worker
        assert await counted(client.pool) == {"running": 1}
        async with running_worker(db_url):
            await wait_for(lambda: reaches(client, run_id, "parked"), what="parked")
            assert await counted(client.pool) == {"parked": 1}
            await decide_waiting(client, run_id, approved=True, by=person("alice"))
            await wait_for(lambda: reaches(client, run_id, "completed"), what="completed")
            assert await counted(client.pool) == {"completed": 1}
            await say(client, run_id, "are you there?", by=person("bob"))
            await wait_for(
                lambda: reaches(client, run_id, "completed", "Still here."), what="reopened"
            )
    assert await counted(client.pool) == {"completed": 1}
    # Started, parked, resumed, completed, reopened, completed: six changes, each recorded once;
    # the run's other steps kept its status and recorded nothing.
    assert await changes_ever(client.pool) == 6
    steps = await client.pool.fetchval(  # a step's events share its transaction's now()
        "SELECT count(DISTINCT created_at) FROM toren.journal WHERE actor_id = $1", run_id
    )
    assert steps > 6


async def test_counts_follow_runs_that_fail_are_retried_and_are_cancelled(
    client: Client, db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TOREN_MODEL_RETRY_ATTEMPTS", "1")
    ticket = ToolCall(id="k1", name="create_ticket", arguments={"title": "x"})
    refund = ToolCall(id="p1", name="refund", arguments={"amount": 900})
    script = [Reply([ticket]), Fail(status=500), Fail(status=500), Reply("Done."), Reply([refund])]
    async with model(script, monkeypatch), running_worker(db_url):
        failing = await start_run(client, "strict", "open one")
        await wait_for(lambda: reaches(client, failing, "failed"), timeout=30, what="failed")
        assert await counted(client.pool) == {"failed": 1}
        await retry(client, failing, by=person("ops"))
        await wait_for(lambda: reaches(client, failing, "completed"), what="completed on retry")
        parked = await start_run(client, "support", "refund please")
        await wait_for(lambda: reaches(client, parked, "parked"), what="parked")
        assert await counted(client.pool) == {"completed": 1, "parked": 1}
        await cancel(client, parked, by=person("carol"), reason="duplicate")
        await wait_for(lambda: reaches(client, parked, "cancelled"), what="cancelled")
    assert await counted(client.pool) == {"completed": 1, "cancelled": 1}


async def test_a_run_the_kernel_gives_up_on_is_counted_failed(client: Client) -> None:
    await insert_runs(client.pool, ["running", "parked"])
    owner = uuid.uuid4()
    run_id = await client.pool.fetchval(
        "UPDATE toren.actors SET owner = $1, epoch = 1 WHERE run_status = 'running' "
        "RETURNING actor_id",
        owner,
    )
    assert await mark_failed(client.pool, run_id, RUN_KIND, owner, 1, "crash loop")
    assert await counted(client.pool) == await actual(client.pool) == {"failed": 1, "parked": 1}


async def test_a_step_that_keeps_its_status_records_no_change(client: Client) -> None:
    await insert_runs(client.pool, [None])
    run_id = await client.pool.fetchval("SELECT actor_id FROM toren.actors")
    await set_status(client.pool, run_id, "running")  # a summary now, the same status
    before = await pending(client.pool)
    for n in range(20):
        await client.pool.execute(
            "UPDATE toren.actors SET summary = summary || jsonb_build_object('calls_made', $2::int)"
            " WHERE actor_id = $1",
            run_id,
            n,
        )
    await client.pool.execute("UPDATE toren.actors SET epoch = epoch + 1, owner = NULL")
    assert await pending(client.pool) == before == 1
    assert await counted(client.pool) == {"running": 1}


async def test_actors_of_other_kinds_are_not_counted(client: Client) -> None:
    await client.pool.execute(
        "INSERT INTO toren.actors (actor_id, kind, summary) "
        "VALUES ('sandbox/a', 'toren.sandbox', '{\"status\": \"parked\"}'), ('x/b', 'other', NULL)"
    )
    await set_status(client.pool, "x/b", "completed")
    await client.pool.execute("DELETE FROM toren.actors WHERE actor_id = 'sandbox/a'")
    assert await pending(client.pool) == 0
    assert await counted(client.pool) == {}


async def test_changes_are_folded_so_a_scrape_reads_a_few_rows(client: Client) -> None:
    await insert_runs(client.pool, [None] * 10)
    ids = [r["actor_id"] for r in await client.pool.fetch("SELECT actor_id FROM toren.actors")]
    for n in range(300):
        await set_status(client.pool, ids[n % 10], STATUSES[n % 4])
    assert await pending(client.pool) < FOLD_EVERY
    assert await client.pool.fetchval("SELECT count(*) FROM toren.run_counts") <= len(STATUSES)
    assert await counted(client.pool) == await actual(client.pool)


async def test_the_scrape_reads_the_counts_and_no_run(client: Client) -> None:
    plan = await client.pool.fetchval(
        "EXPLAIN (FORMAT JSON) SELECT status, n FROM toren.run_status_counts"
    )

    def relations(node: dict[str, Any]) -> set[str]:
        found = {node["Relation Name"]} if "Relation Name" in node else set()
        for child in node.get("Plans", []):
            found |= relations(child)
        return found

    assert relations(json.loads(plan)[0]["Plan"]) == {"run_counts", "run_status_changes"}


_SPAWN_AND_PARK = """
WITH sp AS (
    INSERT INTO toren.actors (actor_id, kind, parent) VALUES ($1, $3, $2) RETURNING 1
), summed AS (
    UPDATE toren.actors SET summary = '{"status": "parked"}' WHERE actor_id = $2 RETURNING 1
)
SELECT (SELECT count(*) FROM sp), (SELECT count(*) FROM summed)
"""


async def _churn(db_url: str, worker: int, rounds: int) -> None:
    """Steps as the kernel commits them (one statement each: a run that spawns a child and
    parks, a run that changes status), and transactions that change several runs' statuses in
    random orders and statements, some deleting a run, some rolled back."""

    class Rollback(Exception):
        pass

    rng = random.Random(worker)
    conn = await asyncpg.connect(db_url)
    try:
        mine = [f"run/w{worker}-{k}" for k in range(6)]
        await conn.execute(
            "INSERT INTO toren.actors (actor_id, kind) SELECT unnest($1::text[]), $2",
            mine,
            RUN_KIND,
        )
        for t in range(rounds):
            await conn.execute(
                _SPAWN_AND_PARK, f"run/w{worker}-step-{t}", rng.choice(mine), RUN_KIND
            )
            await set_status(conn, rng.choice(mine), rng.choice(STATUSES))
            with contextlib.suppress(Rollback):
                async with conn.transaction():
                    for run_id in rng.sample(mine, 3):
                        await set_status(conn, run_id, rng.choice(STATUSES))
                    if t % 5 == 0:
                        await conn.execute(
                            _SPAWN_AND_PARK, f"run/w{worker}-child-{t}", rng.choice(mine), RUN_KIND
                        )
                    if t % 7 == 3:
                        await conn.execute(
                            "DELETE FROM toren.actors WHERE actor_id = ("
                            "SELECT actor_id FROM toren.actors WHERE actor_id LIKE $1 LIMIT 1)",
                            f"run/w{worker}-child-%",
                        )
                    if t % 8 == 7:
                        raise Rollback
    finally:
        await conn.close()


async def test_concurrent_transitions_from_many_connections_are_exact_and_never_deadlock(
    client: Client, db_url: str
) -> None:
    with anyio.fail_after(120):
        async with anyio.create_task_group() as tg:
            for worker in range(24):
                tg.start_soon(_churn, db_url, worker, 60)
    assert await counted(client.pool) == await actual(client.pool)
    assert sum((await counted(client.pool)).values()) > 24 * 6
    assert await pending(client.pool) < 16 * FOLD_EVERY  # folds kept up


async def test_deleted_and_truncated_runs_leave_the_counts(client: Client) -> None:
    await insert_runs(client.pool, [None, "parked", "completed", "completed", "failed"])
    await client.pool.execute(
        "DELETE FROM toren.actors WHERE run_status IN ('completed', 'running')"
    )
    assert await counted(client.pool) == {"parked": 1, "failed": 1}
    await client.pool.execute("TRUNCATE toren.actors CASCADE")
    assert await counted(client.pool) == {}
    await insert_runs(client.pool, ["parked"])
    assert await counted(client.pool) == {"parked": 1}


async def migrated_before(conn: asyncpg.Connection, migration: str) -> None:
    """Schema ``toren`` as the migrations before ``migration`` (its name) left it."""
    await conn.execute(
        "CREATE SCHEMA toren; CREATE TABLE toren.schema_migrations ("
        " version integer PRIMARY KEY, name text NOT NULL,"
        " applied_at timestamptz NOT NULL DEFAULT now())"
    )
    for version, name, sql in available():
        if name == migration:
            break
        await conn.execute(sql)
        await conn.execute(
            "INSERT INTO toren.schema_migrations (version, name) VALUES ($1, $2)", version, name
        )


async def test_the_migration_counts_the_runs_that_exist_before_it(empty_db_url: str) -> None:
    conn = await asyncpg.connect(empty_db_url)
    try:
        await migrated_before(conn, "run_counts")
        await insert_runs(conn, [None] * 3 + ["parked"] * 2 + ["completed"] * 5 + ["failed"])
        await conn.execute("INSERT INTO toren.actors (actor_id, kind) VALUES ('x/y', 'other')")
        assert [v for v, _, _ in available()][-1] in await migrate(conn)
        assert await counted(conn) == {"running": 3, "parked": 2, "completed": 5, "failed": 1}
        await conn.execute("UPDATE toren.actors SET summary = NULL WHERE run_status = 'failed'")
        after = {"running": 4, "parked": 2, "completed": 5}
        assert await counted(conn) == await actual(conn) == after
    finally:
        await conn.close()


async def test_metrics_shows_the_counts(client: Client, db_url: str) -> None:
    await insert_runs(
        client.pool,
        [None] * 7 + ["parked"] * 3 + ["completed"] * 500 + ["failed"] + ["cancelled"] * 2,
    )
    _, token = await create_token(client.pool, "ops", scopes=SCOPES)
    headers = {"Authorization": f"Bearer {token}"}
    async with (
        serving(db_url, port=0) as base,
        aiohttp.ClientSession(headers=headers) as http,
        http.get(f"{base}/metrics") as r,
    ):
        assert r.status == 200
        text = await r.text()
    shown = {"running": 7, "parked": 3, "completed": 500, "failed": 1, "cancelled": 2}
    for status, n in shown.items():
        assert f'toren_runs{{status="{status}"}} {n:.1f}' in text
    assert "toren_workers_live 0.0" in text


async def test_a_repeatable_read_transaction_does_not_fold_and_does_not_fail(
    client: Client, db_url: str
) -> None:
    # Its snapshot may still see changes another fold has moved: deleting them again would be a
    # serialization failure of the caller's transaction (a spawn in the caller's transaction).
    await insert_runs(client.pool, [None, None, "parked"])
    run_id = await client.pool.fetchval("SELECT actor_id FROM toren.actors LIMIT 1")
    conn = await asyncpg.connect(db_url)
    try:
        async with conn.transaction(isolation="repeatable_read"):
            assert await pending(conn) == 3  # the snapshot is taken
            assert await client.pool.fetchval("SELECT toren.fold_run_status_changes()")
            assert not await conn.fetchval("SELECT toren.fold_run_status_changes()")
            await set_status(conn, run_id, "completed")
    finally:
        await conn.close()
    assert await counted(client.pool) == await actual(client.pool)
