"""Authorization (issue 12): scopes, agent limits, expiry, who is recorded, unique token names,
what the access log keeps out, failed sign-ins limited, what anonymous callers see, no-store,
malformed cursors, MCP decisions off by default, and what the CLI refuses. One regression test
per finding; each asserts what used to be wrong."""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import logging
import os
import pwd
import re
import secrets
import socket
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Iterable
from datetime import UTC, datetime, timedelta
from typing import Any

import aiohttp
import anyio
import asyncpg
import pytest
from mcp import ClientSession, StdioServerParameters
from mcp.client.stdio import stdio_client
from mcp.client.streamable_http import streamable_http_client
from mcp.shared._httpx_utils import create_mcp_http_client
from yarl import URL

import toren._surfaces.tokens
from tests.conftest import ROOT, person, running_worker, wait_for
from tests.test_api import refund_agent
from toren import Client
from toren._core.logs import OWN_LOGGERS, configure
from toren._core.migrate import available, migrate
from toren._surfaces.http import ServerOptions
from toren._surfaces.mcp_server import serving_http
from toren._surfaces.serve import serving
from toren._surfaces.tokens import SCOPES, TokenNameTaken, create_token, revoke_token
from toren.runs import cancel, decide, read_run, start_run

pytestmark = pytest.mark.anyio

RUN_KIND = "toren.run"
DECISION = {"call_id": "r1", "approved": True, "reason": "fine"}


# --- helpers ------------------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def api(db_url: str, **options: Any) -> AsyncIterator[str]:
    """The HTTP API on a free port, with these ``ServerOptions``."""
    async with serving(db_url, port=0, options=ServerOptions(**options)) as base:
        yield base


@contextlib.asynccontextmanager
async def bearer(token: str | None = None) -> AsyncIterator[aiohttp.ClientSession]:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    async with aiohttp.ClientSession(headers=headers) as http:
        yield http


def sign_in(http: aiohttp.ClientSession, base: str, token: str) -> Any:
    """``POST /session`` as the console's sign-in form sends it (the redirect not followed)."""
    return http.post(f"{base}/session", data={"token": token}, allow_redirects=False)


@contextlib.asynccontextmanager
async def console(base: str, token: str) -> AsyncIterator[tuple[aiohttp.ClientSession, str]]:
    """A browser-like session signed in to the console with ``token`` (through the sign-in
    form); yields it and the session cookie's value."""
    jar = aiohttp.CookieJar(unsafe=True)  # unsafe: accept cookies from an IP address
    async with aiohttp.ClientSession(cookie_jar=jar) as http:
        async with sign_in(http, base, token) as r:
            assert r.status == 303, await r.text()
            assert r.headers["Location"] == "/"
        cookie = jar.filter_cookies(URL(base))["toren_session"].value
        yield http, cookie


async def _token(
    client: Client,
    name: str,
    scopes: Iterable[str] = SCOPES,
    *,
    agents: Iterable[str] | None = None,
    expires_in: float | None = None,
) -> tuple[str, str]:
    return await create_token(
        client.pool, name, scopes=scopes, agents=agents, expires_in=expires_in
    )


def _uuid(run_id: str) -> str:
    return run_id.removeprefix("run/")


async def _problem(response: aiohttp.ClientResponse, status: int) -> dict[str, Any]:
    """The response's problem document, after checking it is one with ``status``."""
    assert response.status == status, await response.text()
    assert response.content_type == "application/problem+json"
    body: dict[str, Any] = await response.json()
    assert body["status"] == status
    return body


async def _status(client: Client, run_id: str, status: str) -> bool:
    return (await read_run(client, run_id)).status == status


async def _parked_run(client: Client, text: str = "Refund me") -> str:
    """A run of ``support`` parked on the approval of call r1 (inside ``refund_agent``)."""
    run_id = await start_run(client, "support", text)
    await wait_for(lambda: _status(client, run_id, "parked"), what=f"{run_id} parked")
    return run_id


async def _events(client: Client, run_id: str, event_type: str) -> list[dict[str, Any]]:
    return [e.data for e in await client.journal(run_id) if e.type == event_type]


async def _runs(client: Client) -> int:
    count: int = await client.pool.fetchval(
        "SELECT count(*) FROM toren.actors WHERE kind = $1", RUN_KIND
    )
    return count


async def _mail(client: Client) -> list[str]:
    rows = await client.pool.fetch("SELECT kind FROM toren.mailbox ORDER BY id")
    return [r["kind"] for r in rows]


@contextlib.asynccontextmanager
async def mcp_http(url: str, token: str) -> AsyncIterator[ClientSession]:
    http = create_mcp_http_client(headers={"Authorization": f"Bearer {token}"})
    async with (
        http,
        streamable_http_client(url, http_client=http) as (read, write, *_),
        ClientSession(read, write) as mcp,
    ):
        await mcp.initialize()
        yield mcp


@contextlib.asynccontextmanager
async def mcp_stdio(db_url: str, *flags: str) -> AsyncIterator[ClientSession]:
    params = StdioServerParameters(
        command=sys.executable,
        args=["-m", "toren", "mcp", *flags],
        env={**os.environ, "TOREN_DATABASE_URL": db_url, "PYTHONPATH": str(ROOT)},
        cwd=str(ROOT),
    )
    async with stdio_client(params) as (read, write), ClientSession(read, write) as mcp:
        await mcp.initialize()
        yield mcp


def toren_cli(*args: str, db_url: str, **env: str) -> subprocess.CompletedProcess[str]:
    """``toren ARGS`` as a process, with ``env`` on top of a clean Toren environment."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("TOREN_")}
    full_env.update(
        {"PYTHONPATH": str(ROOT), "TOREN_DATABASE_URL": db_url, "COLUMNS": "250", **env}
    )
    return subprocess.run(
        [sys.executable, "-m", "toren", *args],
        env=full_env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


async def cli(*args: str, db_url: str, **env: str) -> subprocess.CompletedProcess[str]:
    return await anyio.to_thread.run_sync(lambda: toren_cli(*args, db_url=db_url, **env))


def _cursor(text: str | bytes) -> str:
    raw = text.encode() if isinstance(text, str) else text
    return base64.urlsafe_b64encode(raw).decode()


# --- 1. scopes ----------------------------------------------------------------------------------


async def test_a_read_only_token_cannot_start_send_cancel_or_decide_over_http(
    client: Client, db_url: str
) -> None:
    _, token = await _token(client, "reader", ["read"])
    run_id = await start_run(client, "support", "hello")
    run = _uuid(run_id)
    writes = [
        ("/runs", {"agent": "support", "input": "another"}, "operate"),
        (f"/runs/{run}/messages", {"text": "hi"}, "operate"),
        (f"/runs/{run}/cancel", {}, "operate"),
        (f"/runs/{run}/retry", {}, "operate"),
        (f"/runs/{run}/fork", {"at": 1}, "operate"),
        (f"/runs/{run}/approvals", DECISION, "approve"),
    ]
    async with api(db_url) as base, bearer(token) as http:
        async with http.get(f"{base}/runs/{run}") as r:
            assert r.status == 200  # it may read
        for path, body, scope in writes:
            async with http.post(f"{base}{path}", json=body) as r:
                problem = await _problem(r, 403)
            assert f"lacks the {scope!r} scope" in problem["detail"], path
    assert await _runs(client) == 1
    assert await _mail(client) == ["run.start"]  # nothing reached the run


async def test_a_read_only_console_session_cannot_decide(client: Client, db_url: str) -> None:
    _, token = await _token(client, "reader", ["read"])
    run_id = await start_run(client, "support", "hello")
    async with api(db_url) as base, console(base, token) as (http, _):
        async with http.get(f"{base}/session") as r:
            assert r.status == 200
            me = await r.json()
        assert me["scopes"] == ["read"]
        assert me["principal"]["via"] == "console"
        headers = {"X-CSRF-Token": me["csrf"]}  # a well-formed console write: only scope lacks
        async with http.post(
            f"{base}/runs/{_uuid(run_id)}/approvals", json=DECISION, headers=headers
        ) as r:
            problem = await _problem(r, 403)
        assert "lacks the 'approve' scope" in problem["detail"]
        async with http.post(f"{base}/runs", json={"agent": "support", "input": "x"}) as r:
            await _problem(r, 403)
    assert await _mail(client) == ["run.start"]


async def test_a_read_only_token_over_mcp_http_cannot_start_send_or_decide(
    client: Client, db_url: str
) -> None:
    _, token = await _token(client, "reader", ["read"])
    run_id = await start_run(client, "support", "hello")
    async with (
        serving_http(db_url, host="127.0.0.1", port=0, allow_decisions=True) as url,
        mcp_http(url, token) as mcp,
    ):
        listed = await mcp.call_tool("list_runs", {})
        assert not listed.is_error, listed
        calls = [
            ("start_run", {"agent": "support", "input": "another"}),
            ("send_message", {"run_id": run_id, "text": "hi"}),
            ("approve", {"run_id": run_id, "call_id": "r1"}),
            ("deny", {"run_id": run_id, "call_id": "r1"}),
        ]
        for tool, arguments in calls:
            result = await mcp.call_tool(tool, arguments)
            assert result.is_error, tool
    assert await _runs(client) == 1
    assert await _mail(client) == ["run.start"]


# --- 2. agent limits ----------------------------------------------------------------------------


async def test_an_approve_token_limited_to_one_agent_decides_only_its_runs(
    client: Client, db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, other = await _token(client, "strict-approver", ["read", "approve"], agents=["strict"])
    _, own = await _token(client, "support-approver", ["read", "approve"], agents=["support"])
    async with refund_agent(monkeypatch, db_url), api(db_url) as base:
        run_id = await _parked_run(client)
        url = f"{base}/runs/{_uuid(run_id)}/approvals"
        async with bearer(other) as http, http.post(url, json=DECISION) as r:
            problem = await _problem(r, 403)
        assert "may not act on runs of agent 'support'" in problem["detail"]
        assert (await read_run(client, run_id)).decisions == {}
        async with bearer(other) as http, http.post(f"{base}/runs/{_uuid(run_id)}/cancel") as r:
            await _problem(r, 403)  # no operate scope either
        async with bearer(own) as http, http.post(url, json=DECISION) as r:
            assert r.status == 200, await r.text()
            assert (await r.json())["outcome"] == "applied"
        await wait_for(lambda: _status(client, run_id, "completed"), what="completed")


async def test_an_operate_token_limited_to_one_agent_starts_and_steers_only_its_runs(
    client: Client, db_url: str
) -> None:
    _, token = await _token(client, "strict-operator", ["read", "operate"], agents=["strict"])
    support_run = await start_run(client, "support", "hello")
    async with api(db_url) as base, bearer(token) as http:
        async with http.post(f"{base}/runs", json={"agent": "support", "input": "x"}) as r:
            await _problem(r, 403)
        for action, body in (("messages", {"text": "hi"}), ("cancel", {}), ("fork", {"at": 1})):
            async with http.post(f"{base}/runs/{_uuid(support_run)}/{action}", json=body) as r:
                await _problem(r, 403)
        async with http.post(f"{base}/runs", json={"agent": "strict", "input": "x"}) as r:
            assert r.status == 201, await r.text()
        async with http.get(f"{base}/runs/{_uuid(support_run)}") as r:
            assert r.status == 200  # reading is not limited to the agents
    assert await _runs(client) == 2
    assert await _mail(client) == ["run.start", "run.start"]


# --- 3. expiry ----------------------------------------------------------------------------------


async def test_an_expired_token_is_refused(client: Client, db_url: str) -> None:
    _, token = await _token(client, "brief", ["read"], expires_in=3)
    seen: list[int] = []
    async with api(db_url) as base, bearer(token) as http:

        async def refused() -> bool:
            async with http.get(f"{base}/runs") as r:
                seen.append(r.status)
                return r.status == 401

        await wait_for(refused, timeout=15, what="the expired token refused")
        assert seen[0] == 200  # it worked until it expired
        assert set(seen) == {200, 401}
        async with http.get(f"{base}/runs") as r:
            problem = await _problem(r, 401)
        assert "expired" in problem["detail"]
    assert await toren._surfaces.tokens.authenticate(client.pool, token) is None


# --- 4. who is recorded -------------------------------------------------------------------------


async def test_events_caused_over_http_record_the_token_as_principal(
    client: Client, db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    token_id, token = await _token(client, "alice")
    async with refund_agent(monkeypatch, db_url), api(db_url) as base, bearer(token) as http:
        async with http.post(f"{base}/runs", json={"agent": "support", "input": "Refund"}) as r:
            assert r.status == 201, await r.text()
            run_id = (await r.json())["id"]
        await wait_for(lambda: _status(client, run_id, "parked"), what="parked")
        run = _uuid(run_id)
        async with http.post(f"{base}/runs/{run}/messages", json={"text": "quickly"}) as r:
            assert r.status == 202
        await wait_for(lambda: _events(client, run_id, "message.received"), what="message")
        async with http.post(f"{base}/runs/{run}/approvals", json=DECISION) as r:
            assert r.status == 200
        await wait_for(lambda: _status(client, run_id, "completed"), what="completed")
    principal = {"kind": "token", "id": token_id, "name": "alice", "via": "http"}
    for event_type in ("run.started", "message.received", "approval.decided"):
        [data] = await _events(client, run_id, event_type)
        assert data["by"] == principal, event_type


# --- 5. token names -----------------------------------------------------------------------------


async def test_two_live_tokens_cannot_share_a_name_but_a_revoked_name_is_free(
    client: Client, db_url: str
) -> None:
    first_id, _ = await _token(client, "ci", ["read"])
    with pytest.raises(TokenNameTaken, match="'ci'"):
        await _token(client, "ci", ["read"])
    again = await cli("tokens", "create", "ci", db_url=db_url)
    assert again.returncode == 1, again
    assert "a live token is already named 'ci'" in again.stderr
    assert "Traceback" not in again.stderr
    assert not again.stdout.strip()  # no token printed
    assert await client.pool.fetchval("SELECT count(*) FROM toren.tokens") == 1
    assert await revoke_token(client.pool, first_id)
    second_id, _ = await _token(client, "ci", ["read"])
    assert second_id != first_id


# --- 6. the access log --------------------------------------------------------------------------


async def test_the_access_log_names_the_token_id_never_a_secret_or_cookie(
    client: Client, db_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="toren.http.access")
    token_id, token = await _token(client, "logged", ["read"])
    secret = token.split("_", 2)[2]
    run_id = await start_run(client, "support", "hello")
    async with api(db_url) as base:
        async with bearer(token) as http:
            async with http.get(f"{base}/runs?agent=support&limit=5") as r:
                assert r.status == 200
            async with http.get(f"{base}/runs/{_uuid(run_id)}") as r:
                assert r.status == 200
        async with bearer(token[:-3] + "xyz") as http, http.get(f"{base}/runs") as r:
            assert r.status == 401
        async with console(base, token) as (http, cookie):
            async with http.get(f"{base}/session") as r:
                assert r.status == 200
            async with http.get(f"{base}/runs?cursor={cookie}") as r:
                assert r.status == 422  # the cookie's value in a query: not logged either
    lines = [r.getMessage() for r in caplog.records if r.name == "toren.http.access"]
    assert any(
        line.startswith("GET /runs 200 127.0.0.1 token:" + token_id + " ") for line in lines
    ), lines
    assert any(
        line.startswith(f"GET /runs/{_uuid(run_id)} 200 127.0.0.1 token:{token_id} ")
        for line in lines
    ), lines
    assert any(line.startswith("GET /runs 401 127.0.0.1 - ") for line in lines), lines
    assert any(line.startswith("POST /session ") for line in lines), lines
    assert any(
        line.startswith(f"GET /session 200 127.0.0.1 token:{token_id} ") for line in lines
    ), lines
    everything = caplog.text + "\n".join(lines)
    for leaked in (token, secret, cookie, "limit=5", "agent=support"):
        assert leaked not in everything, leaked


# --- 7. failed sign-ins -------------------------------------------------------------------------


async def test_failed_bearer_tokens_are_limited_per_address(client: Client, db_url: str) -> None:
    _, good = await _token(client, "good", ["read"])
    async with api(db_url, failed_auth_per_minute=3) as base:
        for n in range(3):
            async with bearer(f"trn_bad{n}_guess{n}") as http, http.get(f"{base}/runs") as r:
                await _problem(r, 401)
        async with bearer("trn_bad3_guess3") as http, http.get(f"{base}/runs") as r:
            await _problem(r, 429)
            assert 1 <= int(r.headers["Retry-After"]) <= 60
        async with bearer(good) as http, http.get(f"{base}/runs") as r:
            await _problem(r, 429)  # the address is refused, whatever it sends now
            assert int(r.headers["Retry-After"]) >= 1
        async with aiohttp.ClientSession() as http, sign_in(http, base, good) as r:
            await _problem(r, 429)


async def test_failed_console_sign_ins_are_limited_per_address(client: Client, db_url: str) -> None:
    _, good = await _token(client, "good", ["read"])
    async with api(db_url, failed_auth_per_minute=3) as base, aiohttp.ClientSession() as http:
        for n in range(3):
            async with sign_in(http, base, f"trn_bad{n}_x") as r:
                assert r.status == 303
                assert r.headers["Location"] == "/?denied=1"
        async with sign_in(http, base, good) as r:
            await _problem(r, 429)
            assert int(r.headers["Retry-After"]) >= 1
        async with bearer(good) as api_http, api_http.get(f"{base}/runs") as r:
            await _problem(r, 429)  # one count per address, whichever way it signs in
    assert await client.pool.fetchval("SELECT count(*) FROM toren.sessions") == 0


@pytest.mark.parametrize("shaped", [False, True], ids=["malformed", "well-formed"])
async def test_concurrent_failures_pass_the_limit_exactly(
    client: Client, db_url: str, shaped: bool
) -> None:
    # 60 guesses at once from one address: each is counted before it is checked, under a lock
    # of its address in Postgres, so exactly the limit's worth are checked and answered 401
    # (a check, then a count, let every guess in flight pass the check).
    async with api(db_url, failed_auth_per_minute=4) as base:

        async def guess(n: int) -> int:
            token = f"trn_{n:x}_guess{n}" if shaped else f"not a token {n}"
            async with bearer(token) as http, http.get(f"{base}/runs") as r:
                return r.status

        statuses: list[int] = []

        async def one(n: int) -> None:
            statuses.append(await guess(n))

        async with anyio.create_task_group() as tg:
            for n in range(60):
                tg.start_soon(one, n)
        assert sorted(statuses) == [401] * 4 + [429] * 56
    assert await client.pool.fetchval("SELECT count(*) FROM toren.auth_failures") == 4


async def test_a_token_that_passes_is_not_counted_as_a_failure(client: Client, db_url: str) -> None:
    _, good = await _token(client, "good", ["read"])
    async with api(db_url, failed_auth_per_minute=2) as base:
        async with bearer(good) as http, http.get(f"{base}/runs") as r:
            assert r.status == 200
        async with aiohttp.ClientSession() as http, sign_in(http, base, good) as r:
            assert r.status == 303
            assert r.headers["Location"] == "/"
        assert await client.pool.fetchval("SELECT count(*) FROM toren.auth_failures") == 0
        for n in range(2):
            async with bearer(f"trn_bad{n}_guess{n}") as http, http.get(f"{base}/runs") as r:
                await _problem(r, 401)
        async with bearer("trn_bad9_guess9") as http, http.get(f"{base}/runs") as r:
            await _problem(r, 429)


# --- 7b. console sessions per token (issue 26) --------------------------------------------------


async def _session_cookie(http: aiohttp.ClientSession, base: str, token: str) -> str:
    """A sign-in's session cookie (read from its answer: the jar takes none from an address)."""
    async with sign_in(http, base, token) as r:
        assert r.status == 303, await r.text()
        return r.cookies["toren_session"].value


async def _with_cookie(http: aiohttp.ClientSession, base: str, cookie: str) -> int:
    async with http.get(f"{base}/session", headers={"Cookie": f"toren_session={cookie}"}) as r:
        return r.status


async def _live_sessions(client: Client, token_id: str) -> int:
    count: int = await client.pool.fetchval(
        "SELECT count(*) FROM toren.sessions WHERE token_id = $1 AND expires_at > now()", token_id
    )
    return count


async def test_a_sign_in_past_ten_sessions_ends_the_tokens_oldest(
    client: Client, db_url: str
) -> None:
    token_id, token = await _token(client, "browser", ["read"])
    async with api(db_url) as base, aiohttp.ClientSession() as http:
        cookies = [await _session_cookie(http, base, token) for _ in range(12)]
        assert await _live_sessions(client, token_id) == 10
        assert [await _with_cookie(http, base, c) for c in cookies[:2]] == [401, 401]
        assert await _with_cookie(http, base, cookies[2]) == 200  # the oldest one kept
        assert await _with_cookie(http, base, cookies[-1]) == 200


async def test_concurrent_sign_ins_with_one_token_leave_at_most_ten_sessions(
    client: Client, db_url: str
) -> None:
    token_id, token = await _token(client, "browsers", ["read"])
    other_id, other = await _token(client, "another", ["read"])
    cookies: list[str] = []
    async with api(db_url) as base, aiohttp.ClientSession() as http:
        other_cookie = await _session_cookie(http, base, other)

        async def one() -> None:
            cookies.append(await _session_cookie(http, base, token))

        async with anyio.create_task_group() as tg:
            for _ in range(20):
                tg.start_soon(one)
        assert len(cookies) == 20  # every sign-in succeeded
        assert await _live_sessions(client, token_id) == 10
        assert await _with_cookie(http, base, other_cookie) == 200  # another token's: untouched
    assert await _live_sessions(client, other_id) == 1


async def test_a_failed_token_is_checked_against_the_database_once(
    client: Client, db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    looked_up: list[str] = []
    real = toren._surfaces.tokens.authenticate

    async def counting(pool: asyncpg.Pool, token: str, *, via: str = "http") -> Any:
        looked_up.append(token)
        return await real(pool, token, via=via)

    monkeypatch.setattr(toren._surfaces.tokens, "authenticate", counting)
    _, good = await _token(client, "good", ["read"])
    wrong = good[:-4] + "nope"
    async with api(db_url) as base, bearer(wrong) as http:
        for _ in range(3):
            async with http.get(f"{base}/runs") as r:
                await _problem(r, 401)
    assert looked_up == [wrong]


# --- 8. healthz ---------------------------------------------------------------------------------


async def test_healthz_shows_workers_and_versions_only_to_an_authenticated_caller(
    client: Client, db_url: str
) -> None:
    _, token = await _token(client, "monitor", ["read"])
    async with running_worker(db_url), api(db_url) as base:
        async with bearer(token) as http:

            async def shown() -> dict[str, Any] | None:
                async with http.get(f"{base}/healthz") as r:
                    body: dict[str, Any] = await r.json()
                return body if body["workers"] else None

            health = await wait_for(shown, what="the worker shown")
        async with bearer() as anonymous, anonymous.get(f"{base}/healthz") as r:
            assert r.status == 200
            text = await r.text()
            seen = await r.json()
    [worker] = health["workers"]
    assert health["versions"] == [worker["version"]]
    assert (seen["status"], seen["workers_live"]) == ("ok", 1)
    assert (seen["workers"], seen["versions"]) == (None, None)
    for detail in (worker["name"], worker["version"], worker["worker_id"], socket.gethostname()):
        assert detail not in text, detail


# --- 9. no-store --------------------------------------------------------------------------------


async def test_api_responses_are_never_cached(client: Client, db_url: str) -> None:
    _, token = await _token(client, "reader", ["read"])
    async with api(db_url) as base:
        async with bearer(token) as http:
            for path, status in (
                ("/runs", 200),
                ("/openapi.json", 200),
                (f"/runs/{uuid.uuid4().hex}", 404),
                ("/metrics", 200),
            ):
                async with http.get(f"{base}{path}") as r:
                    assert r.status == status, path
                    assert r.headers["Cache-Control"] == "no-store", path
        async with bearer() as anonymous, anonymous.get(f"{base}/runs") as r:
            await _problem(r, 401)
            assert r.headers["Cache-Control"] == "no-store"


# --- 10. malformed query values -----------------------------------------------------------------


async def test_malformed_after_limit_and_cursor_values_are_422_never_500(
    client: Client, db_url: str
) -> None:
    _, token = await _token(client, "reader", ["read"])
    run_id = await start_run(client, "support", "hello")
    some_run = f"run/{uuid.uuid4()}"
    cursors = {
        "nul": _cursor("2024-01-01T00:00:00+00:00|run/\x00"),
        "before year 1 in UTC": _cursor(f"0001-01-01T00:00:00+01:00|{some_run}"),
        "after year 9999 in UTC": _cursor(f"9999-12-31T23:59:59-01:00|{some_run}"),
        "naive": _cursor(f"2024-01-01T00:00:00|{some_run}"),
        "random": _cursor(secrets.token_bytes(24)),
        "not a run": _cursor(f"2024-01-01T00:00:00+00:00|{uuid.uuid4()}"),
        "no separator": _cursor("2024-01-01T00:00:00+00:00"),
    }
    paths = {
        "after 2**66": f"/runs/{_uuid(run_id)}/events?after=99999999999999999999",
        "after -1": f"/runs/{_uuid(run_id)}/events?after=-1",
        "after abc": f"/runs/{_uuid(run_id)}/events?after=abc",
        "limit huge": "/runs?limit=99999999999999999999999",
        **{f"cursor {name}": f"/runs?cursor={value}" for name, value in cursors.items()},
    }
    async with api(db_url) as base, bearer(token) as http:
        for name, path in paths.items():
            async with http.get(f"{base}{path}") as r:
                assert r.status == 422, (name, r.status, await r.text())
                assert r.content_type == "application/problem+json", name
        huge = {"Last-Event-ID": "99999999999999999999"}
        async with http.get(f"{base}/runs/{_uuid(run_id)}/events", headers=huge) as r:
            await _problem(r, 422)
        # The first and last instants there are: positions before every run, or after.
        for at, shown in (
            ("0001-01-01T00:00:00+00:00", []),
            ("9999-12-31T23:59:59+00:00", [run_id]),
        ):
            async with http.get(f"{base}/runs?cursor={_cursor(f'{at}|{some_run}')}") as r:
                assert r.status == 200, (at, await r.text())
                assert [x["id"] for x in (await r.json())["runs"]] == shown, at


# --- 11. MCP start_run validates ----------------------------------------------------------------


async def test_mcp_start_run_refuses_a_malformed_agent_and_creates_no_run(
    client: Client, db_url: str
) -> None:
    _, token = await _token(client, "claude")
    async with (
        serving_http(db_url, host="127.0.0.1", port=0) as url,
        mcp_http(url, token) as mcp,
    ):
        for agent in ("../../x", "has space", ""):
            result = await mcp.call_tool("start_run", {"agent": agent, "input": "hi"})
            assert result.is_error, agent
        empty = await mcp.call_tool("start_run", {"agent": "support", "input": ""})
        assert empty.is_error
    assert await _runs(client) == 0
    assert await _mail(client) == []


# --- 12. acting on an ended run -----------------------------------------------------------------


async def test_deciding_or_cancelling_a_completed_run_is_refused(
    client: Client, db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, token = await _token(client, "ops")
    async with refund_agent(monkeypatch, db_url), api(db_url) as base:
        run_id = await _parked_run(client)
        await decide(client, run_id, call_id="r1", approved=True, by=person("alice"))
        await wait_for(lambda: _status(client, run_id, "completed"), what="completed")
        approve = await cli("jobs", "approve", run_id, db_url=db_url)
        assert approve.returncode == 1, approve
        assert "not waiting for a decision (it is completed)" in approve.stderr
        named = await cli("jobs", "approve", run_id, "--call", "r9", db_url=db_url)
        assert named.returncode == 1, named
        assert "not applied" in named.stderr
        assert "status completed" in named.stderr
        deny = await cli("jobs", "deny", run_id, "--call", "r1", db_url=db_url)
        assert deny.returncode == 1, deny
        assert "already approved by alice" in deny.stderr
        stop = await cli("jobs", "cancel", run_id, db_url=db_url)
        assert stop.returncode == 1, stop
        assert "has already completed; there is nothing to cancel" in stop.stderr
        async with bearer(token) as http, http.post(f"{base}/runs/{_uuid(run_id)}/cancel") as r:
            problem = await _problem(r, 409)
        assert "has already completed" in problem["detail"]
    assert (await read_run(client, run_id)).status == "completed"
    assert await _events(client, run_id, "run.failed") == []


# --- 13. the CLI's user -------------------------------------------------------------------------


async def test_the_cli_records_the_uid_user_not_logname(
    client: Client, db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with refund_agent(monkeypatch, db_url):
        run_id = await _parked_run(client)
        sent = await cli(
            "jobs", "send", run_id, "hi", db_url=db_url, LOGNAME="someone", USER="someone"
        )
        assert sent.returncode == 0, sent.stderr
        [received] = await wait_for(
            lambda: _events(client, run_id, "message.received"), what="message.received"
        )
    uid = os.getuid()
    me = {"kind": "os_user", "id": str(uid), "name": pwd.getpwuid(uid).pw_name, "via": "cli"}
    assert received["by"] == me
    assert "someone" not in str(received)


# --- 14. MCP decisions are opt-in ---------------------------------------------------------------


async def test_mcp_over_stdio_offers_decisions_only_when_allowed(db_url: str) -> None:
    async with mcp_stdio(db_url) as mcp:
        tools = {t.name for t in (await mcp.list_tools()).tools}
        refused = await mcp.call_tool("approve", {"run_id": "run/x", "call_id": "r1"})
        assert refused.is_error
    schedules = {"list_schedules", "pause_schedule", "resume_schedule", "trigger_schedule"} | {
        "create_schedule",
        "backfill_schedule",
        "delete_schedule",
    }
    assert tools == {"list_runs", "read_run", "start_run", "send_message"} | schedules
    async with mcp_stdio(db_url, "--allow-decisions") as mcp:
        allowed = {t.name for t in (await mcp.list_tools()).tools}
    assert allowed == tools | {"approve", "deny"}


# --- 15. tokens from the CLI --------------------------------------------------------------------


async def test_cli_tokens_are_read_only_unless_scopes_are_given(
    client: Client, db_url: str
) -> None:
    plain = await cli("tokens", "create", "reader", db_url=db_url)
    assert plain.returncode == 0, plain.stderr
    assert "no --scope given: the token may only read" in plain.stderr
    reader_id = plain.stdout.strip().split("_")[1]
    full = await cli(
        "tokens",
        "create",
        "deployer",
        "--scope",
        "operate",
        "--scope",
        "approve",
        "--agent",
        "support",
        "--expires",
        "30d",
        db_url=db_url,
    )
    assert full.returncode == 0, full.stderr
    assert "no --scope" not in full.stderr
    deployer_id = full.stdout.strip().split("_")[1]
    rows = {
        r["id"]: r
        for r in await client.pool.fetch(
            "SELECT id, scopes, agents, expires_at, now() AS now FROM toren.tokens"
        )
    }
    assert (rows[reader_id]["scopes"], rows[reader_id]["agents"]) == (["read"], None)
    assert rows[reader_id]["expires_at"] is None
    deployer = rows[deployer_id]
    assert (deployer["scopes"], deployer["agents"]) == (["operate", "approve"], ["support"])
    lifetime = deployer["expires_at"] - deployer["now"]
    assert timedelta(days=30) - timedelta(minutes=2) < lifetime <= timedelta(days=30)
    listed = await cli("tokens", "list", db_url=db_url)
    assert listed.returncode == 0, listed.stderr
    [reader_line] = [line for line in listed.stdout.splitlines() if reader_id in line]
    [deployer_line] = [line for line in listed.stdout.splitlines() if deployer_id in line]
    assert "read" in reader_line
    assert "all" in reader_line
    assert "operate approve" in deployer_line
    assert "support" in deployer_line
    assert deployer["expires_at"].date().isoformat() in deployer_line


# --- 16. secure cookies -------------------------------------------------------------------------


async def test_secure_cookies_marks_the_session_cookie_secure_on_plain_http(
    client: Client, db_url: str
) -> None:
    _, token = await _token(client, "reader", ["read"])

    async def set_cookie(**options: Any) -> str:
        async with (
            api(db_url, **options) as base,
            aiohttp.ClientSession() as http,
            sign_in(http, base, token) as r,
        ):
            assert r.status == 303
            [cookie] = r.headers.getall("Set-Cookie")
        return cookie

    secure = await set_cookie(secure_cookies=True)
    default = await set_cookie()
    assert secure.startswith("toren_session=")
    assert "secure" in [part.strip().lower() for part in secure.split(";")]
    assert "secure" not in [part.strip().lower() for part in default.split(";")]
    assert "httponly" in [part.strip().lower() for part in default.split(";")]


# --- 17. migration 0003 -------------------------------------------------------------------------


async def test_migration_0003_keeps_old_tokens_working_and_makes_names_unique(
    empty_db_url: str,
) -> None:
    conn = await asyncpg.connect(empty_db_url)
    try:
        await _migrated_to_0002(conn)
        secrets_by_id = {"aaa111": "first-secret", "bbb222": "second-secret", "ccc333": "gone"}
        created = datetime(2024, 1, 1, tzinfo=UTC)
        for n, (token_id, secret) in enumerate(secrets_by_id.items()):
            await conn.execute(
                "INSERT INTO toren.tokens (id, name, secret_sha256, created_at, revoked_at) "
                "VALUES ($1, 'ci', $2, $3, $4)",
                token_id,
                hashlib.sha256(secret.encode()).digest(),
                created + timedelta(hours=n),
                created if token_id == "ccc333" else None,
            )
        assert (await migrate(conn))[0] == 3  # and every later migration
        rows = await conn.fetch("SELECT id, name, scopes, agents, expires_at FROM toren.tokens")
        tokens = {r["id"]: r for r in rows}
        assert {i: r["name"] for i, r in tokens.items()} == {
            "aaa111": "ci",
            "bbb222": "ci-bbb222",
            "ccc333": "ci",  # revoked: its name is free anyway
        }
        for row in rows:
            assert row["scopes"] == ["read", "operate", "approve"]
            assert (row["agents"], row["expires_at"]) == (None, None)
        for token_id in ("aaa111", "bbb222"):
            token = f"trn_{token_id}_{secrets_by_id[token_id]}"
            access = await toren._surfaces.tokens.authenticate(conn, token)  # type: ignore[arg-type]
            assert access is not None
            assert access.scopes == frozenset(SCOPES)
        with pytest.raises(TokenNameTaken):
            await create_token(conn, "ci")
        _, fresh = await create_token(conn, "new")
        fresh_scopes = await conn.fetchval(
            "SELECT scopes FROM toren.tokens WHERE id = $1", fresh.split("_")[1]
        )
        assert fresh_scopes == ["read"]  # a token made after the migration: read by default
    finally:
        await conn.close()


async def test_mcp_tool_errors_tell_the_client_why(client: Client, db_url: str) -> None:
    _, token = await _token(client, "reader", ["read"])
    async with (
        serving_http(db_url, host="127.0.0.1", port=0) as url,
        mcp_http(url, token) as mcp,
    ):
        result = await mcp.call_tool("start_run", {"agent": "support", "input": "hi"})
    assert result.is_error
    assert "forbidden: this token lacks the 'operate' scope" in result.content[0].text


async def test_under_torens_own_log_handler_the_access_log_is_a_line_per_request_redacted(
    client: Client, db_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # toren serve configures its one handler: the lines are then written in batches, off the
    # request's path, in the handler's own format.
    token_id, token = await _token(client, "logged", ["read"])
    run_id = await start_run(client, "support", "hello")
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    levels = {name: logging.getLogger(name).level for name in OWN_LOGGERS}
    try:
        configure()
        async with api(db_url) as base, bearer(token) as http:
            async with http.get(f"{base}/runs/{_uuid(run_id)}") as r:
                assert r.status == 200
            async with http.get(f"{base}/nothing/123456:{'A' * 20}") as r:
                assert r.status == 404
    finally:
        root.handlers[:], root.level = handlers, level
        for name, old in levels.items():
            logging.getLogger(name).setLevel(old)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if " toren.http.access: " in line]
    stamp = r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z INFO toren\.http\.access: "
    assert len(lines) == 2, err
    assert re.fullmatch(
        stamp + f"GET /runs/{_uuid(run_id)} 200 127\\.0\\.0\\.1 token:{token_id} " + r"\d+\.\dms",
        lines[0],
    ), lines
    assert re.fullmatch(
        stamp + r"GET /nothing/<bot token> 404 127\.0\.0\.1 \S+ \d+\.\dms", lines[1]
    )
    assert "AAAAAAAAAA" not in err


async def test_an_embedding_apps_logging_gets_a_record_per_request_with_its_fields_as_before(
    client: Client, db_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    # An application that embeds the API with logging of its own gets each line as the record
    # a request logged before lines were batched: a format and the fields as its arguments,
    # which a filter may read (here, one that leaves health checks out).
    class NoHealthChecks(logging.Filter):
        def filter(self, record: logging.LogRecord) -> bool:
            return record.args is None or record.args[1] != "/healthz"

    caplog.set_level(logging.INFO, logger="toren.http.access")
    access = logging.getLogger("toren.http.access")
    quiet = NoHealthChecks()
    access.addFilter(quiet)
    try:
        async with api(db_url) as base, aiohttp.ClientSession() as http:
            async with http.get(f"{base}/healthz") as r:
                assert r.status == 200
            async with http.get(f"{base}/openapi.json") as r:
                assert r.status == 401  # no token
    finally:
        access.removeFilter(quiet)
    records = [r for r in caplog.records if r.name == "toren.http.access"]
    assert [r.getMessage().rsplit(" ", 1)[0] for r in records] == [
        "GET /openapi.json 401 127.0.0.1 -"
    ], caplog.text
    assert records[0].msg == "%s %s %s %s %s %.1fms"
    assert records[0].args is not None
    assert records[0].args[:5] == ("GET", "/openapi.json", 401, "127.0.0.1", "-")


async def test_a_console_sign_in_is_logged_and_counted_as_the_redirect_it_is(
    client: Client, db_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="toren.http.access")
    _, token = await _token(client, "reader", ["read"])
    async with api(db_url) as base:
        async with console(base, token):
            pass
        async with bearer(token) as http, http.get(f"{base}/metrics") as r:
            metrics = await r.text()
    lines = [r.getMessage() for r in caplog.records if r.name == "toren.http.access"]
    assert any(line.startswith("POST /session 303 127.0.0.1 - ") for line in lines), lines
    assert 'method="POST",route="/session",status="303"' in metrics


# --- 18. the security review's findings ---------------------------------------------------------


async def _raw_http(base: str, *lines: bytes) -> tuple[int, dict[str, str], bytes]:
    """A request written byte for byte to a socket (what HTTP client libraries refuse to send:
    raw bytes in a header), with ``Connection: close``; the response read to its end."""
    url = URL(base)
    assert url.host is not None
    assert url.port is not None
    request = b"\r\n".join([*lines, b"Connection: close", b"", b""])
    got = b""
    with anyio.fail_after(15):
        async with await anyio.connect_tcp(url.host, url.port) as stream:
            await stream.send(request)
            with contextlib.suppress(anyio.EndOfStream, anyio.BrokenResourceError):
                while True:
                    got += await stream.receive()
    head, _, body = got.partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for line in header_lines:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    return int(status_line.split()[1]), headers, body


def _raw_problem(answer: tuple[int, dict[str, str], bytes], status: int) -> dict[str, Any]:
    code, headers, body = answer
    assert code == status, (code, body)
    assert headers["content-type"].startswith("application/problem+json"), headers
    problem: dict[str, Any] = json.loads(body)
    assert problem["status"] == status
    return problem


RAW_BEARER = b"Authorization: Bearer trn_ab_\xff"  # a byte that is not UTF-8
RAW_COOKIE = b"Cookie: toren_session=a\xffb"


async def test_raw_bytes_in_a_bearer_token_are_refused_never_a_500(
    client: Client, db_url: str
) -> None:
    async with api(db_url, failed_auth_per_minute=3) as base:
        runs = await _raw_http(base, b"GET /runs HTTP/1.1", b"Host: 127.0.0.1", RAW_BEARER)
        _raw_problem(runs, 401)
        health = await _raw_http(base, b"GET /healthz HTTP/1.1", b"Host: 127.0.0.1", RAW_BEARER)
        assert health[0] == 200, health
        assert json.loads(health[2])["workers"] is None  # answered as to anyone
        for n in range(3):
            async with bearer(f"trn_bad{n}_guess{n}") as http, http.get(f"{base}/runs") as r:
                assert r.status in (401, 429)
        blocked = await _raw_http(base, b"GET /runs HTTP/1.1", b"Host: 127.0.0.1", RAW_BEARER)
        _raw_problem(blocked, 429)


async def test_signing_out_with_raw_bytes_in_the_cookie_is_not_a_500(
    client: Client, db_url: str
) -> None:
    _, token = await _token(client, "reader", ["read"])
    async with api(db_url) as base:
        signed_out = await _raw_http(
            base,
            b"DELETE /session HTTP/1.1",
            b"Host: 127.0.0.1",
            f"Authorization: Bearer {token}".encode(),
            RAW_COOKIE,
        )
    assert signed_out[0] == 200, signed_out


async def test_crafted_cookies_forms_origins_and_names_are_never_a_500(
    client: Client, db_url: str
) -> None:
    token_id, token = await _token(client, "ops")
    _, unnamed = await _token(client, "to-be-unnamed", ["read"])
    run_id = await start_run(client, "support", "hello")
    # A row from before names were checked: an empty name (no principal may be nameless).
    await client.pool.execute(
        "UPDATE toren.tokens SET name = '' WHERE id = $1", unnamed.split("_")[1]
    )
    async with api(db_url) as base:
        # A byte that is not UTF-8 in the session cookie.
        raw_cookie = RAW_COOKIE
        _raw_problem(
            await _raw_http(base, b"GET /runs HTTP/1.1", b"Host: 127.0.0.1", raw_cookie), 401
        )
        # A NUL in a token sent through the sign-in form.
        async with (
            aiohttp.ClientSession() as http,
            http.post(
                f"{base}/session",
                data=b"token=trn_a%00_b",
                headers={"Content-Type": "application/x-www-form-urlencoded"},
                allow_redirects=False,
            ) as r,
        ):
            assert r.status == 303, await r.text()
            assert r.headers["Location"] == "/?denied=1"
        # An Origin that is not a URL: refused, on the sign-in form and on a console write.
        bad_origin = {"Origin": "http://[bad"}
        async with (
            aiohttp.ClientSession() as http,
            http.post(
                f"{base}/session", data={"token": token}, headers=bad_origin, allow_redirects=False
            ) as r,
        ):
            await _problem(r, 403)
        async with console(base, token) as (http, _):
            async with http.get(f"{base}/session") as r:
                csrf = (await r.json())["csrf"]
            async with http.post(
                f"{base}/runs/{_uuid(run_id)}/approvals",
                json=DECISION,
                headers={**bad_origin, "X-CSRF-Token": csrf},
            ) as r:
                problem = await _problem(r, 403)
            assert "cross-origin" in problem["detail"]
        # The token whose name is empty still works, shown by its id.
        async with bearer(unnamed) as http:
            async with http.get(f"{base}/runs") as r:
                assert r.status == 200, await r.text()
            async with http.get(f"{base}/session") as r:
                assert r.status == 200, await r.text()
                me = await r.json()
    unnamed_id = unnamed.split("_")[1]
    assert me["principal"] == {
        "kind": "token",
        "id": unnamed_id,
        "name": f"token {unnamed_id}",
        "via": "http",
    }
    assert me["name"] == f"token {unnamed_id}"
    assert token_id != unnamed_id
    assert await _mail(client) == ["run.start"]  # the refused write reached nothing


async def test_another_authorization_scheme_lets_the_session_cookie_count_and_is_not_a_failure(
    client: Client, db_url: str
) -> None:
    _, token = await _token(client, "browser", ["read"])
    basic = {"Authorization": "Basic " + base64.b64encode(b"proxy-user:proxy-pass").decode()}
    async with api(db_url, failed_auth_per_minute=3) as base:
        async with console(base, token) as (http, _):
            for n in range(25):  # a proxy in front adds its own Basic credentials
                async with http.get(f"{base}/runs", headers=basic) as r:
                    assert r.status == 200, (n, await r.text())
        async with bearer("trn_bad0_guess0") as http, http.get(f"{base}/runs") as r:
            await _problem(r, 401)  # the first failure from this address: not yet limited


async def test_a_blocked_address_keeps_the_token_it_used_but_cannot_try_a_new_one(
    client: Client, db_url: str
) -> None:
    _, known = await _token(client, "known", ["read"])
    _, fresh = await _token(client, "fresh", ["read"])
    async with api(db_url, failed_auth_per_minute=3) as base:
        async with bearer(known) as http, http.get(f"{base}/runs") as r:
            assert r.status == 200
        for n in range(3):
            async with bearer(f"trn_bad{n}_guess{n}") as http, http.get(f"{base}/runs") as r:
                await _problem(r, 401)
        async with bearer("trn_bad3_guess3") as http, http.get(f"{base}/runs") as r:
            await _problem(r, 429)
        async with bearer(known) as http, http.get(f"{base}/runs") as r:
            assert r.status == 200, await r.text()  # not locked out by someone else's guesses
        async with bearer(fresh) as http, http.get(f"{base}/runs") as r:
            await _problem(r, 429)  # a token never seen pass is a guess like any other


async def test_the_console_page_as_a_static_file_carries_the_pages_protections(
    client: Client, db_url: str
) -> None:
    async with api(db_url) as base, aiohttp.ClientSession() as http:
        async with http.get(f"{base}/") as r:
            assert r.status == 200
            page_policy = r.headers["Content-Security-Policy"]
        async with http.get(f"{base}/static/index.html") as r:
            assert r.status == 200
            assert r.content_type == "text/html"
            policy = r.headers.get("Content-Security-Policy", "")
            assert "frame-ancestors 'none'" in policy
            assert policy == page_policy
            assert r.headers.get("X-Content-Type-Options") == "nosniff"


MCP_INITIALIZE = {
    "jsonrpc": "2.0",
    "id": 1,
    "method": "initialize",
    "params": {
        "protocolVersion": "2025-06-18",
        "capabilities": {},
        "clientInfo": {"name": "raw", "version": "1"},
    },
}


async def test_mcp_over_http_refuses_two_authorization_headers(client: Client, db_url: str) -> None:
    _, one = await _token(client, "one")
    _, two = await _token(client, "two", ["read"])
    accept = [("Accept", "application/json, text/event-stream")]
    async with (
        serving_http(db_url, host="127.0.0.1", port=0) as url,
        create_mcp_http_client() as http,
    ):
        single = await http.post(
            url, json=MCP_INITIALIZE, headers=[("Authorization", f"Bearer {one}"), *accept]
        )
        assert single.status_code == 200, single.text  # the request itself is fine
        double = await http.post(
            url,
            json=MCP_INITIALIZE,
            headers=[
                ("Authorization", f"Bearer {two}"),
                ("Authorization", f"Bearer {one}"),
                *accept,
            ],
        )
    assert double.status_code == 401, double.text
    assert "one Authorization header" in double.text


async def test_mcp_send_message_to_a_run_no_worker_has_started_checks_its_agent(
    client: Client, db_url: str
) -> None:
    _, token = await _token(client, "support-operator", ["read", "operate"], agents=["support"])
    run_id = await start_run(client, "support", "hello")  # no worker: only its start is queued
    async with (
        serving_http(db_url, host="127.0.0.1", port=0) as url,
        mcp_http(url, token) as mcp,
    ):
        result = await mcp.call_tool("send_message", {"run_id": run_id, "text": "hi"})
    assert not result.is_error, result.content
    assert f"sent to {run_id}" in getattr(result.content[0], "text", "")
    assert await _mail(client) == ["run.start", "run.say"]


async def test_cli_tokens_create_refuses_malformed_agents_and_splits_commas(
    client: Client, db_url: str
) -> None:
    for agent in ("", "../x"):
        refused = await cli("tokens", "create", "x", "--agent", agent, db_url=db_url)
        assert refused.returncode == 2, (agent, refused)
        assert "--agent" in refused.stderr, agent
        assert f"not an agent name: {agent!r}" in refused.stderr, agent
        assert "Traceback" not in refused.stderr
        assert not refused.stdout.strip()  # no token printed
    assert await client.pool.fetchval("SELECT count(*) FROM toren.tokens") == 0
    made = await cli("tokens", "create", "x", "--agent", "a,b", db_url=db_url)
    assert made.returncode == 0, made.stderr
    token_id = made.stdout.strip().split("_")[1]
    agents = await client.pool.fetchval("SELECT agents FROM toren.tokens WHERE id = $1", token_id)
    assert agents == ["a", "b"]


async def _migrated_to_0002(conn: asyncpg.Connection) -> None:
    """The schema as migrations 0001 and 0002 left it (before tokens had rules for names)."""
    for version, name, sql in available():
        if version >= 3:
            continue
        async with conn.transaction():
            await conn.execute(
                "CREATE SCHEMA IF NOT EXISTS toren; "
                "CREATE TABLE IF NOT EXISTS toren.schema_migrations ("
                " version integer PRIMARY KEY, name text NOT NULL,"
                " applied_at timestamptz NOT NULL DEFAULT now())"
            )
            await conn.execute(sql)
            await conn.execute(
                "INSERT INTO toren.schema_migrations (version, name) VALUES ($1, $2)",
                version,
                name,
            )


async def test_migration_0003_renames_until_free_and_repairs_empty_and_long_names(
    empty_db_url: str,
) -> None:
    long_name = "n" * 150
    tokens = [  # id, name, in order of creation; all live
        ("aaa111", "ci"),
        ("bbb222", "ci"),
        ("ccc333", "ci-bbb222"),  # the name the second "ci" would be given
        ("ddd444", ""),
        ("eee555", long_name),
    ]
    conn = await asyncpg.connect(empty_db_url)
    try:
        await _migrated_to_0002(conn)
        created = datetime(2024, 1, 1, tzinfo=UTC)
        for n, (token_id, name) in enumerate(tokens):
            await conn.execute(
                "INSERT INTO toren.tokens (id, name, secret_sha256, created_at) "
                "VALUES ($1, $2, $3, $4)",
                token_id,
                name,
                hashlib.sha256(f"secret-{token_id}".encode()).digest(),
                created + timedelta(hours=n),
            )
        assert (await migrate(conn))[0] == 3  # and every later migration
        names = {r["id"]: r["name"] for r in await conn.fetch("SELECT id, name FROM toren.tokens")}
        assert names == {
            "aaa111": "ci",
            "bbb222": "ci-bbb222",
            "ccc333": "ci-bbb222-ccc333",
            "ddd444": "token ddd444",
            "eee555": long_name[:100],
        }
        for token_id, _ in tokens:  # each still works
            token = f"trn_{token_id}_secret-{token_id}"
            access = await toren._surfaces.tokens.authenticate(conn, token)  # type: ignore[arg-type]
            assert access is not None, token_id
            assert access.principal.name == names[token_id]
    finally:
        await conn.close()


async def test_an_expired_token_frees_its_name(client: Client, db_url: str) -> None:
    old_id, old = await _token(client, "brief", ["read"], expires_in=1)

    async def refused() -> bool:
        return await toren._surfaces.tokens.authenticate(client.pool, old) is None

    await wait_for(refused, timeout=15, what="the token to expire")
    new_id, new = await create_token(client.pool, "brief")
    assert new_id != old_id
    rows = {
        r["id"]: r for r in await client.pool.fetch("SELECT id, name, revoked_at FROM toren.tokens")
    }
    assert rows[old_id]["revoked_at"] is not None  # the expired row gave its name up
    assert (rows[new_id]["name"], rows[new_id]["revoked_at"]) == ("brief", None)
    assert await toren._surfaces.tokens.authenticate(client.pool, new) is not None


async def test_a_token_that_may_not_read_gets_back_only_what_it_sent(
    client: Client, db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, token = await _token(client, "starter", ["operate"])
    body = {"agent": "support", "input": "Refund me", "idempotency_key": "order-17"}
    nothing = {
        "calls_made": 0,
        "calls_replayed": 0,
        "input_tokens": 0,
        "output_tokens": 0,
        "usd_paid": "0",
        "usd_not_repaid": "0",
        "unpriced_calls": 0,
    }
    async with refund_agent(monkeypatch, db_url), api(db_url) as base, bearer(token) as http:
        async with http.post(f"{base}/runs", json=body) as r:
            assert r.status == 201, await r.text()
            run_id = (await r.json())["id"]
        await wait_for(lambda: _status(client, run_id, "parked"), what="parked")
        async with http.post(f"{base}/runs", json=body) as r:
            assert r.status == 201, await r.text()
            parked = await r.json()
        assert (parked["id"], parked["waiting_on"]) == (run_id, [])  # not the call it waits on
        await decide(client, run_id, call_id="r1", approved=True, by=person("alice"))
        await wait_for(lambda: _status(client, run_id, "completed"), what="completed")
        async with http.post(f"{base}/runs", json=body) as r:
            assert r.status == 201, await r.text()
            repeated = await r.json()
        async with http.get(f"{base}/runs/{_uuid(run_id)}") as r:
            await _problem(r, 403)  # it may not read the run the other way either
    assert (await read_run(client, run_id)).output == "Refunded."  # there was output to leak
    assert repeated["id"] == run_id
    assert (repeated["agent"], repeated["input"]) == ("support", "Refund me")
    assert (repeated["output"], repeated["waiting_on"]) == (None, [])
    assert nothing.keys() <= repeated["receipt"].keys()
    assert all(v in (0, "0") for v in repeated["receipt"].values())  # nothing of what it cost
    assert await _runs(client) == 1


async def test_a_message_to_a_failed_or_cancelled_run_is_refused(
    client: Client, db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tests.test_sandbox_surfaces import new_id, new_run
    from toren.runs import RunFailed

    _, token = await _token(client, "ops")
    failed = await new_run(
        client, new_id(), "support", [RunFailed(error_class="tool", message="x")]
    )
    async with refund_agent(monkeypatch, db_url), api(db_url) as base:
        run_id = await _parked_run(client)
        await cancel(client, run_id, by=person("alice"))
        await wait_for(lambda: _status(client, run_id, "cancelled"), what="cancelled")
        for run, why in ((run_id, "was cancelled and takes no messages"), (failed, "has failed")):
            async with (
                bearer(token) as http,
                http.post(f"{base}/runs/{_uuid(run)}/messages", json={"text": "hi"}) as r,
            ):
                problem = await _problem(r, 409)
            assert why in problem["detail"]
        sent = await cli("jobs", "send", run_id, "hi", db_url=db_url)
        assert sent.returncode == 1, sent
        assert "was cancelled and takes no messages; start a new run" in sent.stderr
        assert "Traceback" not in sent.stderr
    assert await _events(client, run_id, "message.received") == []
    assert "run.say" not in await _mail(client)
