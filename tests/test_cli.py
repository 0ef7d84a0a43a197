"""The ``toren`` command line, run as a real process: output, exit codes, errors that say what
to do next."""

from __future__ import annotations

import json
import os
import pwd
import re
import shlex
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import anyio
import pytest

from tests import app
from tests.conftest import ROOT, WorkerFactory, running_worker, wait_for, worker_registered
from toren import Client, __version__
from toren._core.migrate import available

pytestmark = pytest.mark.anyio


def toren(
    *args: str, db_url: str | None = None, home: Path | None = None, cwd: Path = ROOT, **env: str
) -> subprocess.CompletedProcess[str]:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("TOREN_")}
    full_env["PYTHONPATH"] = str(ROOT)
    if db_url:
        full_env["TOREN_DATABASE_URL"] = db_url
    if home:
        full_env["TOREN_HOME"] = str(home)
    full_env.update(env)
    return subprocess.run(
        [sys.executable, "-m", "toren", *args],
        env=full_env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


async def test_migrate_applies_once_then_reports_up_to_date(empty_db_url: str) -> None:
    first = await anyio.to_thread.run_sync(lambda: toren("migrate", db_url=empty_db_url))
    assert first.returncode == 0, first.stderr
    assert f"applied {len(available())} migration(s)" in first.stdout
    second = await anyio.to_thread.run_sync(lambda: toren("migrate", db_url=empty_db_url))
    assert "schema is up to date" in second.stdout


async def test_worker_refuses_an_unmigrated_database(empty_db_url: str) -> None:
    result = await anyio.to_thread.run_sync(
        lambda: toren("worker", "--app", "tests.agents_app", db_url=empty_db_url)
    )
    assert result.returncode == 2
    assert "toren migrate" in result.stderr
    # The boot-time flag comes first, from the app's agents.
    assert "tool send_email is external, unkeyed and needs no approval" in result.stderr


async def test_workers_lists_live_workers_with_version_and_statistics(
    client: Client, db_url: str, workers: WorkerFactory
) -> None:
    w = workers(deploy_label="blue")
    await wait_for(lambda: worker_registered(client, w.pid))
    await client.spawn(app.Worker, "w/cli")
    await client.send("w/cli", app.Work(seconds=0, tag="x"))

    async def stats_published() -> bool:
        row = await client.pool.fetchval("SELECT stats FROM toren.workers WHERE pid = $1", w.pid)
        return bool(row) and row.get("actors_in_memory") == 1

    await wait_for(stats_published, what="statistics")
    result = await anyio.to_thread.run_sync(lambda: toren("workers", "--json", db_url=db_url))
    assert result.returncode == 0, result.stderr
    [item] = json.loads(result.stdout)
    assert item["pid"] == w.pid
    assert item["version"] == f"{__version__}+blue"
    assert item["leases"] == 1
    assert item["actors_in_memory"] == 1
    assert item["rss_mb"] > 10
    table = await anyio.to_thread.run_sync(lambda: toren("workers", db_url=db_url))
    assert "1 live worker(s)" in table.stdout


async def test_deadletters_lists_and_requeues(client: Client, db_url: str) -> None:
    await client.spawn(app.Fragile, "fragile/cli")
    await client.send("fragile/cli", app.Boom(tag="x"))
    async with running_worker(db_url):
        await wait_for(lambda: client.deadletters(), what="dead letter")
    [dead] = await client.deadletters()
    listed = await anyio.to_thread.run_sync(lambda: toren("deadletters", "--json", db_url=db_url))
    assert listed.returncode == 0, listed.stderr
    [item] = json.loads(listed.stdout)
    assert item["id"] == dead.id
    assert "cannot handle x" in item["error"]
    requeued = await anyio.to_thread.run_sync(
        lambda: toren("deadletters", "requeue", str(dead.id), db_url=db_url)
    )
    assert requeued.returncode == 0, requeued.stderr
    assert "requeued 1 message(s)" in requeued.stdout
    assert await client.deadletters() == []
    assert await client.pool.fetchval("SELECT count(*) FROM toren.mailbox") == 1
    missing = await anyio.to_thread.run_sync(
        lambda: toren("deadletters", "requeue", "999999", db_url=db_url)
    )
    assert missing.returncode == 1


@pytest.mark.parametrize(
    ("args", "env", "needle"),
    [
        (("workers",), {}, "TOREN_DATABASE_URL"),
        (("worker", "--app", "no_such_module_xyz"), {"TOREN_DATABASE_URL": "x"}, "--app"),
        (("workers",), {"TOREN_LEASE_SECONDS": "soon"}, "lease_seconds"),
        (("workers",), {"TOREN_RENEW_SECONDS": "20"}, "renew_seconds"),
    ],
)
def test_bad_configuration_exits_2_and_says_what_to_do(
    tmp_path: Path, args: tuple[str, ...], env: dict[str, str], needle: str
) -> None:
    result = toren(*args, home=tmp_path, **env)
    assert result.returncode == 2, result
    assert needle in result.stderr
    assert "Traceback" not in result.stderr


def test_unreachable_database_exits_1_without_a_traceback(tmp_path: Path) -> None:
    url = f"postgresql://toren:secret@/toren?host={tmp_path}"
    result = toren("workers", db_url=url)
    assert result.returncode == 1
    assert "cannot reach Postgres" in result.stderr
    assert "secret" not in result.stderr
    assert "Traceback" not in result.stderr


async def test_no_server_of_the_url_being_writable_exits_1_without_a_traceback(
    empty_db_url: str,
) -> None:
    """Every server of a multi-host URL up but none of the kind it asks for (all replicas
    during a failover, for read-write): asyncpg's own error, not a reachable-database one, was
    a traceback (here: the one server is a primary, asked for as a standby)."""
    url = f"{empty_db_url}&target_session_attrs=standby"
    for command in (("workers",), ("worker", "--app", "tests.agents_app")):
        result = await anyio.to_thread.run_sync(lambda c=command: toren(*c, db_url=url))
        assert result.returncode == 1, result
        assert "cannot reach Postgres" in result.stderr
        assert "no server of the URL" in result.stderr
        assert "Traceback" not in result.stderr


def test_dev_runs_the_demo_agent_and_a_second_terminal_approves_it(tmp_path: Path) -> None:
    """The demo's first start, its run approved from a second terminal, then a second start
    on the same data: each banner says where the run is and what nothing is paid for; Docker,
    which the demo does not use, is never asked (a socket where nothing answers would say so)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TOREN_", "ANTHROPIC_"))}
    env.update({"TOREN_HOME": str(tmp_path / "home"), "PYTHONPATH": str(ROOT)})
    env["DOCKER_HOST"] = f"unix://{tmp_path}/no-docker.sock"

    def second_terminal(*args: str) -> subprocess.CompletedProcess[str]:
        return toren(*args, home=tmp_path / "home")

    def start(log_path: Path) -> subprocess.Popen[bytes]:
        with log_path.open("w") as log:
            return subprocess.Popen(
                [sys.executable, "-m", "toren", "dev", "--port", "0"],
                env=env,
                cwd=ROOT,
                stdout=log,
                stderr=log,
            )

    def banner(proc: subprocess.Popen[bytes], log_path: Path) -> str:
        deadline = time.monotonic() + 60
        while not re.search(r"In another terminal:\n(?:.*\n){4}", log_path.read_text()):
            assert proc.poll() is None, log_path.read_text()
            assert time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.2)
        return log_path.read_text()

    def stop(proc: subprocess.Popen[bytes], log_path: Path) -> None:
        proc.send_signal(signal.SIGINT)
        proc.wait(30)
        assert proc.returncode == 0, log_path.read_text()

    log_path = tmp_path / "dev.log"
    proc = start(log_path)
    try:
        shown = banner(proc, log_path)
        assert "OFFLINE DEMO MODEL" in shown
        assert "Nothing is paid: its token counts are made up" in shown
        match = re.search(r"Demo run (run/\S+) will park, asking to approve a \$80 refund", shown)
        assert match is not None, shown
        run_id = match.group(1)
        assert f"toren jobs approve {run_id}" in shown
        deadline = time.monotonic() + 60
        while json.loads(second_terminal("jobs", "show", run_id, "--json").stdout)["status"] != (
            "parked"
        ):
            assert time.monotonic() < deadline
            time.sleep(0.2)
        approved = second_terminal("jobs", "approve", run_id)
        assert approved.returncode == 0, approved.stderr
        while (record := json.loads(second_terminal("jobs", "show", run_id, "--json").stdout))[
            "status"
        ] != "completed":
            assert time.monotonic() < deadline, record
            time.sleep(0.2)
        assert "refund for order A-17 is on its way" in record["output"]
        assert record["receipt"]["calls_made"] == 3
        shown = second_terminal("jobs", "show", run_id)
        assert "receipt: 3 calls made" in shown.stdout
        assert len(json.loads(second_terminal("workers", "--json").stdout)) == 1
    finally:
        stop(proc, log_path)
    assert "Docker" not in log_path.read_text()

    again_path = tmp_path / "dev-again.log"
    proc = start(again_path)
    try:
        shown = banner(proc, again_path)
    finally:
        stop(proc, again_path)
    assert f"Demo run {run_id} has completed (on an earlier start)" in shown
    assert "will park" not in shown
    assert "jobs approve" not in shown
    assert f"jobs send {run_id} 'Thanks! When will it arrive?'" in shown
    assert "Docker" not in shown


def test_agents_check_lists_tools_and_flags_the_dangerous_one() -> None:
    result = toren("agents", "check", "--app", "tests.agents_app")
    assert result.returncode == 0, result.stderr
    assert "create_ticket" in result.stdout
    assert "FLAG" in result.stdout
    flagged_lines = [line for line in result.stdout.splitlines() if "FLAG" in line]
    assert len(flagged_lines) == 1
    assert "send_email" in flagged_lines[0]
    strict = toren("agents", "check", "--app", "tests.agents_app", "--strict")
    assert strict.returncode == 1
    missing = toren("agents", "check", "--app", "tests.nope_nope")
    assert missing.returncode == 2


async def test_run_approve_and_show_a_run_from_the_command_line(
    client: Client, db_url: str, workers: WorkerFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    from toren._agent.model import ToolCall
    from toren.runs import read_run
    from toren.testing import AnthropicServer, Reply

    refund_call = ToolCall(id="r1", name="refund", arguments={"amount": 250})
    async with AnthropicServer([Reply([refund_call]), Reply("Refunded.")]) as server:
        for name, value in server.env().items():
            monkeypatch.setenv(name, value)
        workers(app="tests.run_app")

        def cli(*args: str) -> subprocess.CompletedProcess[str]:
            return toren(*args, db_url=db_url)

        started = await anyio.to_thread.run_sync(
            lambda: cli("run", "support", "refund me", "--wait")
        )
        assert started.returncode == 0, started.stderr
        run_id = started.stdout.split()[0]
        # It says what the run waits on and the exact commands that decide it; run as printed.
        assert 'parked: waiting for approval of refund {"amount": 250} (call r1)' in (
            started.stdout
        )
        [approve] = [line for line in started.stdout.splitlines() if "approve:" in line]
        assert "jobs deny " + run_id in started.stdout
        command = shlex.split(approve.split("approve:", 1)[1])
        assert command[-3:] == ["jobs", "approve", run_id]
        if command[0] == "toren":  # this toren is on the PATH: run the same from this Python
            command[:1] = [sys.executable, "-m", "toren"]
        env = {k: v for k, v in os.environ.items() if not k.startswith("TOREN_")}
        env.update(TOREN_DATABASE_URL=db_url, PYTHONPATH=str(ROOT))

        async def passivated() -> bool:  # so that the decision wakes it from its journal
            return (await client.actor(run_id))["owner"] is None

        # The CLI starts faster than a parked run leaves its worker (0.5 s idle).
        await wait_for(passivated, what="the parked run left its worker")
        approved = await anyio.to_thread.run_sync(
            lambda: subprocess.run(
                [*command, "--reason", "fine"], env=env, capture_output=True, text=True, timeout=60
            )
        )
        assert approved.returncode == 0, approved.stderr
        # It shows the call it decides, then what the run did with the decision.
        assert re.search(r'approving refund {"amount": \d+} \(call r1\)', approved.stdout)
        assert "approved" in approved.stdout.splitlines()[-1]
        again = await anyio.to_thread.run_sync(lambda: cli("jobs", "approve", run_id))
        assert again.returncode == 1  # nothing waits now
        assert "not waiting for a decision" in again.stderr

        async def done() -> bool:
            return (await read_run(client, run_id)).status == "completed"

        await wait_for(done, what="completed")
    shown = await anyio.to_thread.run_sync(lambda: cli("jobs", "show", run_id, "--json"))
    record = json.loads(shown.stdout)
    assert record["status"] == "completed"
    assert record["output"] == "Refunded."
    assert record["receipt"]["calls_made"] == 2
    assert record["receipt"]["calls_replayed"] >= 1  # the run parked and went on from its journal
    assert float(record["receipt"]["usd_paid"]) > 0
    assert set(record["receipt"]) >= {"calls_made", "calls_replayed", "usd_paid", "usd_not_repaid"}
    assert record["calls_made"] == 2  # the same figures at the top level of the record
    timeline = await anyio.to_thread.run_sync(lambda: cli("jobs", "show", run_id))
    assert "approval requested for refund" in timeline.stdout
    me = pwd.getpwuid(os.getuid()).pw_name  # from the uid, whatever LOGNAME says
    assert f"approved by {me} via cli" in timeline.stdout
    assert "receipt: 2 calls made" in timeline.stdout
    listed = await anyio.to_thread.run_sync(lambda: cli("jobs", "list"))
    assert run_id in listed.stdout
    missing = await anyio.to_thread.run_sync(lambda: cli("jobs", "show", "run/nope"))
    assert missing.returncode == 2
    assert "toren jobs list" in missing.stderr
    unknown = await anyio.to_thread.run_sync(lambda: cli("run", "nobody", "hello"))
    assert unknown.returncode == 2
    assert "no live worker runs agent 'nobody'" in unknown.stderr


async def test_show_refuses_a_page_bound_past_what_the_journal_counts(
    client: Client, db_url: str
) -> None:
    """``--after`` and ``--limit`` past a 64-bit sequence number are refused as usage errors,
    not passed to Postgres (which cannot take them: a traceback)."""
    from tests.test_sandbox_surfaces import new_run
    from toren.runs import RunCompleted

    run_id = await new_run(client, f"run/{uuid.uuid4()}", "support", [RunCompleted(output="ok")])
    huge = str(2**63)
    for option in ("--after", "--limit"):
        shown = await anyio.to_thread.run_sync(
            lambda o=option: toren("jobs", "show", run_id, o, huge, db_url=db_url)
        )
        assert shown.returncode == 2, (option, shown.stderr[-300:])
        assert "Traceback" not in shown.stderr
        assert f"Invalid value for '{option}'" in shown.stderr
    for bound in ("-1", huge):  # jobs list's too (a negative LIMIT reached Postgres)
        listed = await anyio.to_thread.run_sync(
            lambda b=bound: toren("jobs", "list", "--limit", b, db_url=db_url)
        )
        assert listed.returncode == 2, (bound, listed.stderr[-300:])
        assert "Invalid value for '--limit'" in listed.stderr


async def test_tokens_are_created_listed_and_revoked_from_the_command_line(
    client: Client, db_url: str
) -> None:
    from toren._surfaces.tokens import authenticate

    created = await anyio.to_thread.run_sync(lambda: toren("tokens", "create", "ci", db_url=db_url))
    assert created.returncode == 0, created.stderr
    token = created.stdout.strip()
    assert token.startswith("trn_")
    token_id = token.split("_")[1]
    assert (await authenticate(client.pool, token)) is not None
    listed = await anyio.to_thread.run_sync(lambda: toren("tokens", "list", db_url=db_url))
    assert token_id in listed.stdout
    assert token.split("_", 2)[2] not in listed.stdout  # never the secret
    revoked = await anyio.to_thread.run_sync(
        lambda: toren("tokens", "revoke", token_id, db_url=db_url)
    )
    assert revoked.returncode == 0
    assert (await authenticate(client.pool, token)) is None
    again = await anyio.to_thread.run_sync(
        lambda: toren("tokens", "revoke", token_id, db_url=db_url)
    )
    assert again.returncode == 1
    assert "no live token" in again.stderr


async def test_show_json_carries_the_timeline_a_page_at_a_time(
    client: Client, db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``jobs show --json`` holds what the human view shows: each event as the API gives it,
    with its timeline line, in journal order; ``--limit`` and ``--after`` page through them as
    the API's ``after`` does."""
    from datetime import datetime

    from toren._agent.app import load_app
    from toren.runs import read_run, start_run
    from toren.testing import AnthropicServer, Reply

    load_app("tests.run_app")
    async with AnthropicServer([Reply("Done.")]) as server:
        for name, value in server.env().items():
            monkeypatch.setenv(name, value)
        async with running_worker(db_url):
            run_id = await start_run(client, "support", "hello\nthere")

            async def completed() -> bool:
                return (await read_run(client, run_id)).status == "completed"

            await wait_for(completed, what="the run completed")

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return toren("jobs", "show", run_id, *args, db_url=db_url)

    shown, human = await anyio.to_thread.run_sync(lambda: (cli("--json"), cli()))
    assert shown.returncode == 0, shown.stderr
    record = json.loads(shown.stdout)
    journal = await client.journal(run_id)
    assert [(e["seq"], e["type"], e["data"]) for e in record["events"]] == [
        (e.seq, e.type, e.data) for e in journal
    ]
    assert all(datetime.fromisoformat(e["at"]).tzinfo for e in record["events"])
    lines = [f"{e['seq']:>4}  {e['text']}" for e in record["events"]]
    assert human.stdout.splitlines()[: len(lines)] == lines  # the human view's timeline
    assert "started support: hello\\nthere" in lines[0]
    assert record["more_events"] is False
    first, rest = await anyio.to_thread.run_sync(
        lambda: (cli("--json", "--limit", "2"), cli("--json", "--after", "2"))
    )
    page = json.loads(first.stdout)
    assert [e["seq"] for e in page["events"]] == [1, 2]
    assert page["more_events"] is True
    assert json.loads(rest.stdout)["events"] == record["events"][2:]
    cut = await anyio.to_thread.run_sync(lambda: cli("--limit", "2"))
    assert f"jobs show {run_id} --after 2" in cut.stdout  # how to read on
    assert "receipt: 1 calls made" in cut.stdout  # the receipt is the whole run's
