"""The MCP server through the SDK's own client, over stdio and over streamable HTTP."""

from __future__ import annotations

import json
import os
import pwd
import sys
from typing import Any

import pytest
from mcp import ClientSession, StdioServerParameters
from mcp.client.stdio import stdio_client
from mcp.client.streamable_http import streamable_http_client
from mcp.shared._httpx_utils import create_mcp_http_client

from tests.conftest import ROOT, wait_for
from tests.test_api import refund_agent
from toren import Client
from toren._agent.principal import Principal
from toren._surfaces.mcp_server import serving_http
from toren._surfaces.tokens import SCOPES, create_token
from toren.runs import read_run, start_run

pytestmark = pytest.mark.anyio


def _data(result: Any) -> Any:
    """A tool's answer: its structured content, else its text as JSON."""
    assert not result.is_error, result
    if result.structured_content is not None:
        return result.structured_content.get("result", result.structured_content)
    return json.loads(result.content[0].text)


async def _parked(client: Client, run_id: str) -> bool:
    return (await read_run(client, run_id)).status == "parked"


async def _completed(client: Client, run_id: str) -> bool:
    return (await read_run(client, run_id)).status == "completed"


async def test_a_client_over_stdio_lists_runs_and_approves_one(
    client: Client, db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with refund_agent(monkeypatch, db_url):
        run_id = await start_run(client, "support", "Refund me")
        await wait_for(lambda: _parked(client, run_id), what="parked")
        params = StdioServerParameters(
            command=sys.executable,
            args=["-m", "toren", "mcp", "--allow-decisions"],
            env={
                **os.environ,
                "TOREN_DATABASE_URL": db_url,
                "PYTHONPATH": str(ROOT),
                "LOGNAME": "someone",  # never trusted: the user comes from the process's uid
                "USER": "someone",
            },
            cwd=str(ROOT),
        )
        async with stdio_client(params) as (read, write), ClientSession(read, write) as mcp:
            await mcp.initialize()
            tools = {t.name for t in (await mcp.list_tools()).tools}
            assert tools == {
                "list_runs", "read_run", "start_run", "send_message", "approve", "deny",
                "list_schedules", "pause_schedule", "resume_schedule", "trigger_schedule",
                "create_schedule", "backfill_schedule", "delete_schedule",
            }  # fmt: skip
            runs = _data(await mcp.call_tool("list_runs", {"status": "parked"}))
            assert [r["id"] for r in runs] == [run_id]
            shown = _data(await mcp.call_tool("read_run", {"run_id": run_id}))
            [waiting] = shown["waiting_on"]
            assert (waiting["tool"], waiting["call_id"]) == ("refund", "r1")
            wrong = await mcp.call_tool("approve", {"run_id": run_id, "call_id": "r0"})
            assert wrong.is_error  # a decision for a call that does not wait is refused
            decided = {"run_id": run_id, "call_id": "r1", "reason": "via Claude"}
            _data(await mcp.call_tool("approve", decided))
        await wait_for(lambda: _completed(client, run_id), what="completed")
    [decision] = (await read_run(client, run_id)).decisions.values()
    me = pwd.getpwuid(os.getuid()).pw_name
    assert (decision.channel, decision.who, decision.reason) == ("mcp", me, "via Claude")
    assert decision.by == Principal(kind="os_user", id=str(os.getuid()), name=me, via="mcp")


async def test_a_client_over_http_needs_a_token_and_approves_as_its_name(
    client: Client, db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    token_id, token = await create_token(client.pool, "claude-desktop", scopes=SCOPES)
    async with (
        refund_agent(monkeypatch, db_url),
        serving_http(db_url, host="127.0.0.1", port=0, allow_decisions=True) as url,
    ):
        approved = await start_run(client, "support", "Refund me")
        denied = await start_run(client, "support", "Refund me too")
        for run_id in (approved, denied):
            await wait_for(lambda r=run_id: _parked(client, r), what="parked")
        async with create_mcp_http_client() as anonymous:
            response = await anonymous.post(url, json={"jsonrpc": "2.0", "id": 1, "method": "ping"})
            assert response.status_code == 401
        http = create_mcp_http_client(headers={"Authorization": f"Bearer {token}"})
        async with (
            http,
            streamable_http_client(url, http_client=http) as (read, write, *_),
            ClientSession(read, write) as mcp,
        ):
            await mcp.initialize()
            listed = _data(await mcp.call_tool("list_runs", {"status": "parked"}))
            assert {r["id"] for r in listed} == {approved, denied}
            _data(await mcp.call_tool("approve", {"run_id": approved, "call_id": "r1"}))
            no = {"run_id": denied, "call_id": "r1", "reason": "too much"}
            _data(await mcp.call_tool("deny", no))
            refused = await mcp.call_tool("approve", {"run_id": "run/nope", "call_id": "r1"})
            assert refused.is_error
        for run_id in (approved, denied):
            await wait_for(lambda r=run_id: _completed(client, r), what="completed")
    [yes] = (await read_run(client, approved)).decisions.values()
    [no] = (await read_run(client, denied)).decisions.values()
    assert (yes.channel, yes.who, yes.approved) == ("mcp", "claude-desktop", True)
    assert yes.by == Principal(kind="token", id=token_id, name="claude-desktop", via="mcp")
    assert (no.channel, no.who, no.approved, no.reason) == (
        "mcp",
        "claude-desktop",
        False,
        "too much",
    )
