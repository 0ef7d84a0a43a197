"""Postgres failover under the workers, in the middle of runs (see :mod:`chaos.failover`): a
Patroni cluster of two servers with synchronous replication, started on 127.0.0.1 by the test.

Without etcd, Postgres's binaries, PgBouncer or Patroni 4 (``scripts/patroni-venv``) the tests
are skipped, saying what is missing; under ``CI=true`` they fail instead: CI must run them.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import asyncpg
import pytest

from chaos import ha
from chaos.conftest import SCENARIOS
from chaos.failover import FailoverResult, failover, primary_first, through_bouncer
from chaos.harness import Cell, Harness
from chaos.oracle import Expected, Observed
from toren import Settings
from toren.kernel import WorkerSession

pytestmark = [pytest.mark.anyio, pytest.mark.processes]


def _needs(*, bouncer: bool = False) -> None:
    reason = ha.missing(bouncer=bouncer)
    if reason is None:
        return
    if os.environ.get("CI") == "true":
        pytest.fail(f"the failover tests need, in CI: {reason}")
    print(f"failover tests skipped: missing {reason}")
    pytest.skip(f"missing {reason}")


@pytest.fixture(scope="module")
async def cluster() -> AsyncIterator[ha.Cluster]:
    _needs()
    async with ha.Cluster() as c:
        yield c


@pytest.fixture(scope="module")
async def ha_harness(cluster: ha.Cluster, chaos_workdir: Path) -> AsyncIterator[Harness]:
    async with Harness(cluster.url(), chaos_workdir / "failover") as h:
        yield h


@pytest.fixture(scope="module")
async def ha_expected(ha_harness: Harness) -> Expected:
    """The chaos agent's run, without a fault, on the cluster."""
    result, seen = await ha_harness.run_cell(Cell("clean", 0, None), None)
    assert isinstance(seen, Observed)
    assert result.passed, result.problems
    assert seen.state.status == "completed"
    return Expected(
        output=seen.state.output or "",
        steps=len(seen.state.calls),
        effect_kinds=tuple(sorted(e.kind for e in seen.effects)),
    )


def _report(result: FailoverResult) -> None:
    SCENARIOS.append(result.scenario)
    first = "none" if result.first_step_after is None else f"{result.first_step_after:.2f}s"
    print(
        f"{result.scenario.line()}; promoted after {result.promoted_after:.2f}s, first step "
        f"committed after {first}, old primary rejoined after {result.rejoined_after:.1f}s"
    )


async def test_runs_complete_when_the_primarys_postmaster_is_killed(
    cluster: ha.Cluster, ha_harness: Harness, ha_expected: Expected
) -> None:
    result = await failover(ha_harness, cluster, "postmaster", ha_expected)
    _report(result)
    assert result.scenario.passed, "\n".join(result.scenario.problems)
    assert result.first_step_after is not None


async def test_runs_complete_on_the_new_primary_when_the_old_ones_patroni_is_killed(
    cluster: ha.Cluster, ha_harness: Harness, ha_expected: Expected
) -> None:
    result = await failover(ha_harness, cluster, "patroni", ha_expected)
    _report(result)
    assert result.scenario.passed, "\n".join(result.scenario.problems)
    assert result.first_step_after is not None


async def test_a_workers_lock_and_listen_hold_through_pgbouncer_in_session_mode(
    cluster: ha.Cluster, ha_harness: Harness
) -> None:
    _needs(bouncer=True)
    await primary_first(ha_harness, cluster)
    leader = await cluster.leader()
    async with ha.bouncer(cluster, leader) as bouncer, ha_harness.database() as direct:
        via = bouncer.url(direct.rsplit("/", 1)[1].split("?")[0])
        session = await WorkerSession.open(via, Settings(database_url=via))
        heard: list[str] = []
        await session.listen(heard.append)
        conn = await asyncpg.connect(cluster.node_url(leader, via.rsplit("/", 1)[1]))
        try:
            held = (
                "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted "
                "AND objid = $1::bigint::oid"
            )
            assert await conn.fetchval(held, session.lock_key) == 1
            await conn.execute("SELECT pg_notify('toren_mail', 'run/heard')")
            with anyio.fail_after(10):
                while heard != ["run/heard"]:
                    await anyio.sleep(0.02)
            await session.close()
            with anyio.fail_after(10):
                while await conn.fetchval(held, session.lock_key):
                    await anyio.sleep(0.02)
        finally:
            await conn.close()


async def test_runs_complete_on_workers_that_reach_postgres_through_pgbouncer(
    cluster: ha.Cluster, ha_harness: Harness, ha_expected: Expected
) -> None:
    _needs(bouncer=True)
    await primary_first(ha_harness, cluster)
    async with ha.bouncer(cluster, await cluster.leader()) as bouncer:
        result = await through_bouncer(ha_harness, bouncer, ha_expected)
    SCENARIOS.append(result)
    print(result.line())
    assert result.passed, "\n".join(result.problems)


async def test_pgbouncer_is_pointed_at_another_server_by_its_file_and_a_reload(
    cluster: ha.Cluster,
) -> None:
    """What a failover hook does (PgBouncer does not follow a failover by itself): new
    connections through it reach the server its rewritten file names."""
    _needs(bouncer=True)
    leader = await cluster.leader()
    async with ha.bouncer(cluster, cluster.other(leader)) as bouncer:
        assert await _read_only_through(bouncer) == "on"  # the replica
        bouncer.point_at(leader)
        with anyio.fail_after(10):
            while await _read_only_through(bouncer) != "off":
                await anyio.sleep(0.05)


async def _read_only_through(bouncer: ha.Bouncer) -> str:
    conn = await asyncpg.connect(bouncer.url())
    try:
        return str(await conn.fetchval("SHOW transaction_read_only"))
    finally:
        await conn.close()
