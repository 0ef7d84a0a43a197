"""Postgres failover in the middle of runs: the chaos agent's runs on workers connected to a
Patroni cluster (:mod:`chaos.ha`) through a multi-host URL, and one of two faults of its primary.

- ``postmaster``: the primary's postmaster is SIGKILLed; Patroni promotes the sync standby, every
  connection drops at once, the workers reconnect to the new primary, the old one rejoins as a
  replica by itself.
- ``patroni``: the primary's Patroni is SIGKILLed; its Postgres stays up, managed by nobody. Its
  leader key is deleted from etcd (what its TTL, 20 s, would do) so the standby is promoted at
  once; from then on the old primary is a stale primary whose commits block (its sync standby is
  gone) and which ``target_session_attrs=read-write`` still accepts. The runs must finish on the
  new primary while it stands; then its Patroni is restarted (its orphaned Postgres stopped
  first) and it rejoins as a replica.

What must hold, besides the chaos oracle's checks on every run (its output, each effect once, no
model call paid twice except the one in flight at the fault, a clean journal, no dead letter):
every run completes; every journal row read from the primary just before the fault is still
there after; the old primary rejoins. The result says how long the failover cost: from the
primary's death to the first step committed after it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Literal
from urllib.parse import urlsplit

import anyio
import asyncpg
import attrs

from chaos.ha import Bouncer, Cluster, Node
from chaos.harness import Harness
from chaos.oracle import Expected, meant_for
from chaos.scenarios import CHAOS, Fleet, ScenarioResult, _fleet
from toren import Client, DatabaseUnavailable
from toren._core.primary import probe
from toren._core.session import LIVE_WORKERS
from toren.kernel import TRANSIENT_DB_ERRORS
from toren.runs import ENDED, decide, read_run, waiting_on

Fault = Literal["postmaster", "patroni"]


@attrs.frozen
class FailoverResult:
    scenario: ScenarioResult
    promoted_after: float  # seconds from the fault to the standby answering as primary
    # seconds from the primary's death (the promotion, when its Patroni was killed: until then it
    # committed) to the first step committed after it
    first_step_after: float | None
    rejoined_after: float  # seconds from the fault to the old primary streaming as a replica


async def primary_first(harness: Harness, cluster: Cluster) -> None:
    """List the primary first in the harness's URL: asyncpg moves on to the next server only
    when one refuses connections or is starting up, not when a replica refuses the login (for a
    database it has not replayed yet: a scenario's own, just made)."""
    leader = await cluster.leader()
    harness.server_url = cluster.url(nodes=(leader, cluster.other(leader)))


async def _journal(client: Client) -> set[tuple[str, int, str]]:
    rows = await client.pool.fetch("SELECT actor_id, seq, type FROM toren.journal")
    return {(r["actor_id"], r["seq"], r["type"]) for r in rows}


class _Follower:
    """Keeps the test's own client on the server Patroni calls primary. The test's client is no
    worker and does not route itself (nor do API servers: docs/operations.md): on a stale
    primary its reads would show the runs as they were, and its decisions would hang."""

    def __init__(self, fleet: Fleet, cluster: Cluster, database: str, on: Node) -> None:
        self.fleet = fleet
        self.cluster = cluster
        self.database = database
        self.on: Node | None = on

    async def follow(self, *, until: float = 0) -> None:
        """Move the client to Patroni's primary if it is elsewhere (trying again until the
        monotonic time ``until``, if given)."""
        await self._follow()
        while self.on is not await self.cluster.leader() and time.monotonic() < until:
            await anyio.sleep(0.1)
            await self._follow()

    async def _follow(self) -> None:
        leader = await self.cluster.leader()
        if leader is self.on:
            return
        # The leader alone: Patroni names it before its promotion ends, and a URL that named the
        # other server too would then connect there (a stale primary still takes read-write
        # connections), and the client would stay on it, reading what it no longer commits.
        url = self.cluster.url(self.database, nodes=(leader,))
        try:
            client = await Client.connect(url)
        except DatabaseUnavailable:
            return  # not writable yet: try again later
        old, self.fleet.client = self.fleet.client, client
        self.on = leader
        old.pool.terminate()


async def _drive(fleet: Fleet, follower: _Follower) -> None:
    """Approve what waits; note the runs that ended; on the primary Patroni names."""
    decided: set[str] = set()
    while True:
        try:
            await follower.follow()
            with anyio.fail_after(2):
                for run_id in fleet.runs:
                    if run_id in fleet.done:
                        continue
                    state = await read_run(fleet.client, run_id)
                    if state.status in ENDED:
                        fleet.done.add(run_id)
                    elif waiting_on(state) and run_id not in decided:
                        for call in waiting_on(state):
                            await decide(
                                fleet.client,
                                run_id,
                                call_id=call.id,
                                approved=True,
                                by=CHAOS,
                                reason=meant_for(call.id),
                                wait=None,
                            )
                        decided.add(run_id)
        except TimeoutError:
            follower.on = None  # a decision that hung: reconnect, and send it again
        except (*TRANSIENT_DB_ERRORS, asyncpg.PostgresError):
            pass
        await anyio.sleep(0.2)


async def _stale(cluster: Cluster, node: Node, within: float = 15) -> float | None:
    """When ``node`` was first seen not to commit (the start of the first probe whose commit
    did not answer), or ``None`` if it kept committing for ``within`` seconds."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        asked_at = time.time()
        if await probe(cluster.url(), f"127.0.0.1:{node.pg_port}", within=1) == "stuck":
            return asked_at
        await anyio.sleep(0.05)
    return None


async def _sessions_moved(fleet: Fleet, within: float = 10) -> list[str]:
    """Every running worker holds its session's advisory lock on the new primary (its lock and
    LISTEN connection reconnected there): :data:`LIVE_WORKERS` counts them."""
    deadline = time.monotonic() + within
    live, running = 0, 0
    while time.monotonic() < deadline:
        try:
            live = await fleet.client.pool.fetchval(f"SELECT count(*) FROM ({LIVE_WORKERS}) w")
        except (*TRANSIENT_DB_ERRORS, asyncpg.PostgresError):
            live = -1
        running = sum(w.running for w in fleet.workers)
        if live == running:
            return []
        await anyio.sleep(0.1)
    return [f"{live} workers hold their lock on the new primary, {running} run"]


async def _first_step_after(client: Client, moment: float) -> float | None:
    at = await client.pool.fetchval(
        "SELECT extract(epoch FROM min(created_at)) FROM toren.journal "
        "WHERE created_at > to_timestamp($1)",
        moment,
    )
    return None if at is None else float(at) - moment


async def failover(
    harness: Harness, cluster: Cluster, fault: Fault, expected: Expected, *, runs: int = 6
) -> FailoverResult:
    """``runs`` runs on two workers; when each has made two model calls, ``fault`` hits the
    primary (see the module docstring)."""
    times: dict[str, float | None] = {}
    # Also the worst case for the stale primary: the workers' ``read-write`` finds it first.
    await primary_first(harness, cluster)

    async def body(fleet: Fleet) -> tuple[int, list[str], Callable[[str], int]]:
        await fleet.start_runs(runs)
        fleet.start_worker()
        fleet.start_worker()
        problems: list[str] = []
        async with anyio.create_task_group() as tg:
            database = urlsplit(fleet.env["TOREN_DATABASE_URL"]).path.lstrip("/")
            follower = _Follower(fleet, cluster, database, await cluster.leader())
            tg.start_soon(_drive, fleet, follower)
            while len(fleet.recorder.arrivals) < runs * 2:
                await anyio.sleep(0.02)
            primary, standby = await cluster.wait_sync_standby()
            acknowledged = await _journal(fleet.client)
            logs = [len(w.log()) for w in fleet.workers]
            fault_at = died_at = time.time()
            if fault == "postmaster":
                cluster.kill_postmaster(primary)
            else:
                cluster.kill_patroni(primary)
                await cluster.expire_leader()
            await _wait_primary(cluster, standby, timeout=30)
            promoted_at = time.time()
            times["promoted"] = promoted_at - fault_at
            if fault == "patroni":
                # The fault landed: the old primary still takes connections, and its commits
                # hang once the new one no longer streams from it (what the workers must see).
                # Its death as a primary is when it was first seen not to commit.
                stuck_at = await _stale(cluster, primary)
                if stuck_at is None:
                    problems.append("the old primary kept committing: the fault did not land")
                died_at = stuck_at or promoted_at
            problems += await fleet.wait_done(harness.bound * 2)
            if any(p.startswith("stuck") for p in problems):
                problems += await _backends(cluster, database)
            tg.cancel_scope.cancel()
        await follower.follow(until=time.monotonic() + 20)
        problems += await _sessions_moved(fleet)
        if fault == "patroni":
            # The runs finished while the old primary still stood (they cannot have finished
            # there), and the workers hold their locks on the new one (checked above). A worker
            # says when it sees its server stop committing; under load it may instead leave
            # through its renewals' deadline and find the new primary as it starts anew (its
            # probe at the first moment found both servers slow), so one saying it is enough.
            moved = sum(
                "does not commit" in w.log()[at:]
                for w, at in zip(fleet.workers, logs, strict=False)
            )
            if moved < 1:
                problems.append("no worker saw its server stop committing")
            # Now its Patroni comes back, its orphaned Postgres stopped first.
            cluster.restart_patroni(primary)
        await cluster.rejoined(primary, timeout=60)
        times["rejoined"] = time.time() - fault_at
        lost = acknowledged - await _journal(fleet.client)
        if lost:
            problems.append(f"{len(lost)} journal rows read before the fault are gone: {lost}")
        times["first"] = await _first_step_after(fleet.client, died_at)
        # Every run may pay again for the one model call it had in flight at the fault.
        return 1, problems, lambda _run: 1

    result = await _fleet(harness, f"failover-{fault}", body, expected)
    return FailoverResult(
        result, times.get("promoted") or 0.0, times.get("first"), times.get("rejoined") or 0.0
    )


async def _backends(cluster: Cluster, database: str) -> list[str]:
    """What the database's backends on every server are doing (for a failure's report: runs
    that do not finish have steps waiting somewhere)."""
    seen = []
    for node in cluster.nodes:
        try:
            conn = await asyncpg.connect(cluster.node_url(node, database), timeout=3)
        except (OSError, TimeoutError, asyncpg.PostgresError) as exc:
            seen.append(f"{node.name}: cannot connect ({exc})")
            continue
        try:
            role = await conn.fetchval("SELECT pg_is_in_recovery()")
            rows = await conn.fetch(
                "SELECT application_name, client_port, state, wait_event_type, wait_event, "
                "now() - state_change AS for, left(query, 60) AS query FROM pg_stat_activity "
                "WHERE datname = $1 AND pid <> pg_backend_pid() ORDER BY state_change",
                database,
            )
            sync = await conn.fetchval("SHOW synchronous_standby_names")
        finally:
            await conn.close()
        seen.append(f"{node.name} (replica: {role}, synchronous_standby_names {sync!r}):")
        seen.extend(f"  {dict(r)}" for r in rows)
    return seen


async def _wait_primary(cluster: Cluster, node: Node, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while await node.role() != "primary":
        if time.monotonic() > deadline:
            raise TimeoutError(f"{node.name} not promoted within {timeout}s")
        await anyio.sleep(0.05)


async def through_bouncer(
    harness: Harness, bouncer: Bouncer, expected: Expected, *, runs: int = 4
) -> ScenarioResult:
    """``runs`` runs on two workers that reach Postgres only through PgBouncer in session
    mode (their advisory locks, LISTEN and pools all through it); no fault."""

    async def body(fleet: Fleet) -> tuple[int, list[str], Callable[[str], int]]:
        database = urlsplit(fleet.env["TOREN_DATABASE_URL"]).path.lstrip("/")
        fleet.env["TOREN_DATABASE_URL"] = bouncer.url(database)
        await fleet.start_runs(runs)
        fleet.start_worker()
        fleet.start_worker()
        async with anyio.create_task_group() as tg:
            tg.start_soon(fleet.drive)
            problems = await fleet.wait_done(harness.bound)
            tg.cancel_scope.cancel()
        return 0, problems, lambda _run: 0

    return await _fleet(harness, "pgbouncer-session", body, expected)
