"""Bounded event streams: a stream closes when its caller's credentials end, when it idles and
when the server stops, saying why; streams are capped per token and per server process. An idle
stream reads nothing until a notification says its run's journal grew."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import uuid
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import anyio
import attrs
import pytest
from yarl import URL

import toren._surfaces.http.streams
from tests import app
from tests.conftest import decide_waiting, person, running_worker, wait_for
from tests.test_api import refund_agent
from toren import Client, Context
from toren._core.db import connect
from toren._core.leases import mark_failed
from toren._core.mailbox import claim_next, commit_step, dead_letter
from toren._surfaces.http import ServerOptions
from toren._surfaces.http.streams import Page
from toren._surfaces.serve import serving
from toren._surfaces.tokens import (
    authenticate,
    close_session,
    create_token,
    open_session,
    revoke_token,
)
from toren.actors.runs import RunActor
from toren.runs import RunState, read_run, start_run, waiting_on

pytestmark = pytest.mark.anyio

SSE = {"Accept": "text/event-stream"}
CACHE_TTL = 1.0  # the token cache's: a revocation is seen at most this late
MARGIN = 2.0  # polling, scheduling, a loaded machine


@attrs.frozen
class Sse:
    id: int | None
    event: str
    data: str

    @property
    def reason(self) -> Any:
        return json.loads(self.data)["reason"]


@contextlib.asynccontextmanager
async def api(db_url: str, **options: Any) -> AsyncIterator[str]:
    async with serving(db_url, port=0, options=ServerOptions(**options)) as base:
        yield base


@contextlib.asynccontextmanager
async def http(token: str) -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {token}"}) as session:
        yield session


async def _run(client: Client) -> str:
    """A run's events URL path; no worker runs it, so its journal holds what a test writes."""
    run_id = await start_run(client, "support", "hello")
    return f"/runs/{run_id.removeprefix('run/')}/events"


async def _append(client: Client, path: str, *seqs: int, conn: Any = None) -> None:
    run_id = f"run/{path.split('/')[2]}"
    for seq in seqs:
        await (conn or client.pool).execute(
            "INSERT INTO toren.journal (actor_id, seq, epoch, type, data) "
            "VALUES ($1, $2, 1, $3, $4)",
            run_id,
            seq,
            f"test.{seq}",
            {"n": seq},
        )


async def events_of(response: aiohttp.ClientResponse) -> AsyncIterator[Sse]:
    """The stream's events as they come (pings skipped), until the server ends it."""
    assert response.status == 200, await response.text()
    assert response.content_type == "text/event-stream"
    event_id, event, data = None, "message", ""
    async for raw in response.content:
        line = raw.decode().rstrip("\r\n")
        if line.startswith("id: "):
            event_id = int(line[4:])
        elif line.startswith("event: "):
            event = line[7:]
        elif line.startswith("data: "):
            data = line[6:]
        elif line == "" and data:
            yield Sse(event_id, event, data)
            event_id, event, data = None, "message", ""


async def read_all(response: aiohttp.ClientResponse) -> list[Sse]:
    """Every event of the stream, until the server ends it (pings skipped)."""
    return [e async for e in events_of(response)]


async def read_until(events: AsyncIterator[Sse], event_type: str) -> list[Sse]:
    """The stream's events up to and including the first of type ``event_type``."""
    got: list[Sse] = []
    async for e in events:
        got.append(e)
        if e.event == event_type:
            return got
    raise AssertionError(f"the stream ended without {event_type}: {got}")


@attrs.define
class Reads:
    """How many journal pages the server's streams have read (each counted once it returns),
    and how many turns their loops have taken (a turn checks the client is there)."""

    count: int = 0
    turns: int = 0


def count_reads(monkeypatch: pytest.MonkeyPatch) -> Reads:
    reads = Reads()
    stream = toren._surfaces.http.streams.stream

    async def counted(request: Any, actor_id: str, after: int, page: Page) -> Any:
        async def counted_page(after: int) -> Any:
            events = await page(after)
            reads.count += 1
            return events

        return await stream(request, actor_id, after, counted_page)

    connected = toren._surfaces.http.streams._connected

    def counted_turn(request: Any, sse: Any) -> bool:
        reads.turns += 1
        return connected(request, sse)

    monkeypatch.setattr(toren._surfaces.http.streams, "stream", counted)
    monkeypatch.setattr(toren._surfaces.http.streams, "_connected", counted_turn)
    return reads


async def _owned(client: Client, path: str) -> tuple[str, uuid.UUID, int]:
    """Take the run (that no worker runs) as a worker would: its id, our owner id, the epoch."""
    run_id = f"run/{path.split('/')[2]}"
    owner = uuid.uuid4()
    epoch = await client.pool.fetchval(
        "UPDATE toren.actors SET owner = $2, epoch = epoch + 1, "
        "lease_expires_at = now() + interval '1 hour' WHERE actor_id = $1 RETURNING epoch",
        run_id,
        owner,
    )
    return run_id, owner, epoch


async def _listener_pid(client: Client) -> int | None:
    pid: int | None = await client.pool.fetchval(
        "SELECT pid FROM pg_stat_activity "
        "WHERE datname = current_database() AND application_name = 'toren-listener'"
    )
    return pid


async def _refused(response: aiohttp.ClientResponse) -> dict[str, Any]:
    """The problem document of a 429, after checking it is one."""
    assert response.status == 429
    assert response.content_type == "application/problem+json"
    assert response.headers["Retry-After"] == "5"
    problem: dict[str, Any] = await response.json(content_type=None)
    assert problem["status"] == 429
    assert problem["title"] == "Too many streams"
    return problem


async def test_a_stream_closes_soon_after_its_token_is_revoked(client: Client, db_url: str) -> None:
    recheck = 0.5
    token_id, token = await create_token(client.pool, "reader")
    path = await _run(client)
    async with (
        api(db_url, stream_recheck_seconds=recheck) as base,
        http(token) as session,
        session.get(base + path, headers=SSE) as r,
    ):
        assert r.status == 200
        await revoke_token(client.pool, token_id)
        with anyio.fail_after(2 * recheck + CACHE_TTL + MARGIN):
            got = await read_all(r)
    assert got[-1].event == "toren.closed"
    assert got[-1].reason == "revoked"


async def test_a_stream_closes_when_its_token_expires(client: Client, db_url: str) -> None:
    _, token = await create_token(client.pool, "brief", expires_in=2)
    path = await _run(client)
    async with api(db_url) as base, http(token) as session:
        with anyio.fail_after(2 + MARGIN):
            async with session.get(base + path, headers=SSE) as r:
                got = await read_all(r)
    assert got[-1].event == "toren.closed"
    assert got[-1].reason == "expired"


async def test_a_console_sessions_stream_closes_when_the_session_ends(
    client: Client, db_url: str
) -> None:
    recheck = 0.5
    _, token = await create_token(client.pool, "browser")
    found = await authenticate(client.pool, token)
    assert found is not None
    cookie, _, _ = await open_session(client.pool, found)
    path = await _run(client)
    headers = {**SSE, "Cookie": f"toren_session={cookie}"}
    async with (
        api(db_url, stream_recheck_seconds=recheck) as base,
        aiohttp.ClientSession() as session,
        session.get(base + path, headers=headers) as r,
    ):
        assert r.status == 200
        await close_session(client.pool, cookie)
        with anyio.fail_after(2 * recheck + MARGIN):  # sessions are not cached
            got = await read_all(r)
    assert got[-1].event == "toren.closed"
    assert got[-1].reason == "revoked"


async def test_past_its_cap_a_token_gets_429_while_another_token_can_stream(
    client: Client, db_url: str
) -> None:
    _, first = await create_token(client.pool, "first")
    _, second = await create_token(client.pool, "second")
    path = await _run(client)
    async with (
        api(db_url, streams_per_token=1, streams_max=10) as base,
        http(first) as one,
        http(second) as two,
        one.get(base + path, headers=SSE) as r,
    ):
        assert r.status == 200
        async with one.get(base + path, headers=SSE) as again:
            problem = await _refused(again)
            assert "streams_per_token" in problem["detail"]
        async with two.get(base + path, headers=SSE) as other:
            assert other.status == 200
            assert other.content_type == "text/event-stream"


async def test_past_the_process_cap_every_token_gets_429(client: Client, db_url: str) -> None:
    tokens = [(await create_token(client.pool, f"t{i}"))[1] for i in range(3)]
    path = await _run(client)
    async with (
        api(db_url, streams_max=2, streams_per_token=10) as base,
        contextlib.AsyncExitStack() as stack,
    ):
        sessions = [await stack.enter_async_context(http(t)) for t in tokens]
        for session in sessions[:2]:
            r = await stack.enter_async_context(session.get(base + path, headers=SSE))
            assert r.status == 200
        for session in sessions:
            async with session.get(base + path, headers=SSE) as refused:
                problem = await _refused(refused)
                assert "streams_max" in problem["detail"]


async def test_a_stream_the_client_leaves_gives_its_slot_back(client: Client, db_url: str) -> None:
    _, token = await create_token(client.pool, "reader")
    path = await _run(client)
    async with api(db_url, streams_per_token=1) as base, http(token) as session:
        async with session.get(base + path, headers=SSE) as r:
            assert r.status == 200
            async with session.get(base + path, headers=SSE) as refused:
                await _refused(refused)
        # The client has disconnected: the server notices and the slot comes back.

        async def opens() -> bool:
            async with session.get(base + path, headers=SSE) as again:
                return again.status == 200

        await wait_for(opens, timeout=5, interval=0.1, what="the slot to be given back")


async def test_an_idle_stream_closes_and_its_client_resumes_without_losing_events(
    client: Client, db_url: str
) -> None:
    idle = 1.0
    _, token = await create_token(client.pool, "reader")
    path = await _run(client)
    await _append(client, path, 1)
    async with api(db_url, stream_idle_seconds=idle) as base, http(token) as session:
        with anyio.fail_after(idle + MARGIN):
            async with session.get(base + path, headers=SSE) as r:
                first = await read_all(r)
        assert [(e.id, e.event) for e in first] == [(1, "test.1"), (None, "toren.closed")]
        assert first[-1].reason == "idle"
        await _append(client, path, 2, 3)
        with anyio.fail_after(idle + MARGIN):
            async with session.get(base + path, headers={**SSE, "Last-Event-ID": "1"}) as r:
                second = await read_all(r)
    assert [(e.id, e.event) for e in second] == [
        (2, "test.2"),
        (3, "test.3"),
        (None, "toren.closed"),
    ]
    assert json.loads(second[0].data)["data"] == {"n": 2}
    assert second[-1].reason == "idle"


async def test_streams_are_told_when_the_server_stops(client: Client, db_url: str) -> None:
    _, token = await create_token(client.pool, "reader")
    path = await _run(client)
    async with http(token) as session:
        async with api(db_url) as base:
            r = await session.get(base + path, headers=SSE)
            assert r.status == 200
            stopping = anyio.current_time()
        # The server stopped without waiting out aiohttp's 60 s shutdown timeout.
        assert anyio.current_time() - stopping < 10
        with anyio.fail_after(MARGIN), contextlib.closing(r):
            got = await read_all(r)
    assert got[-1].event == "toren.closed"
    assert got[-1].reason == "stopping"


async def test_a_stream_whose_client_stops_reading_gives_its_slot_back(
    client: Client, db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_timeout = 3.0
    # raising=False: before the fix there was no such bound to shorten (the test then fails on
    # the slot never coming back, not on this line).
    monkeypatch.setattr(toren._surfaces.http.streams, "WRITE_TIMEOUT", write_timeout, raising=False)
    _, stuck = await create_token(client.pool, "stuck")
    _, other = await create_token(client.pool, "other")
    path = await _run(client)
    run_id = f"run/{path.split('/')[2]}"
    text = "x" * 200_000
    await client.pool.executemany(  # ~60 MB: far more than the socket buffers between them
        "INSERT INTO toren.journal (actor_id, seq, epoch, type, data) VALUES ($1, $2, 1, $3, $4)",
        [(run_id, seq, f"test.{seq}", {"text": text}) for seq in range(1, 301)],
    )
    async with api(db_url, streams_max=1) as base, http(other) as session:
        url = URL(base)
        assert url.host is not None
        assert url.port is not None
        loop = asyncio.get_running_loop()
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.setblocking(False)
            await loop.sock_connect(sock, (url.host, url.port))
            await loop.sock_sendall(
                sock,
                f"GET {path} HTTP/1.1\r\nHost: {url.host}:{url.port}\r\n"
                f"Authorization: Bearer {stuck}\r\nAccept: text/event-stream\r\n\r\n".encode(),
            )
            with anyio.fail_after(MARGIN + 10):  # the first page is read, then sent
                head = await loop.sock_recv(sock, 1024)
            assert head.startswith(b"HTTP/1.1 200 "), head
            # From here on the client reads nothing: the server's writes back up, then block.
            async with session.get(base + path, headers=SSE) as refused:
                problem = await _refused(refused)
                assert "streams_max" in problem["detail"]  # the stuck stream holds the slot

            async def opens() -> bool:
                async with session.get(base + path, headers=SSE) as r:
                    return r.status == 200

            await wait_for(opens, timeout=20, interval=0.2, what="the stuck stream's slot back")


async def test_an_event_a_worker_appends_wakes_an_idle_stream_through_its_notification(
    client: Client, db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # No safety re-read within the test: what arrives was announced by a notification.
    monkeypatch.setattr(toren._surfaces.http.streams, "SAFETY", 60.0)
    reads = count_reads(monkeypatch)
    _, token = await create_token(client.pool, "reader")
    async with refund_agent(monkeypatch, db_url), api(db_url) as base, http(token) as session:
        run_id = await start_run(client, "support", "Refund me")

        async def parked() -> bool:
            return bool(waiting_on(await read_run(client, run_id)))

        await wait_for(parked, timeout=20, what="the run to park on its approval")
        path = f"/runs/{run_id.removeprefix('run/')}/events"
        async with session.get(base + path, headers=SSE) as r:
            events = events_of(r)
            with anyio.fail_after(MARGIN):
                await read_until(events, "approval.requested")
            # Idle: nothing is appended, and the stream reads nothing while its loop turns
            # (at least a quarter second apart) eight times: it polled at every turn before.
            idle_from, turns_from = reads.count, reads.turns

            async def turned() -> bool:
                return reads.turns >= turns_from + 8

            await wait_for(turned, timeout=30, what="the idle stream's loop to turn")
            assert reads.count == idle_from
            await decide_waiting(client, run_id, approved=True, by=person("alice"), wait=None)
            with anyio.fail_after(MARGIN + 3):
                got = await read_until(events, "run.completed")
    assert "approval.decided" in [e.event for e in got]
    # At most one read per notification (each announces a step with one event or more).
    assert reads.count - idle_from <= len(got)


@contextlib.asynccontextmanager
async def idle_stream(
    client: Client, db_url: str, monkeypatch: pytest.MonkeyPatch, path: str, *, safety: float
) -> AsyncIterator[AsyncIterator[Sse]]:
    """The events of an open stream of ``path`` that has made its first read, and whose safety
    re-read is ``safety`` seconds away: an event arriving sooner was announced to it."""
    monkeypatch.setattr(toren._surfaces.http.streams, "SAFETY", safety)
    reads = count_reads(monkeypatch)
    _, token = await create_token(client.pool, "reader")
    async with (
        api(db_url) as base,
        http(token) as session,
        session.get(base + path, headers=SSE) as r,
    ):
        await wait_for(lambda: _true(reads.count), timeout=MARGIN, what="the first read")
        yield events_of(r)


async def test_a_dead_letters_events_wake_an_idle_stream(
    client: Client, db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = await _run(client)
    run_id, owner, epoch = await _owned(client, path)
    envelope = await claim_next(client.pool, run_id, owner, epoch)
    assert envelope is not None
    async with idle_stream(client, db_url, monkeypatch, path, safety=60) as events:
        ctx = Context(RunActor(run_id, {}), RunState(), 0, epoch, envelope)
        ctx.events.append((1, "test.dead_lettered", '{"n": 1}', None))
        await dead_letter(client.pool, owner, envelope, ctx, "failing")
        with anyio.fail_after(MARGIN):
            got = await read_until(events, "test.dead_lettered")
    assert [(e.id, e.event) for e in got] == [(1, "test.dead_lettered")]


async def test_the_kernel_marking_a_run_failed_wakes_an_idle_stream(
    client: Client, db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = await _run(client)
    run_id, owner, epoch = await _owned(client, path)
    async with idle_stream(client, db_url, monkeypatch, path, safety=60) as events:
        assert await mark_failed(client.pool, run_id, "toren.run", owner, epoch, "crash loop")
        with anyio.fail_after(MARGIN):
            got = await read_until(events, "toren.failed")
    assert json.loads(got[-1].data)["data"]["error"] == "crash loop"


async def test_a_stream_hears_again_after_its_listening_connection_is_dropped(
    client: Client, db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = await _run(client)
    run_id, owner, epoch = await _owned(client, path)
    async with idle_stream(client, db_url, monkeypatch, path, safety=60) as events:
        dropped = await _listener_pid(client)
        assert dropped is not None
        assert await client.pool.fetchval("SELECT pg_terminate_backend($1)", dropped)
        # Whether the event lands before or after the server reconnects, it arrives: a
        # notification on the new connection, or the read made on reconnecting.
        assert await mark_failed(client.pool, run_id, "toren.run", owner, epoch, "after drop")
        with anyio.fail_after(MARGIN):
            got = await read_until(events, "toren.failed")

        async def reconnected() -> bool:
            return (await _listener_pid(client)) not in (None, dropped)

        await wait_for(reconnected, timeout=MARGIN, what="a new listening connection")
        # And the new connection hears what comes next.
        async with client.pool.acquire() as conn, conn.transaction():
            await _append(client, path, 2, conn=conn)
            await conn.execute("SELECT pg_notify('toren_journal', $1)", run_id)
        with anyio.fail_after(MARGIN):
            got += await read_until(events, "test.2")
    assert json.loads(got[0].data)["data"]["error"] == "after drop"
    assert [e.id for e in got] == [1, 2]


async def test_an_event_whose_notification_is_lost_arrives_by_the_safety_read(
    client: Client, db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    safety = 1.0
    path = await _run(client)
    async with idle_stream(client, db_url, monkeypatch, path, safety=safety) as events:
        await _append(client, path, 1)  # written behind the kernel's back: nothing notifies
        with anyio.fail_after(safety + MARGIN):
            got = await read_until(events, "test.1")
    assert [e.id for e in got] == [1]


async def test_a_journal_watch_wakes_on_its_actors_notification_only(client: Client) -> None:
    async with client.watch_journal("run/a") as a, client.watch_journal("run/b") as b:
        await a.arm()
        await b.arm()
        await client.pool.execute("SELECT pg_notify('toren_journal', 'run/a')")
        with anyio.fail_after(MARGIN):
            await a.wait()
        assert not b.woken
        await a.arm()
        assert not a.woken
    # Both forgotten once closed: a notification for them finds no one.
    assert not client._watches


async def _true(value: int) -> bool:
    return bool(value)


class SummedCounter(app.Counter):
    """A counter that keeps a summary on its row, as a run does: its steps write the row."""

    kind = "test.summed_counter"

    def summarize(self, state: app.CounterState) -> dict[str, Any]:
        return {"status": "running", "total": state.total}


async def test_only_the_steps_of_a_watched_actor_notify(client: Client, db_url: str) -> None:
    # A notification takes a lock at commit that serializes every notifying commit (WAL flush
    # included): only the steps of an actor someone follows may pay it, whether or not its steps
    # write its row's summary (a run's do; every step of a run notified until issue 28).
    heard: list[str] = []
    listener = await connect(db_url, name="test-listener")
    try:
        await listener.add_listener("toren_journal", lambda *n: heard.append(str(n[3])))
        await client.spawn(app.Counter, "c/quiet")
        await client.spawn(SummedCounter, "c/summed")
        await client.spawn(app.Counter, "c/watched")
        async with client.watch_journal("c/watched") as watch:
            await watch.arm()  # marks the row: its steps notify from now on
            for i in range(3):
                await client.send("c/quiet", app.Add(n=1, tag=f"q{i}"))
                await client.send("c/summed", app.Add(n=1, tag=f"s{i}"))
                await client.send("c/watched", app.Add(n=1, tag=f"w{i}"))
            async with running_worker(db_url):

                async def journaled() -> bool:
                    counts = [len(await client.journal(a)) for a in ("c/quiet", "c/summed")]
                    return counts == [3, 3] and len(await client.journal("c/watched")) == 3

                await wait_for(journaled, timeout=20, what="three steps of each")
        # Notifications arrive in commit order: any the steps sent come before this one.
        await client.pool.execute("SELECT pg_notify('toren_journal', 'marker')")
        await wait_for(lambda: _true("marker" in heard), timeout=MARGIN, what="the marker")
    finally:
        await listener.close()
    assert heard == ["c/watched"] * 3 + ["marker"]
    summary = await client.pool.fetchval(
        "SELECT summary FROM toren.actors WHERE actor_id = $1", "c/summed"
    )
    assert summary == {"status": "running", "total": 3}  # its steps did write its row


async def test_a_watch_on_an_actor_marked_for_long_enough_writes_nothing(client: Client) -> None:
    # Every stream opened on a run arms a watch, and a caller may open and close streams in a
    # loop (a read token may): a row already marked for most of a watch's time is not written
    # again (a write locks the run's row: a claim skips it, a step's fence waits for it).
    await client.spawn(app.Counter, "c/followed")
    mark = "SELECT xmin::text AS version, watched_until FROM toren.actors WHERE actor_id = $1"
    async with client.watch_journal("c/followed") as first:
        await first.arm()
        marked = await client.pool.fetchrow(mark, "c/followed")
        assert marked["watched_until"] is not None
        for _ in range(3):
            async with client.watch_journal("c/followed") as another:
                await another.arm()
        assert await client.pool.fetchrow(mark, "c/followed") == marked
    # A mark running out is renewed by the next watch to arm.
    await client.pool.execute(
        "UPDATE toren.actors SET watched_until = now() + interval '20 seconds' WHERE actor_id = $1",
        "c/followed",
    )
    async with client.watch_journal("c/followed") as late:
        await late.arm()
    left = await client.pool.fetchval(
        "SELECT extract(epoch FROM watched_until - now()) FROM toren.actors WHERE actor_id = $1",
        "c/followed",
    )
    assert left > 50, left


async def test_a_watch_committed_while_a_step_waits_for_its_fence_is_seen_by_that_step(
    client: Client, db_url: str
) -> None:
    # The step's statement began before the watch committed, so its snapshot holds the row
    # unmarked: it notifies only because its fence reads the version it locks, the watched one.
    path = await _run(client)
    run_id, owner, epoch = await _owned(client, path)
    envelope = await claim_next(client.pool, run_id, owner, epoch)
    assert envelope is not None
    heard: list[str] = []
    listener = await connect(db_url, name="test-listener")
    watcher = await connect(db_url, name="test-watcher")
    try:
        await listener.add_listener("toren_journal", lambda *n: heard.append(str(n[3])))
        watching = watcher.transaction()
        await watching.start()
        await watcher.execute(
            "UPDATE toren.actors SET watched_until = now() + interval '60 seconds' "
            "WHERE actor_id = $1",
            run_id,
        )
        ctx = Context(RunActor(run_id, {}), RunState(), 0, epoch, envelope)
        ctx.events.append((1, "test.1", '{"n": 1}', None))

        async def step_waits() -> bool:
            waiting = await client.pool.fetchval(
                "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                "AND query LIKE '%WITH fence AS%' AND pid <> pg_backend_pid()"
            )
            return bool(waiting)

        async with anyio.create_task_group() as tg:
            tg.start_soon(commit_step, client.pool, owner, envelope, ctx)
            await wait_for(step_waits, timeout=MARGIN, what="the step waiting for its fence")
            await watching.commit()
        await client.pool.execute("SELECT pg_notify('toren_journal', 'marker')")
        await wait_for(lambda: _true("marker" in heard), timeout=MARGIN, what="the marker")
    finally:
        await watcher.close()
        await listener.close()
    assert heard == [run_id, "marker"]
