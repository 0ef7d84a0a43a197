"""What one step costs Postgres, counted: guards against performance regressions that are not
timed tests (issue 28).

Each test counts, on a real Postgres, the statements, round trips and commits one unit of work
sends (through the counting proxy of :mod:`tests.wire_counts`, which the worker or the API
server uses as its database), and the rows it writes and the transactions that wrote them
(counted by the server: triggers with transition tables in the test's own database). Each
asserts the exact figures written here: a change that needs more must raise the number here,
visibly in review, and in docs/performance.md ("What one step costs, counted").

The windows are exact without sleeping: the code under test stops at a gate (the actor's
handler, the agent's tool) and the test reads the counts while nothing runs; the worker's
background work is kept out by intervals of minutes (leases renewed every 10 minutes, the
dispatcher's poll every 10 minutes). The death watch's connection is left out of the count:
alone, it looks for a peer every 5 seconds whatever the settings (``RECHECK_SECONDS``), and it
is no part of a step.
"""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import anyio
import asyncpg
import attrs
import pytest

from bench.app import Counter, Tick
from tests import steps
from tests.conftest import running_worker, wait_for
from tests.wire_counts import (
    Rows,
    Seen,
    WireCounter,
    counting_proxy,
    install_row_counters,
    rows_mark,
    rows_written,
)
from toren import Agent, Client, Context, ToolContext, tool
from toren._agent.registry import register_agents
from toren._core.mailbox import _COMMIT
from toren._surfaces.http.states import ServedRoutes
from toren._surfaces.serve import serving
from toren._surfaces.tokens import SCOPES, TokenCache, create_token
from toren.runs import run_status, start_run
from toren.testing import AnthropicServer

pytestmark = pytest.mark.anyio

# Background work of the worker kept out of the windows: nothing is renewed or polled for
# minutes (a step needs neither).
QUIET = {"lease_seconds": 1800.0, "renew_seconds": 600.0, "poll_seconds": 600.0}
# Alone, the death watch re-reads the workers table every 5 s whatever the settings.
NOT_COUNTED = ("toren-worker-watch",)
DEADLINE = 30.0


@attrs.frozen(kw_only=True)
class Cost:
    """What a unit of work cost, as the proxy and the row counters saw it."""

    statements: int
    round_trips: int
    commits: int  # transactions ended by a commit, read-only ones included
    writing_commits: int  # transactions that wrote rows (distinct transaction ids)
    rows: dict[tuple[str, str], int]  # (table, operation) -> rows
    prepared: int = 0  # statements prepared in the window (0: every statement was cached)
    model_requests: int = 0


def cost(seen: Seen, rows: Rows, model_requests: int = 0) -> Cost:
    return Cost(
        statements=seen.statement_count,
        round_trips=seen.round_trips,
        commits=seen.commits,
        writing_commits=rows.transactions,
        rows=rows.by_table,
        prepared=seen.parses,
        model_requests=model_requests,
    )


def explained(seen: Seen, rows: Rows) -> str:
    return f"\n{seen.describe()}\n{rows.describe()}"


class Gates:
    """Points where the code under test waits until the test lets it go on."""

    def __init__(self) -> None:
        self._reached: dict[str, anyio.Event] = {}
        self._go: dict[str, anyio.Event] = {}

    def clear(self) -> None:
        self._reached.clear()
        self._go.clear()

    def add(self, *points: str) -> None:
        for point in points:
            self._reached[point], self._go[point] = anyio.Event(), anyio.Event()

    async def at(self, point: str) -> None:
        """Called by the code under test: wait here if the test set a gate at ``point``."""
        if point in self._reached:
            self._reached[point].set()
            await self._go[point].wait()

    async def reached(self, point: str) -> None:
        with anyio.fail_after(DEADLINE):
            await self._reached[point].wait()

    def release(self, point: str) -> None:
        self._go[point].set()


GATES = Gates()


@pytest.fixture(autouse=True)
def _fresh_gates() -> None:
    GATES.clear()


class GatedCounter(Counter):
    """bench.app's kernel-step actor (one event, the next tick sent to itself), which waits at
    ``GATES`` before handling a tick."""

    kind = "test.counts.counter"
    idle_seconds = 600.0

    async def handle(self, ctx: Context[int], msg: Any) -> None:
        await GATES.at(f"{ctx.actor_id}#{msg.n}")
        await super().handle(ctx, msg)


@tool(effects="read")
async def lookup(ctx: ToolContext, key: str) -> str:
    """Look a key up (as bench.app's; waits at ``GATES`` first)."""
    await GATES.at(f"lookup#{key}")
    return f"value of {key}"


@tool(effects="write", idempotency="keyed")
async def note(ctx: ToolContext, key: str) -> str:
    """Write a key down (a tool with effects; waits at ``GATES`` first)."""
    await GATES.at(f"note#{key}")
    return f"noted {key}"


counted = Agent(name="counted", model="anthropic/claude-sonnet-4-6", tools=[lookup])
noting = Agent(name="noting", model="anthropic/claude-sonnet-4-6", tools=[note])


@pytest.fixture
async def counters(client: Client) -> Client:
    await install_row_counters(client.pool)
    return client


# The model asks for ``lookup`` five times, then answers (the k-th request of a run gets the
# k-th turn).
TURNS: list[steps.Step] = [[steps.tool("lookup", f"t{k}", key=f"k{k}")] for k in range(5)]
TURNS.append("Done.")


@pytest.fixture
async def model(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[AnthropicServer]:
    register_agents([counted])
    async with steps.model(TURNS, monkeypatch) as server:
        yield server


# The same with ``note``, a tool with effects.
NOTE_TURNS: list[steps.Step] = [[steps.tool("note", f"n{k}", key=f"k{k}")] for k in range(5)]
NOTE_TURNS.append("Done.")


@pytest.fixture
async def note_model(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[AnthropicServer]:
    register_agents([noting])
    async with steps.model(NOTE_TURNS, monkeypatch) as server:
        yield server


async def _window_between(
    proxy: WireCounter,
    client: Client,
    first: str,
    second: str,
    probe: Callable[[], int] = lambda: 0,
) -> tuple[Seen, Rows, int]:
    """Counts from when the code under test reaches gate ``first`` until it reaches
    ``second`` (gates already set), and how much ``probe()`` grew meanwhile; returns with
    both gates passed."""
    try:
        await GATES.reached(first)
        mark = await rows_mark(client.pool)  # the test's own connection: not counted
        probed = probe()
        with proxy.window(ignore=NOT_COUNTED) as seen:
            GATES.release(first)
            await GATES.reached(second)
        probed = probe() - probed
        rows = await rows_written(client.pool, mark)
    finally:  # never leave the worker waiting (its stop would wait out the grace period)
        GATES.release(first)
        GATES.release(second)
    return seen, rows, probed


async def test_the_proxy_counts_what_the_client_asks(counters: Client, db_url: str) -> None:
    """The instrument itself: simple and extended queries, commits and a rollback, rows."""
    client = counters
    async with counting_proxy(db_url) as proxy:
        conn = await asyncpg.connect(proxy.url)
        try:
            with proxy.window() as simple:
                await conn.execute("SELECT 1; SELECT 2")  # one Query, two statements
            with proxy.window() as extended:
                async with conn.transaction():  # BEGIN and COMMIT: simple Queries
                    await conn.fetchval("SELECT $1::int", 1)  # prepared (Parse, Flush) first
            with proxy.window() as failed, pytest.raises(asyncpg.DivisionByZeroError):
                async with conn.transaction():
                    await conn.execute("SELECT 1/0")
            mark = await rows_mark(client.pool)
            with proxy.window() as spawned:
                await conn.execute(
                    "INSERT INTO toren.actors (actor_id, kind) VALUES ('counts/a', 'x'), "
                    "('counts/b', 'x')"
                )
            rows = await rows_written(client.pool, mark)
            # Two CTEs deleting from one table share one transition table: counted once each.
            mark = await rows_mark(client.pool)
            await conn.execute(
                "WITH a AS (DELETE FROM toren.actors WHERE actor_id = 'counts/a' RETURNING 1) "
                "DELETE FROM toren.actors WHERE actor_id = 'counts/b'"
            )
            deleted = await rows_written(client.pool, mark)
        finally:
            await conn.close()
        # A client that asks for TLS first is told no by the server, through the proxy.
        tls_first = await asyncpg.connect(proxy.url.replace("sslmode=disable", "sslmode=prefer"))
        try:
            assert await tls_first.fetchval("SELECT 2") == 2
            assert proxy.encryption_requests == 1
        finally:
            await tls_first.close()
    assert (simple.statement_count, simple.round_trips, simple.commits) == (2, 1, 1)
    assert (extended.statement_count, extended.round_trips, extended.parses) == (3, 4, 1)
    assert (extended.commits, extended.rollbacks) == (1, 0)
    assert (failed.commits, failed.rollbacks) == (0, 1), failed.describe()
    assert (spawned.statement_count, spawned.commits) == (1, 1)
    assert (rows.by_table, rows.transactions) == ({("actors", "insert"): 2}, 1)
    assert (deleted.by_table, deleted.transactions) == ({("actors", "delete"): 2}, 1)
    assert simple.statements[0].application == ""  # none given by this connection


# One kernel step in a busy chain: the step statement commits the tick's event, consumes the
# tick, sends the next one and claims it (inserted claimed), in one round trip. A change that
# needs more must update the number here and in docs/performance.md.
KERNEL_STEP = Cost(
    statements=1,
    round_trips=1,
    commits=1,
    writing_commits=1,
    rows={("journal", "insert"): 1, ("mailbox", "delete"): 1, ("mailbox", "insert"): 1},
)


async def test_one_kernel_step_costs_one_statement(counters: Client, db_url: str) -> None:
    client = counters
    actor_id = "counts/kernel"
    GATES.add(f"{actor_id}#4", f"{actor_id}#5")  # after three steps have prepared everything
    async with counting_proxy(db_url) as proxy, running_worker(proxy.url, **QUIET):
        await client.spawn(GatedCounter, actor_id)
        await client.send(actor_id, Tick(n=1, last=6))
        seen, rows, _ = await _window_between(proxy, client, f"{actor_id}#4", f"{actor_id}#5")

        async def chain_done() -> bool:
            done = await client.pool.fetchval(
                "SELECT count(*) FROM toren.journal WHERE actor_id = $1", actor_id
            )
            return bool(done == 6)

        await wait_for(chain_done, what="the chain's six ticks")
    assert cost(seen, rows) == KERNEL_STEP, explained(seen, rows)
    # Nothing but the step ran in the window (no poll, no renewal: the window is clean).
    assert all(t == _COMMIT for t in seen.texts()), explained(seen, rows)
    assert {s.application for s in seen.statements} == {"toren-worker"}, explained(seen, rows)


# One agent step with a tool call, in the middle of a run: the commit of a step that ran a read
# tool (its intent and result, and the announcement of the next model call), then the step that
# calls the model (the call's record and the next Continue). A change that needs more must
# update the number here and in docs/performance.md.
AGENT_STEP = Cost(
    statements=2,
    round_trips=2,
    commits=2,
    writing_commits=2,
    rows={
        # tool.intent, tool.result, model.calling; model.called
        ("journal", "insert"): 4,
        ("mailbox", "delete"): 2,  # each step's Continue consumed
        ("mailbox", "insert"): 2,  # and the next one sent (inserted claimed)
        ("actors", "update"): 2,  # the run's summary, written by each step
    },
    model_requests=1,
)


async def test_one_agent_step_with_a_tool_call(
    counters: Client, db_url: str, model: AnthropicServer
) -> None:
    client = counters
    async with counting_proxy(db_url) as proxy, running_worker(proxy.url, **QUIET):
        GATES.add("lookup#k2", "lookup#k3")  # the third and fourth tool calls
        run_id = await start_run(client, "counted", "Look five keys up.")
        seen, rows, requests = await _window_between(
            proxy, client, "lookup#k2", "lookup#k3", lambda: len(model.requests)
        )

        async def completed() -> bool:
            return await run_status(client, run_id) == "completed"

        await wait_for(completed, what="the run completed")
    assert cost(seen, rows, requests) == AGENT_STEP, explained(seen, rows)
    # Nothing but the two steps ran in the window (no poll, no renewal: the window is clean).
    assert all(t == _COMMIT for t in seen.texts()), explained(seen, rows)
    assert {s.application for s in seen.statements} == {"toren-worker"}, explained(seen, rows)


# One agent step with a call of a tool with effects, in the middle of a run: the step that ran
# the tool (its result, and the announcement of the next model call), then the step that calls
# the model (the call's record, the intent of the call it asks for, and the next Continue). The
# tool runs in a step after the intent's commit, as ever; the intent no longer takes a step of
# its own (actors/runs/ahead.py: it was 3 commits). A change that needs more must update the
# number here and in docs/performance.md.
AGENT_WRITE_STEP = Cost(
    statements=2,
    round_trips=2,
    commits=2,
    writing_commits=2,
    rows={
        # tool.result, model.calling; model.called, tool.intent
        ("journal", "insert"): 4,
        ("mailbox", "delete"): 2,  # each step's Continue consumed
        ("mailbox", "insert"): 2,  # and the next one sent (inserted claimed)
        ("actors", "update"): 2,  # the run's summary, written by each step
    },
    model_requests=1,
)


async def test_one_agent_step_with_a_call_of_a_tool_with_effects(
    counters: Client, db_url: str, note_model: AnthropicServer
) -> None:
    client = counters
    async with counting_proxy(db_url) as proxy, running_worker(proxy.url, **QUIET):
        GATES.add("note#k2", "note#k3")  # the third and fourth tool calls
        run_id = await start_run(client, "noting", "Note five keys down.")
        seen, rows, requests = await _window_between(
            proxy, client, "note#k2", "note#k3", lambda: len(note_model.requests)
        )

        async def completed() -> bool:
            return await run_status(client, run_id) == "completed"

        await wait_for(completed, what="the run completed")
    assert cost(seen, rows, requests) == AGENT_WRITE_STEP, explained(seen, rows)
    assert all(t == _COMMIT for t in seen.texts()), explained(seen, rows)
    assert {s.application for s in seen.statements} == {"toren-worker"}, explained(seen, rows)
    # The intent is on record in the commit of the model's answer, before the tool ran.
    types = [e.type for e in await client.journal(run_id)]
    called = [i for i, t in enumerate(types) if t == "model.called"]
    assert all(types[i + 1] == "tool.intent" for i in called[:-1]), types


# GET /runs/{id} of a completed run, its token's check and the run's state cached by the first
# read. A change that needs more must update the number here and in docs/performance.md.
API_READ = Cost(
    # the run's events since the cached state (no runs below: it has no child), and whether a
    # human's message waits for it (a completed conversation pinned to a version no live
    # worker serves is parked: docs/versioning.md). The routes live workers serve are read
    # once a second, not with each read (here: by the first read)
    statements=1,
    round_trips=1,
    commits=1,  # a read-only (implicit) transaction: nothing written
    writing_commits=0,
    rows={},
)


async def test_one_api_read_of_a_run(
    counters: Client, db_url: str, model: AnthropicServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    client = counters
    async with running_worker(db_url):
        run_id = await start_run(client, "counted", "Look five keys up.")

        async def completed() -> bool:
            return await run_status(client, run_id) == "completed"

        await wait_for(completed, what="the run completed")
    _, token = await create_token(client.pool, "counts", scopes=SCOPES)
    # The token's check is cached for minutes, not a second: the counted read must find it
    # cached however slowly this machine runs.
    monkeypatch.setattr(
        "toren._surfaces.http.app.TokenCache", functools.partial(TokenCache, ttl=600.0)
    )
    # So are the routes live workers serve (read at most once a second).
    monkeypatch.setattr(
        "toren._surfaces.http.runs.ServedRoutes", functools.partial(ServedRoutes, ttl=600.0)
    )
    headers = {"Authorization": f"Bearer {token}"}
    async with (
        counting_proxy(db_url) as proxy,
        serving(proxy.url, port=0) as base,
        aiohttp.ClientSession(headers=headers) as http,
    ):
        url = f"{base}/runs/{run_id.removeprefix('run/')}"
        async with http.get(url) as first:
            assert first.status == 200, await first.text()
        mark = await rows_mark(client.pool)
        with proxy.window() as seen:
            async with http.get(url) as second:
                assert second.status == 200, await second.text()
                body = await second.json()
        rows = await rows_written(client.pool, mark)
    assert body["status"] == "completed"
    assert {s.application for s in seen.statements} <= {"toren"}, explained(seen, rows)
    assert cost(seen, rows) == API_READ, explained(seen, rows)
