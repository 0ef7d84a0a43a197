"""Runs named on the command line as people name them: the id the CLI prints, the uuid, or a
unique prefix of it, found in one query on the actors' key; and the console link the CLI prints
beside a run."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import anyio
import pytest

from tests.test_cli import toren
from toren import Client, ConfigError, Settings
from toren._cli.dev_state import DevRecord, claimed, write_record
from toren.runs import RunCompleted

pytestmark = pytest.mark.anyio

ONE = "run/8146c6aa-1b2c-4d5e-8f90-0123456789ab"
TWO = "run/8146c6bb-1b2c-4d5e-8f90-0123456789ab"


async def _runs(client: Client) -> None:
    from tests.test_sandbox_surfaces import new_run

    await new_run(client, ONE, "support", [RunCompleted(output="done")])
    await new_run(client, TWO, "strict", [])  # still running


async def test_a_run_is_found_by_its_id_its_uuid_or_a_unique_prefix(client: Client) -> None:
    from toren.runs.ids import AmbiguousRun, NotARunId, RunNotFound, find_run

    await _runs(client)
    for text in (
        ONE,
        ONE[4:],
        ONE.upper(),
        "8146c6aa",
        "run/8146C6A",
        "8146c6aa1b2c",
        " 8146c6aa-1 ",
    ):
        assert await find_run(client.pool, text) == ONE, text
    with pytest.raises(AmbiguousRun) as ambiguous:
        await find_run(client.pool, "8146c6")
    assert [c.id for c in ambiguous.value.candidates] == [ONE, TWO]
    message = str(ambiguous.value)
    assert message.startswith("run/8146c6 names 2 runs: ")
    assert f"{ONE} (support, completed, started " in message
    assert f"{TWO} (strict, running, started " in message
    with pytest.raises(
        RunNotFound, match=r"no run's id starts with 'run/8146c6ac' \(from '8146c6ac'\)"
    ):
        await find_run(client.pool, "8146c6ac")
    with pytest.raises(RunNotFound, match="no run 'run/8146c6aa-1b2c-4d5e-8f90-0123456789ac'"):
        await find_run(client.pool, ONE[:-1] + "c")
    for bad in ("nope", "run/", "", "8146c6aa-1b2c-4d5e-8f90-0123456789ab0", "sandbox/8146c6aa"):
        with pytest.raises(NotARunId):
            await find_run(client.pool, bad)
    with pytest.raises(NotARunId) as pasted:  # a whole page pasted by mistake is not echoed
        await find_run(client.pool, "x" * 5000)
    assert len(str(pasted.value)) < 200


async def test_a_prefix_is_looked_up_on_the_actors_key_not_by_a_scan(client: Client) -> None:
    from toren.runs.ids import find_run, id_range

    await _runs(client)
    await client.pool.execute(
        "INSERT INTO toren.actors (actor_id, kind) "
        "SELECT 'run/' || gen_random_uuid(), 'toren.run' FROM generate_series(1, 5000)"
    )
    await client.pool.execute("ANALYZE toren.actors")
    queries: list[str] = []
    async with client.pool.acquire() as conn:
        conn.add_query_logger(lambda q: queries.append(q.query))
        assert await find_run(conn, "8146c6a") == ONE
    [query] = queries  # one query
    prefix, lowest, highest = id_range("8146c6a")
    explained = f"EXPLAIN (FORMAT JSON) {query}"
    [plan] = json.loads(await client.pool.fetchval(explained, lowest, highest, prefix))
    scans = _nodes(plan["Plan"])
    assert not [n for n in scans if n["Node Type"] == "Seq Scan"], scans
    [keyed] = [n for n in scans if n.get("Index Name") == "actors_pkey"]
    assert "actor_id >=" in keyed["Index Cond"], keyed


def _nodes(node: dict[str, object]) -> list[dict[str, str]]:
    below = node.get("Plans", [])
    assert isinstance(below, list)
    return [node, *(n for child in below for n in _nodes(child))]  # type: ignore[list-item]


async def test_commands_take_a_unique_prefix_and_print_the_runs_console_link(
    client: Client, db_url: str, tmp_path: Path
) -> None:
    await _runs(client)

    async def cli(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
        return await anyio.to_thread.run_sync(lambda: toren(*args, db_url=db_url, **env))

    shown = await cli("jobs", "show", "8146C6A", TOREN_CONSOLE_URL="https://toren.example.com/")
    assert shown.returncode == 0, shown.stderr
    assert "started support: build it" in shown.stdout
    lines = shown.stdout.splitlines()
    assert lines[-1] == f"console: https://toren.example.com/#/runs/{ONE}"
    ambiguous = await cli("jobs", "show", "run/8146c6")
    assert ambiguous.returncode == 2
    assert "run/8146c6 names 2 runs:" in ambiguous.stderr
    assert ONE in ambiguous.stderr
    assert TWO in ambiguous.stderr
    assert "Give more of the id." in ambiguous.stderr
    missing = await cli("jobs", "cancel", "0000")
    assert missing.returncode == 2
    assert "no run's id starts with 'run/0000' (from '0000')" in missing.stderr
    assert "toren jobs list" in missing.stderr
    cancelled = await cli("jobs", "cancel", "8146c6b", "--reason", "by prefix")
    assert cancelled.returncode == 0, cancelled.stderr
    assert f"cancel: sent to {TWO}" in cancelled.stdout
    mail = await client.pool.fetch("SELECT actor_id, kind FROM toren.mailbox")
    assert [(r["actor_id"], r["kind"]) for r in mail] == [(TWO, "run.cancel")]
    # With no setting, the console of the running `toren dev` whose database this is (its
    # record under TOREN_HOME names both); the id alone on stdout, the link on stderr.
    home = tmp_path / "home"
    with claimed(home, None):
        api_url = "http://127.0.0.1:8420"
        write_record(home, DevRecord(pid=os.getpid(), database_url=db_url, api_url=api_url))
        started = await anyio.to_thread.run_sync(
            lambda: toren("run", "support", "hello", home=home)
        )
        assert started.returncode == 0, started.stderr
        run_id = started.stdout.strip()
        assert run_id.startswith("run/")
        assert f"console: {api_url}/#/runs/{run_id}" in started.stderr
        # Another database than that `toren dev`'s: its console would not show the run.
        elsewhere = "postgresql://nobody@/elsewhere"
        write_record(home, DevRecord(pid=os.getpid(), database_url=elsewhere, api_url=api_url))
        other = await cli("jobs", "show", ONE, TOREN_HOME=str(home))
        assert other.returncode == 0, other.stderr
        assert "console:" not in other.stdout
    with pytest.raises(ConfigError, match="console_url must be an http:// or https:// URL"):
        Settings(console_url="toren.example.com")


def test_a_console_url_that_would_print_as_another_line_is_refused() -> None:
    """The link is printed to a terminal beside a run: a line break or a space in the setting
    would print a line, or a link, that is not the console's (escape characters are already
    shown as escapes), and a query or fragment would make a link that opens no run's page (the
    link appends ``/#/runs/<id>``). The scheme is read in either case, as URLs allow."""
    bad_values = (
        "http://a\nerror: run failed",
        "http://a b",
        "http://\t",
        "https://",
        "http:///x",
        "https://x/#/console",  # the link appends #/runs/...: two fragments
        "https://x/?a=1",
    )
    for bad in bad_values:
        with pytest.raises(ConfigError, match="console_url must be an http:// or https:// URL"):
            Settings(console_url=bad)
    assert Settings(console_url="HTTPS://Toren.example.com:8443/ops").console_url
