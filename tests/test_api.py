"""The HTTP API through a real HTTP client: auth, every endpoint, bad input, the live stream."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import anyio
import pytest

from tests import run_app
from tests.conftest import WorkerFactory, running_worker, wait_for
from toren import Client
from toren._agent.app import load_app
from toren._agent.model import ToolCall
from toren._surfaces.serve import serving
from toren._surfaces.tokens import SCOPES, create_token, revoke_token
from toren.runs import read_run, start_run
from toren.testing import AnthropicServer, Fail, Reply

pytestmark = pytest.mark.anyio


@contextlib.asynccontextmanager
async def api(db_url: str) -> AsyncIterator[str]:
    async with serving(db_url, port=0) as base:
        yield base


@contextlib.asynccontextmanager
async def session(token: str | None = None) -> AsyncIterator[aiohttp.ClientSession]:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    async with aiohttp.ClientSession(headers=headers) as http:
        yield http


async def _token(client: Client, name: str = "ops") -> str:
    _, token = await create_token(client.pool, name, scopes=SCOPES)
    return token


def _uuid(run_id: str) -> str:
    return run_id.removeprefix("run/")


@contextlib.asynccontextmanager
async def refund_agent(
    monkeypatch: pytest.MonkeyPatch,
    db_url: str,
    *,
    first: Callable[[dict[str, Any], int], Reply | Fail | None] | None = None,
) -> AsyncIterator[None]:
    """A worker running `support`, whose model opens a refund that needs approval, then ends.
    ``first``, if given, answers each request first; where it returns None, the refund goes on."""

    load_app("tests.run_app")
    run_app.applied.clear()

    def respond(request: dict[str, Any], n: int) -> Reply | Fail:
        answer = first(request, n) if first is not None else None
        if answer is not None:
            return answer
        done = any(m["role"] == "assistant" for m in request["messages"])
        return (
            Reply("Refunded.")
            if done
            else Reply([ToolCall(id="r1", name="refund", arguments={"amount": 500})])
        )

    async with AnthropicServer(respond) as server:
        for name, value in server.env().items():
            monkeypatch.setenv(name, value)
        async with running_worker(db_url):
            yield


async def test_every_route_but_healthz_needs_a_valid_token(client: Client, db_url: str) -> None:
    good = await _token(client)
    revoked = await _token(client, "old")
    await revoke_token(client.pool, revoked.split("_")[1])
    async with api(db_url) as base:
        async with session() as http:
            async with http.get(f"{base}/healthz") as r:
                assert r.status == 200
            paths = [
                ("GET", "/runs"),
                ("POST", "/runs"),
                ("GET", "/metrics"),
                ("GET", "/openapi.json"),
                ("GET", f"/runs/{'0' * 32}"),
            ]
            for method, path in paths:
                async with http.request(method, f"{base}{path}") as r:
                    assert r.status == 401, path
                    assert r.headers["WWW-Authenticate"] == "Bearer"
                    assert r.content_type == "application/problem+json"
                    assert (await r.json())["status"] == 401
        for bad in ("trn_nope_nope", good[:-2] + "xx", revoked, "not-a-token"):
            async with session(bad) as http, http.get(f"{base}/runs") as r:
                assert r.status == 401, bad
        async with session(good) as http, http.get(f"{base}/runs") as r:
            assert r.status == 200
            assert (await r.json()) == {"runs": [], "next_cursor": None}
        # A token checked a moment ago is trusted for a second; then its revocation holds.
        await revoke_token(client.pool, good.split("_")[1])
        await anyio.sleep(1.1)
        async with session(good) as http, http.get(f"{base}/runs") as r:
            assert r.status == 401


async def test_a_run_started_over_http_is_approved_and_completes(
    client: Client, db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    token = await _token(client, "alice")
    async with refund_agent(monkeypatch, db_url), api(db_url) as base, session(token) as http:
        async with http.post(f"{base}/runs", json={"agent": "support", "input": "Refund me"}) as r:
            assert r.status == 201
            run = await r.json()
        assert (run["agent"], run["input"], run["status"]) == ("support", "Refund me", "running")
        uuid = _uuid(run["id"])

        async def parked() -> dict[str, Any] | None:
            async with http.get(f"{base}/runs/{uuid}") as r:
                body: dict[str, Any] = await r.json()
            return body if body["status"] == "parked" else None

        shown = await wait_for(parked, what="parked")
        assert shown["waiting_on"] == [
            {
                "call_id": "r1",
                "tool": "refund",
                "arguments": {"amount": 500},
                "run": run["id"],
                "agent": "support",
            }
        ]
        assert (shown["parent"], shown["children"]) == (None, [])
        async with http.get(f"{base}/runs?status=parked&agent=support") as r:
            listed = (await r.json())["runs"]
        assert [x["id"] for x in listed] == [run["id"]]
        assert listed[0]["calls_made"] == 1
        body = {"call_id": "r1", "approved": True, "reason": "fine"}
        async with http.post(f"{base}/runs/{uuid}/approvals", json=body) as r:
            assert r.status == 200  # the run answered: applied
            assert (await r.json())["outcome"] == "applied"
        await wait_for(lambda: _status(client, run["id"], "completed"), what="completed")
        async with http.get(f"{base}/runs/{uuid}") as r:
            done = await r.json()
        assert done["output"] == "Refunded."
        assert done["receipt"]["calls_made"] == 2
        async with http.post(f"{base}/runs/{uuid}/approvals", json=body) as r:
            assert r.status == 200  # the same decision again: nothing new
            assert (await r.json())["outcome"] == "repeated"
        deny = {"call_id": "r1", "approved": False}
        async with http.post(f"{base}/runs/{uuid}/approvals", json=deny) as r:
            assert r.status == 409  # the other way, after the fact
        async with http.get(f"{base}/runs/{uuid}/events") as r:
            events = (await r.json())["events"]
    assert [e["seq"] for e in events] == list(range(1, len(events) + 1))
    [decided] = [e for e in events if e["type"] == "approval.decided"]
    assert (decided["data"]["who"], decided["data"]["channel"]) == ("alice", "http")
    token_id = token.split("_")[1]
    principal = {"kind": "token", "id": token_id, "name": "alice", "via": "http"}
    assert decided["data"]["by"] == principal
    [started] = [e for e in events if e["type"] == "run.started"]
    assert started["data"]["by"] == principal  # who started it, too
    [refused] = [e for e in events if e["type"] == "decision.refused"]
    assert (refused["data"]["call_id"], refused["data"]["outcome"]) == ("r1", "conflict")
    assert [e["type"] for e in events][-2:] == ["run.completed", "decision.refused"]


async def _status(client: Client, run_id: str, status: str) -> bool:
    return (await read_run(client, run_id)).status == status


async def test_bad_input_gets_a_problem_naming_the_field(client: Client, db_url: str) -> None:
    token = await _token(client)
    run_id = await start_run(client, "support", "hello")
    uuid = _uuid(run_id)
    async with api(db_url) as base, session(token) as http:

        async def problem(method: str, path: str, **kwargs: Any) -> tuple[int, dict[str, Any]]:
            async with http.request(method, f"{base}{path}", **kwargs) as r:
                assert r.content_type == "application/problem+json", (path, r.status)
                return r.status, await r.json()

        status, body = await problem("POST", "/runs", data=b"{not json")
        assert status == 400
        assert body["errors"][0]["field"] == "body"
        status, body = await problem("POST", "/runs", json={"agent": "support"})
        assert status == 422
        assert [e["field"] for e in body["errors"]] == ["input"]
        status, body = await problem("POST", "/runs", json={"agent": "x", "input": "y", "z": 1})
        assert status == 422
        assert [e["field"] for e in body["errors"]] == ["z"]
        status, body = await problem("POST", "/runs", json={"agent": "has space", "input": "y"})
        assert [e["field"] for e in body["errors"]] == ["agent"]
        status, body = await problem("POST", "/runs", json=[1, 2])
        assert status == 422
        status, _ = await problem("POST", "/runs", data=b'{"input": "' + b"x" * 1_000_000 + b'"}')
        assert status == 413
        status, _ = await problem("GET", f"/runs/{'1' * 32}")
        assert status == 404
        status, _ = await problem("GET", "/runs/not-a-uuid")
        assert status == 404
        status, _ = await problem("POST", f"/runs/{'1' * 32}/cancel")
        assert status == 404
        status, body = await problem("GET", "/runs?limit=0&status=lost&cursor=%%%")
        assert status == 422
        assert sorted(e["field"] for e in body["errors"]) == ["cursor", "limit", "status"]
        status, body = await problem("GET", f"/runs/{uuid}/events?after=-1")
        assert status == 422
        status, body = await problem("GET", f"/runs/{uuid}/events?after={2**64}")
        assert status == 422  # past a bigint: refused, not a 500
        bad = {"call_id": "c1", "approved": "yes"}
        status, body = await problem("POST", f"/runs/{uuid}/approvals", json=bad)
        assert [e["field"] for e in body["errors"]] == ["approved"]
        status, body = await problem("POST", f"/runs/{uuid}/approvals", json={"approved": True})
        assert [e["field"] for e in body["errors"]] == ["call_id"]
        status, body = await problem("POST", f"/runs/{uuid}/messages", json={"text": ""})
        assert [e["field"] for e in body["errors"]] == ["text"]
        async with http.post(f"{base}/runs/{uuid}/messages", json={"text": "also this"}) as r:
            assert r.status == 202
        async with http.post(f"{base}/runs/{uuid}/cancel") as r:
            assert r.status == 202
    # Nothing bad input did reached the run's mailbox: only its start, the message and the cancel.
    kinds = await client.pool.fetch("SELECT kind FROM toren.mailbox ORDER BY id")
    assert [k["kind"] for k in kinds] == ["run.start", "run.say", "run.cancel"]


async def test_runs_are_listed_newest_first_a_page_at_a_time(client: Client, db_url: str) -> None:
    token = await _token(client)
    ids = [await start_run(client, "support", f"case {i}") for i in range(5)]
    ids.append(await start_run(client, "other", "x"))
    async with api(db_url) as base, session(token) as http:
        seen: list[str] = []
        cursor = ""
        while True:
            async with http.get(f"{base}/runs?agent=support&limit=2{cursor}") as r:
                page = await r.json()
            seen += [x["id"] for x in page["runs"]]
            if page["next_cursor"] is None:
                break
            cursor = f"&cursor={page['next_cursor']}"
        assert seen == ids[4::-1]
        async with http.get(f"{base}/runs?status=completed") as r:
            assert (await r.json())["runs"] == []


async def test_the_event_stream_follows_a_live_run_and_resumes_without_gaps_or_repeats(
    client: Client, db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    token = await _token(client)
    async with refund_agent(monkeypatch, db_url), api(db_url) as base, session(token) as http:
        run_id = await start_run(client, "support", "Refund me")
        url = f"{base}/runs/{_uuid(run_id)}/events"
        got: list[tuple[int, str]] = []

        async def read(last: int | None, until: str) -> None:
            headers = {"Accept": "text/event-stream"}
            if last is not None:
                headers["Last-Event-ID"] = str(last)
            with anyio.fail_after(20):
                async with http.get(url, headers=headers) as r:
                    assert r.content_type == "text/event-stream"
                    event_id, event_type = None, None
                    async for raw in r.content:
                        line = raw.decode().rstrip("\r\n")
                        if line.startswith("id: "):
                            event_id = int(line[4:])
                        elif line.startswith("event: "):
                            event_type = line[7:]
                        elif line == "" and event_id is not None:
                            got.append((event_id, event_type or ""))
                            if event_type == until:
                                return  # the client disconnects here
                            event_id = None

        await read(None, until="approval.requested")  # live: the run parks meanwhile
        async with http.post(
            f"{base}/runs/{_uuid(run_id)}/approvals", json={"call_id": "r1", "approved": True}
        ) as r:
            assert r.status == 200
        await read(got[-1][0], until="run.completed")  # resumes after the last id seen
    journal = await client.journal(run_id)
    assert got == [(e.seq, e.type) for e in journal]


async def test_healthz_shows_workers_of_different_versions_as_skewed(
    client: Client, db_url: str, workers: WorkerFactory
) -> None:
    workers(deploy_label="blue")
    workers(deploy_label="green")

    async def two() -> bool:
        return len(await client.pool.fetch("SELECT 1 FROM toren.workers")) == 2

    await wait_for(two, what="two workers registered")
    token = await _token(client)
    async with api(db_url) as base, session(token) as http:

        async def skewed() -> dict[str, Any] | None:
            async with http.get(f"{base}/healthz") as r:
                body: dict[str, Any] = await r.json()
            return body if len(body["workers"]) == 2 else None

        health = await wait_for(skewed, what="both workers live")
        # Anonymously: whether it is up and how many workers, but no host names or versions.
        async with aiohttp.ClientSession() as anonymous, anonymous.get(f"{base}/healthz") as r:
            assert r.status == 200
            seen = await r.json()
            assert r.headers["Cache-Control"] == "no-store"
        assert (seen["workers_live"], seen["workers"], seen["versions"]) == (2, None, None)
        assert health["workers_live"] == 2
    assert health["database"] is True
    assert health["version_skew"] is True
    assert [v.rsplit("+", 1)[1] for v in health["versions"]] == ["blue", "green"]


async def test_metrics_and_the_openapi_document(client: Client, db_url: str) -> None:
    token = await _token(client)
    await start_run(client, "support", "hello")
    async with api(db_url) as base, session(token) as http:
        async with http.get(f"{base}/runs") as r:
            assert r.status == 200
        async with http.get(f"{base}/metrics") as r:
            text = await r.text()
        assert 'toren_runs{status="running"} 1.0' in text
        assert 'toren_http_requests_total{method="GET",route="/runs",status="200"} 1.0' in text
        async with http.get(f"{base}/openapi.json") as r:
            doc = await r.json()
    assert doc["openapi"].startswith("3.")
    assert set(doc["paths"]) == {
        "/runs",
        "/runs/{run}",
        "/runs/{run}/events",
        "/runs/{run}/messages",
        "/runs/{run}/approvals",
        "/runs/{run}/cancel",
        "/runs/{run}/retry",
        "/runs/{run}/upgrade",
        "/agents/versions",
        "/runs/{run}/fork",
        "/runs/{run}/archive",
        "/channels",
        "/channels/{bot}/messages",
        "/telegram/{bot}",
        "/healthz",
        "/readyz",
        "/metrics",
        "/session",
        "/schedules",
        "/schedules/{agent}/{slot}",
        "/schedules/{agent}/{slot}/pause",
        "/schedules/{agent}/{slot}/resume",
        "/schedules/{agent}/{slot}/trigger",
        "/schedules/{agent}/{slot}/backfill",
        "/costs",
    }
