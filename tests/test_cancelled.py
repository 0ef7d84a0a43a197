"""A cancelled run has a status of its own, ``cancelled`` (issue 27): every surface shows and
filters it so, a second cancel and a retry say that it was cancelled, and runs cancelled before
the change (their rows, their snapshots) read as cancelled too. A cancel still records
``run.failed`` of class ``cancelled``: journals recorded before stay valid."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, get_args

import aiohttp
import attrs
import pytest

from tests.conftest import person, wait_for
from tests.test_api import refund_agent
from tests.test_authorization import cli, mcp_http
from tests.test_mcp import _data
from tests.test_run_counts import actual, counted, migrated_before
from tests.test_sandbox_surfaces import (
    CREATED,
    LS,
    called,
    new_id,
    new_run,
    new_sandbox,
    ran,
    reaps,
)
from toren import Client
from toren._core.codec import decode, encode
from toren._core.migrate import migrate
from toren._core.snapshots import encode as encode_snapshot
from toren._core.snapshots import write as write_snapshot
from toren._surfaces.http.openapi import document
from toren._surfaces.mcp_server import serving_http
from toren._surfaces.serve import serving
from toren._surfaces.tokens import SCOPES, create_token
from toren.runs import (
    RUN_KIND,
    STATUSES,
    RunCompleted,
    RunFailed,
    RunNotInState,
    RunStarted,
    RunState,
    cancel,
    fold,
    read_run,
    say,
    summary,
)
from toren.runs.events import Status
from toren.runs.listing import list_runs
from toren.sandboxes import sandbox_address

pytestmark = pytest.mark.anyio

FIXTURE = Path(__file__).parent / "fixtures" / "journals" / "run_v1_every_event.json"
"""A journal recorded before the change that ends with a cancel (``run.failed``, class
``cancelled``)."""

CANCEL = RunFailed(error_class="cancelled", message="cancelled by carol: duplicate")
BROKE = RunFailed(error_class="tool", message="the tool kept failing")


def test_every_surface_offers_the_cancelled_status() -> None:
    assert get_args(Status) == STATUSES
    assert "cancelled" in STATUSES
    doc = document()
    [status] = [p for p in doc["paths"]["/runs"]["get"]["parameters"] if p["name"] == "status"]
    assert status["schema"]["enum"] == list(STATUSES)
    # A run's status as shown: its recorded one, or queued on a concurrency limit.
    shown = doc["components"]["schemas"]["Run"]["properties"]["status"]["enum"]
    assert shown == ["queued", *STATUSES]


async def test_a_cancelled_run_shows_and_filters_as_cancelled_and_is_not_cancelled_again(
    client: Client, db_url: str
) -> None:
    cancelled = await new_run(client, new_id(), "stopper", [CANCEL])
    failed = await new_run(client, new_id(), "stopper", [BROKE])
    await new_run(client, new_id(), "stopper", [RunCompleted(output="done")])
    _, token = await create_token(client.pool, "ops", scopes=SCOPES)
    headers = {"Authorization": f"Bearer {token}"}
    uuid = cancelled.removeprefix("run/")
    async with serving(db_url, port=0) as base, aiohttp.ClientSession(headers=headers) as http:
        async with http.get(f"{base}/runs/{uuid}") as r:
            run = await r.json()
        assert (run["status"], run["error_class"]) == ("cancelled", "cancelled")
        async with http.get(f"{base}/runs?status=cancelled") as r:
            assert r.status == 200, await r.text()
            assert [x["id"] for x in (await r.json())["runs"]] == [cancelled]
        async with http.get(f"{base}/runs?status=failed") as r:
            assert [x["id"] for x in (await r.json())["runs"]] == [failed]
        async with http.post(f"{base}/runs/{uuid}/cancel", json={}) as r:
            assert r.status == 409
            assert "has already been cancelled" in (await r.json())["detail"]
    listed = await cli("jobs", "list", "--status", "cancelled", db_url=db_url)
    assert listed.returncode == 0, listed.stderr
    assert cancelled in listed.stdout
    assert failed not in listed.stdout
    again = await cli("jobs", "cancel", cancelled, db_url=db_url)
    assert again.returncode == 1
    assert f"error: {cancelled} has already been cancelled; there is nothing to cancel" in (
        again.stderr
    )
    shown = await cli("jobs", "show", cancelled, db_url=db_url)
    assert shown.returncode == 0, shown.stderr
    assert "cancelled: cancelled by" in shown.stdout  # its own word on the timeline too
    assert "failed [cancelled]" not in shown.stdout
    retried = await cli("jobs", "retry", cancelled, db_url=db_url)
    assert retried.returncode == 1
    assert "was cancelled; a cancelled run is not retried (start a new run instead)" in (
        retried.stderr
    )
    with pytest.raises(RunNotInState, match="was cancelled and takes no messages"):
        await say(client, cancelled, "still there?", by=person("dave"))
    async with (
        serving_http(db_url, host="127.0.0.1", port=0) as url,
        mcp_http(url, token) as mcp,
    ):
        listed_by_mcp = _data(await mcp.call_tool("list_runs", {"status": "cancelled"}))
        assert [r["id"] for r in listed_by_mcp] == [cancelled]
    # Nothing was sent to it: not the second cancel, nor the retry, nor the message.
    assert (
        await client.pool.fetchval(
            "SELECT count(*) FROM toren.mailbox WHERE actor_id = $1", cancelled
        )
        == 0
    )


async def test_a_cancelled_runs_sandbox_is_told_to_reap(
    client: Client, db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The step that cancels a run sends its sandbox a reap (a worker without Docker, as here,
    leaves it queued), as for any run that ends."""
    run_id = new_id()
    # Waiting for its sandbox's answer to a command (sent, not answered).
    waiting = ran(run_id, LS, "")[:2]
    await new_run(client, run_id, "support", [called(1, LS), *waiting])
    await new_sandbox(client, run_id, [CREATED])
    async with refund_agent(monkeypatch, db_url):
        await cancel(client, run_id, by=person("ana"))
        assert await wait_for(lambda: reaps(client), what="the reap") == [sandbox_address(run_id)]
    assert (await read_run(client, run_id)).status == "cancelled"


async def test_runs_cancelled_before_the_change_read_as_cancelled(empty_db_url: str) -> None:
    client = await Client.connect(empty_db_url)
    try:
        async with client.pool.acquire() as conn:
            await migrated_before(conn, "cancelled_status")
        entries = json.loads(FIXTURE.read_text())
        cancelled = await _old_run(client, entries, snapshot=True)
        failed = await _old_run(client, _journal([BROKE]))
        completed = await _old_run(client, _journal([RunCompleted(output="done")]))
        assert await counted(client.pool) == {"failed": 2, "completed": 1}
        async with client.pool.acquire() as conn:
            assert (await migrate(conn))[0] == 8  # 0008 first, then any later ones
        rows = await client.pool.fetch("SELECT actor_id, run_status FROM toren.actors")
        assert {r["actor_id"]: r["run_status"] for r in rows} == {
            cancelled: "cancelled",
            failed: "failed",
            completed: "completed",
        }
        expected = {"cancelled": 1, "failed": 1, "completed": 1}
        assert await counted(client.pool) == await actual(client.pool) == expected
        # Its snapshot, stored before the change (status failed), is set aside for its journal.
        state = await read_run(client, cancelled)
        assert (state.status, state.error_class) == ("cancelled", "cancelled")
        assert [r.id for r in await list_runs(client, status="cancelled")] == [cancelled]
    finally:
        await client.close()


def _journal(events: list[Any]) -> list[dict[str, Any]]:
    out = []
    for seq, event in enumerate([RunStarted(agent="old", input="go", at=1.0), *events], 1):
        name, data = encode(event)
        out.append({"seq": seq, "type": name, "data": data})
    return out


async def _old_run(client: Client, entries: list[dict[str, Any]], *, snapshot: bool = False) -> str:
    """A run as an earlier version left it: its journal, its row's summary saying ``failed``
    for a cancel, and (``snapshot``) a snapshot of its state that says so too."""
    run_id = new_id()
    await client.spawn(RUN_KIND, run_id, {"agent": "old"}, route="agent:old")
    await client.pool.executemany(
        "INSERT INTO toren.journal (actor_id, seq, epoch, type, data) VALUES ($1, $2, 1, $3, $4)",
        [(run_id, e["seq"], e["type"], e["data"]) for e in entries],
    )
    state = RunState()
    for e in entries:
        state = fold(state, decode(e["type"], e["data"]))
    if state.status == "cancelled":
        state = attrs.evolve(state, status="failed")  # as the earlier fold had it
    await client.pool.execute(
        "UPDATE toren.actors SET summary = $2 WHERE actor_id = $1", run_id, summary(state)
    )
    if snapshot:
        # 6: the snapshot version before a cancelled run had a status of its own.
        seq = len(entries)
        assert await write_snapshot(client.pool, run_id, 6, seq, encode_snapshot(state, seq))
    return run_id
