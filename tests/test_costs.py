"""Retention end to end (issue 32): runs made by a real worker against a scripted model, pruned
by the agent's pruner actor; costs by agent and day are the same before and after, through the
library, ``GET /costs`` and ``toren costs``; a pruned run is shown from its audit record by
``GET /runs/{id}`` and ``toren jobs show``; ``toren jobs prune --dry-run`` and ``--stats``."""

from __future__ import annotations

import json
from decimal import Decimal
from pathlib import Path
from typing import Any

import anyio
import pytest
from click.testing import CliRunner

import toren.providers.anthropic  # noqa: F401  (an SDK import takes seconds: paid here once)
from tests.conftest import running_worker, wait_for
from tests.test_api import api, session
from tests.test_calls import Plan, model, relay
from tests.test_console import _console, _journal_run, chromium  # noqa: F401  (a fixture)
from toren import Client, Retention
from toren._agent.app import load_app
from toren._agent.model import Usage
from toren._surfaces.tokens import SCOPES, create_token
from toren.cli import main
from toren.retention import prune_now, pruner_id
from toren.runs import ENDED, Agents, RunCompleted, run_status, start_run
from toren.runs.costs import costs
from toren.runs.prune import prune_batch
from toren.testing import Reply

pytestmark = pytest.mark.anyio

BY = {"by": "agent,day"}


async def cli(db_url: str, *args: str) -> Any:
    env = {"TOREN_DATABASE_URL": db_url}
    return await anyio.to_thread.run_sync(lambda: CliRunner().invoke(main, list(args), env=env))


async def ended(client: Client, run_id: str) -> bool:
    return await run_status(client, run_id) in ENDED


async def test_costs_stay_exact_across_a_prune_and_a_pruned_run_is_shown_from_its_record(
    client: Client, db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    agents = Agents()  # not the process's: later tests' workers would start its pruner
    load_app("tests.retention_app", into=agents)
    plan: Plan = {
        "boss": relay("boss heard", "call_helper", "help", "b1"),
        "helper": lambda b: Reply("helped", usage=Usage(input_tokens=1000, output_tokens=10)),
    }
    _, token = await create_token(client.pool, "ops", scopes=SCOPES)
    async with model(plan, monkeypatch), running_worker(db_url, agents), api(db_url) as base:
        runs = [await start_run(client, "boss", f"task {n}") for n in range(2)]
        for run_id in runs:
            await wait_for(lambda run_id=run_id: ended(client, run_id), what="ended")
        dry = await cli(db_url, "jobs", "prune", "--dry-run")
        assert dry.exit_code == 0, dry.output
        assert "boss: 0 runs in 0 trees would be pruned" in dry.output  # kept an hour

        # Two hours later (the runs and their journals aged), the pruner is asked to prune now.
        for table in ("journal", "actors"):
            await client.pool.execute(
                f"UPDATE toren.{table} SET created_at = created_at - interval '2 hours'"
            )
        by_agent = await costs(client.pool, ("agent",))
        by_day = await costs(client.pool, ("agent", "day"))
        assert [(r.agent, r.runs, r.pruned) for r in by_agent] == [("boss", 2, 0), ("helper", 2, 0)]
        assert all(r.usd_paid > 0 for r in by_agent)
        async with session(token) as http, http.get(f"{base}/costs", params=BY) as r:
            assert r.status == 200, await r.text()
            api_before = (await r.json())["costs"]
        dry = await cli(db_url, "jobs", "prune", "--dry-run", "--agent", "boss")
        assert "boss: 4 runs in 2 trees would be pruned" in dry.output, dry.output
        await prune_now(client, "boss")

        async def pruned() -> bool:
            n = await client.pool.fetchval("SELECT count(*) FROM toren.run_audit")
            return n == 4

        await wait_for(pruned, what="the pruner pruned both trees")
        assert (
            await client.pool.fetchval("SELECT count(*) FROM toren.actors WHERE kind = 'toren.run'")
            == 0
        )
        # the pruner keeps no journal of its own
        assert (
            await client.pool.fetchval(
                "SELECT count(*) FROM toren.journal WHERE actor_id = $1", pruner_id("boss")
            )
            == 0
        )

        after = await costs(client.pool, ("agent",))
        assert [(r.agent, r.runs, r.pruned) for r in after] == [("boss", 2, 2), ("helper", 2, 2)]
        assert [(r.usd_paid, r.calls_made, r.input_tokens) for r in after] == [
            (r.usd_paid, r.calls_made, r.input_tokens) for r in by_agent
        ]
        assert sum(r.usd_paid for r in await costs(client.pool, ("agent", "day"))) == sum(
            r.usd_paid for r in by_day
        )
        async with session(token) as http:
            async with http.get(f"{base}/costs", params=BY) as r:
                api_after = (await r.json())["costs"]
            assert [{**c, "pruned": 0} for c in api_after] == api_before
            assert Decimal(api_after[0]["usd_paid"]) == by_agent[0].usd_paid
            async with http.get(f"{base}/costs", params={"by": "week"}) as r:
                assert r.status == 422
            async with http.get(f"{base}/metrics") as r:
                metrics = await r.text()
            assert 'toren_last_prune{agent="boss",what="runs"} 4.0' in metrics
            assert 'toren_table_bytes{table="journal"}' in metrics
            async with http.get(f"{base}/runs/{runs[0].removeprefix('run/')}") as r:
                assert r.status == 200, await r.text()
                shown = await r.json()
            assert (shown["status"], shown["agent"]) == ("completed", "boss")
            assert shown["pruned"]["events"] > 0
            assert shown["pruned"]["started_by"]["via"] == "python"
            assert Decimal(shown["receipt"]["usd_paid"]) >= 0
            async with http.post(
                f"{base}/runs/{runs[0].removeprefix('run/')}/messages", json={"text": "hi"}
            ) as r:
                assert r.status == 409
                assert "was pruned on" in (await r.json())["detail"]

        # `toren jobs prune` prunes from the CLI at once, as the published policy says.
        late = await start_run(client, "boss", "one more")
        await wait_for(lambda: ended(client, late), what="the late run ended")
        for table in ("journal", "actors"):
            await client.pool.execute(
                f"UPDATE toren.{table} SET created_at = created_at - interval '2 hours' "
                "WHERE actor_id <> $1",
                pruner_id("boss"),
            )
        now = await cli(db_url, "jobs", "prune", "--agent", "boss")
        assert now.exit_code == 0, now.output
        assert "boss: pruned 2 runs (" in now.output
        unknown = await cli(db_url, "jobs", "prune", "--agent", "nobody")
        assert unknown.exit_code == 2
        assert "no live worker publishes a retention policy for agent 'nobody'" in unknown.output

    final = await costs(client.pool, ("agent",))  # with the late run's tree, pruned too
    assert [(r.agent, r.runs, r.pruned) for r in final] == [("boss", 3, 3), ("helper", 3, 3)]
    shown = await cli(db_url, "jobs", "show", runs[0])
    assert shown.exit_code == 0, shown.output
    assert "journal pruned on" in shown.output
    assert "status completed" in shown.output
    table = await cli(db_url, "costs", "--by", "agent")
    assert table.exit_code == 0, table.output
    assert f"${final[0].usd_paid}" in table.output
    as_json = await cli(db_url, "costs", "--by", "agent", "--json")
    assert json.loads(as_json.output)["costs"][0]["usd_paid"] == str(final[0].usd_paid)
    stats = await cli(db_url, "jobs", "prune", "--stats")
    assert "toren.journal" in stats.output
    assert "last prune of boss" in stats.output
    bad = await cli(db_url, "costs", "--by", "week")
    assert bad.exit_code == 2


async def test_the_console_shows_a_pruned_run_from_its_audit_record(
    client: Client,
    db_url: str,
    chromium: Path,  # noqa: F811  (the fixture imported above)
) -> None:
    for _ in range(2):
        await _journal_run(client, "tr-kept", [RunCompleted(output="done")])
    result = await prune_batch(client.pool, "tr-kept", Retention(keep_last=1))
    [pruned] = result.trees
    async with _console(client, db_url, chromium) as (base, page):
        await page.goto(f"{base}/#/runs/{pruned.removeprefix('run/')}")
        await page.wait_for_selector("#run-pruned >> text=journal pruned on")
        assert "completed" in await page.inner_text("#run-status")
        assert await page.is_hidden("#steer")
        assert "paid" in await page.inner_text("#receipt")
