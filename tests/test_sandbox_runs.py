"""Runs with sandboxes on a real Docker daemon: tools run in the run's container, approval per
command and allow rules, checkpoints on each result, reaping at the end, idle stop and restart,
no Docker anywhere, and at-most-once commands across a worker's SIGKILL."""

from __future__ import annotations

import signal
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
from aiodocker.exceptions import DockerError

import toren.providers.anthropic  # noqa: F401  (the SDK import is paid here, not in a step)
from tests.conftest import WorkerFactory, decide_waiting, person, running_worker, wait_for
from tests.sandbox_support import unavailable
from tests.steps import Step, bash, model, settled, tool
from toren import Client
from toren._agent.app import load_app
from toren.actors.sandboxes.docker import Docker, Unavailable
from toren.runs import cancel, read_run, start_run, waiting_on
from toren.sandboxes import DEFAULT_IMAGE

pytestmark = pytest.mark.anyio


@pytest.fixture
async def docker() -> AsyncIterator[Docker]:
    """The Docker daemon and the sandbox image, for one test (these tests' async fixtures are
    per test: a session-wide one would share their event loop)."""
    try:
        client = await Docker.connect()
        await client.check_image(DEFAULT_IMAGE)
    except Unavailable as exc:
        unavailable(str(exc))
    try:
        yield client
    finally:
        await client.close()


async def tool_results(client: Client, run_id: str) -> list[dict[str, Any]]:
    rows = await client.pool.fetch(
        "SELECT data FROM toren.journal WHERE actor_id = $1 AND type = 'tool.result' ORDER BY seq",
        run_id,
    )
    return [r["data"] for r in rows]


async def sandbox_events(client: Client, run_id: str) -> list[str]:
    sandbox = "sandbox/" + run_id.removeprefix("run/")
    rows = await client.pool.fetch(
        "SELECT type FROM toren.journal WHERE actor_id = $1 ORDER BY seq", sandbox
    )
    return [r["type"] for r in rows]


def sandboxed(db_url: str, tmp_path: Path, **overrides: Any) -> Any:
    return running_worker(
        db_url, sandboxes=True, workspace_store=str(tmp_path / "workspaces"), **overrides
    )


async def test_tools_run_in_the_runs_container_and_each_result_names_its_checkpoint(
    client: Client, db_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, docker: Docker
) -> None:
    load_app("tests.sandbox_app")
    steps: list[Step] = [
        [tool("write_file", "w1", path="notes/a.txt", content="hello from the model\n")],
        [bash("cat notes/a.txt", "b1")],
        [tool("read_file", "r1", path="notes/a.txt")],
        [tool("list_files", "l1", path=".")],
        [bash("id -u", "b2"), bash("env", "b3"), tool("read_file", "r2", path="../etc/passwd")],
        "done:\n{results}",
    ]
    async with model(steps, monkeypatch), sandboxed(db_url, tmp_path):
        run_id = await start_run(client, "coder", "write a note")
        assert await wait_for(lambda: settled(client, run_id), timeout=60) == "completed"

    state = await read_run(client, run_id)
    wrote, cat, read, listing, uid, env, escape = (
        state.results[c].content for c in ("w1", "b1", "r1", "l1", "b2", "b3", "r2")
    )
    assert wrote == "wrote 21 bytes to notes/a.txt"
    assert cat.startswith("$ cat notes/a.txt\n[in /workspace; exit 0]\nhello from the model")
    assert read == "hello from the model\n"
    assert "notes/" in listing
    assert "\n1000" in uid  # not root
    # No Toren environment inside (only the marker that finds the command).
    assert [v for v in env.split("\n") if v.startswith("TOREN")] == [
        v for v in env.split("\n") if v.startswith("TOREN_COMMAND=")
    ]
    assert "ANTHROPIC" not in env
    assert state.results["r2"].is_error
    assert "refused" in escape
    # Results of calls that may change the workspace commit with its checkpoint.
    recorded = {r["call_id"]: r for r in await tool_results(client, run_id)}
    assert recorded["w1"]["checkpoint"]
    assert recorded["b1"]["checkpoint"] == recorded["w1"]["checkpoint"]  # cat changed nothing
    assert recorded["r1"]["checkpoint"] == recorded["w1"]["checkpoint"]  # what it read
    events = await sandbox_events(client, run_id)
    assert events[:2] == ["command.intended", "sandbox.created"]
    assert events.count("command.intended") == events.count("command.finished") == 7
    assert events.count("workspace.checkpointed") == 1
    # The run ended: its container goes (the checkpoints stay).
    await wait_for(lambda: _gone(docker, run_id), timeout=30, what="the container reaped")
    assert "sandbox.reaped" in await sandbox_events(client, run_id)
    assert any((tmp_path / "workspaces" / "manifests").iterdir())


async def _gone(docker: Docker, run_id: str) -> bool:
    return await docker.find(run_id) is None


async def test_each_command_is_approved_unless_an_allow_rule_matches_it(
    client: Client,
    db_url: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    docker: Docker,
    request: pytest.FixtureRequest,
) -> None:
    load_app("tests.sandbox_app")
    steps: list[Step] = [
        [bash("ls", "a1"), bash("echo allowed by prefix", "a2")],
        [bash("ls; rm -rf /workspace", "d1")],
        [bash("git status | sh", "d2")],
        [bash("touch approved.txt", "p1")],
        "{results}",
    ]
    async with model(steps, monkeypatch), sandboxed(db_url, tmp_path):
        run_id = await start_run(client, "careful", "tidy up")

        async def asked(call_id: str) -> Any:
            state = await read_run(client, run_id)
            return [c for c in waiting_on(state) if c.id == call_id]

        [shown] = await wait_for(lambda: asked("d1"), timeout=60)
        assert shown.arguments == {"command": "ls; rm -rf /workspace"}
        requested = await client.pool.fetchval(
            "SELECT data FROM toren.journal WHERE actor_id = $1 AND type = 'approval.requested'",
            run_id,
        )
        assert requested["cwd"] == "/workspace"
        await decide_waiting(client, run_id, approved=False, by=person("ana"), reason="no")
        await wait_for(lambda: asked("d2"), timeout=30)
        await decide_waiting(client, run_id, approved=False, by=person("ana"))
        await wait_for(lambda: asked("p1"), timeout=30)
        await decide_waiting(client, run_id, approved=True, by=person("ana"))
        assert await wait_for(lambda: settled(client, run_id), timeout=60) == "completed"

    state = await read_run(client, run_id)
    assert set(state.asked) == {"d1", "d2", "p1"}  # ls and echo ran without asking
    assert state.results["a2"].content.endswith("allowed by prefix\n")
    assert state.results["d1"].denied
    assert state.results["d2"].denied
    assert "exit 0" in state.results["p1"].content
    assert (await tool_results(client, run_id))[-1]["checkpoint"]
    if request.config.getoption("--record-journals", default=False):
        _record(await client.journal(run_id), state, "run_v1_sandboxed")


def _record(journal: list[Any], state: Any, name: str) -> None:
    """Record a sandboxed run's journal as a fixture (``--record-journals``): its events stay
    readable by every later version (tests/test_runs.py replays every fixture)."""
    import json

    from toren.runs import receipt

    fixtures = Path(__file__).parent / "fixtures" / "journals"
    entries = [{"seq": e.seq, "type": e.type, "data": e.data} for e in journal]
    (fixtures / f"{name}.json").write_text(json.dumps(entries, indent=1, sort_keys=True) + "\n")
    r = receipt(state)
    expected = {
        "status": state.status,
        "output": state.output,
        "steps": [c.step for c in state.calls],
        "tools": sorted([k, v.content] for k, v in state.results.items()),
        "approvals": sorted([k, v.who, v.approved] for k, v in state.decisions.items()),
        "calls_made": r.calls_made,
        "usd_paid": str(r.usd_paid),
    }
    (fixtures / f"{name}.expected").write_text(
        json.dumps(expected, indent=1, sort_keys=True) + "\n"
    )


async def test_without_a_worker_that_has_docker_a_sandbox_step_fails_the_run_with_class_config(
    client: Client, db_url: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    load_app("tests.sandbox_app")
    caplog.set_level("INFO", logger="toren.sandbox")
    async with model([[bash("ls", "x1")], "never"], monkeypatch), running_worker(db_url):
        run_id = await start_run(client, "coder", "list")
        assert await wait_for(lambda: settled(client, run_id)) == "failed"
    state = await read_run(client, run_id)
    assert state.error_class == "config"
    assert "no live worker has Docker" in (state.error or "")
    assert "docs/sandboxes.md" in (state.error or "")
    # The worker said at boot why it runs no sandboxes.
    assert "sandboxes are turned off on this worker" in caplog.text


async def test_an_idle_sandbox_is_stopped_and_started_again_with_its_workspace(
    client: Client, db_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, docker: Docker
) -> None:
    load_app("tests.sandbox_app")
    steps: list[Step] = [
        [tool("write_file", "s1", path="kept.txt", content="kept\n")],
        [bash("cat kept.txt", "s2")],
        "{results}",
    ]
    async with model(steps, monkeypatch) as server, sandboxed(db_url, tmp_path):
        hold = server.hold(2)  # the run waits before its second model call: the sandbox idles
        run_id = await start_run(client, "sleepy", "keep a file")
        with anyio.fail_after(60):
            await hold.arrived.wait()

        async def stopped() -> bool:
            info = await docker.find(run_id)
            return info is not None and info.state != "running"

        await wait_for(stopped, timeout=30, what="the idle container stopped")
        hold.release()
        assert await wait_for(lambda: settled(client, run_id), timeout=60) == "completed"

    state = await read_run(client, run_id)
    assert state.results["s2"].content.endswith("kept\n")
    events = await sandbox_events(client, run_id)
    assert "sandbox.stopped" in events
    assert events.index("sandbox.restored") > events.index("sandbox.stopped")


async def test_a_command_in_flight_when_its_worker_is_killed_is_killed_and_not_run_again(
    client: Client,
    db_url: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    docker: Docker,
    workers: WorkerFactory,
) -> None:
    steps: list[Step] = [
        [bash("echo start >> log.txt; sleep 300; echo end >> log.txt", "long")],
        [bash("cat log.txt", "look"), bash("ps -eo args", "ps")],
        "{results}",
    ]
    store = str(tmp_path / "workspaces")
    async with model(steps, monkeypatch):
        first = workers("tests.sandbox_app", sandboxes="true", workspace_store=store)
        run_id = await start_run(client, "coder", "run long")
        # `;` is shell control syntax: asked about whatever the allow rules say.
        await wait_for(lambda: _waiting(client, run_id), timeout=60, what="the approval asked")
        await decide_waiting(client, run_id, approved=True, by=person("ana"))

        async def started() -> bool:
            # Found again at each look: on a loaded machine the sandbox's first container may be
            # removed and made again (a creation that timed out) before the command runs.
            container = await docker.find(run_id)
            if container is None:
                return False
            try:
                data, _ = await docker.read_file(container.container_id, "log.txt", 100)
            except FileNotFoundError:  # the command has not written it yet
                return False
            except DockerError as exc:
                if exc.status != 404:
                    raise
                return False  # that container is gone: look for the run's container again
            return data == b"start\n"

        await wait_for(started, timeout=60, what="the long command started")
        first.signal(signal.SIGKILL)
        first.wait(10)
        second = workers("tests.sandbox_app", sandboxes="true", workspace_store=store)
        assert await wait_for(lambda: settled(client, run_id), timeout=90) == "completed", (
            second.log()
        )

    state = await read_run(client, run_id)
    long = state.results["long"]
    assert long.is_error
    assert "interrupted" in long.content
    assert "Exit status unknown" in long.content
    assert state.results["look"].content.endswith("\nstart\n")  # not run again, no "end"
    assert "sleep 300" not in state.results["ps"].content  # found and killed
    await wait_for(lambda: _gone(docker, run_id), timeout=30, what="the container reaped")


async def _waiting(client: Client, run_id: str) -> bool:
    return bool(waiting_on(await read_run(client, run_id)))


@pytest.fixture
def s3_workspaces(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A workspace store on moto's S3 server (loopback), reached with the real aioboto3."""
    import boto3
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    for name, value in {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "TOREN_S3_ENDPOINT_URL": endpoint,
        "NO_PROXY": "127.0.0.1,localhost",
    }.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(
        Bucket="workspaces"
    )
    try:
        yield "s3://workspaces/toren"
    finally:
        server.stop()


async def test_a_run_whose_container_is_lost_resumes_with_its_files_from_s3(
    client: Client,
    db_url: str,
    monkeypatch: pytest.MonkeyPatch,
    docker: Docker,
    s3_workspaces: str,
) -> None:
    load_app("tests.sandbox_app")
    steps: list[Step] = [
        [tool("write_file", "w1", path="src/main.py", content="print('kept')\n")],
        [bash("python3 src/main.py > out.txt", "b1")],  # a redirection: asked about
        [bash("cat out.txt", "b2"), tool("list_files", "l1", path=".")],
        "{results}",
    ]
    async with model(steps, monkeypatch):
        async with running_worker(db_url, sandboxes=True, workspace_store=s3_workspaces):
            run_id = await start_run(client, "coder", "keep it")
            await wait_for(lambda: _waiting(client, run_id), timeout=60, what="the approval")
        # The host is lost: the worker is gone, and so is the container with its workspace.
        lost = await docker.find(run_id)
        assert lost is not None
        await docker.remove(lost.container_id)
        async with running_worker(db_url, sandboxes=True, workspace_store=s3_workspaces):
            await decide_waiting(client, run_id, approved=True, by=person("ana"))
            assert await wait_for(lambda: settled(client, run_id), timeout=60) == "completed"

    state = await read_run(client, run_id)
    assert state.results["b2"].content.endswith("\nkept\n")
    assert "src/" in state.results["l1"].content
    events = await sandbox_events(client, run_id)
    assert events.count("sandbox.created") == 2
    assert "sandbox.restored" in events
    noted = await client.pool.fetchval(
        "SELECT data->>'text' FROM toren.journal WHERE actor_id = $1 AND type = 'sandbox.noted'",
        run_id,
    )
    assert "restored from checkpoint" in noted


async def test_the_container_of_a_run_that_ended_without_its_sandbox_is_reaped_within_60s(
    client: Client, db_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, docker: Docker
) -> None:
    """A worker killed while its run's container lives, and the run ended elsewhere with no
    sandbox step to remove it: the orphan reaper of any worker with Docker removes it."""
    load_app("tests.sandbox_app")
    steps: list[Step] = [[bash("ls", "b1")], [bash("ls -la; echo parked", "b2")], "never"]
    async with model(steps, monkeypatch), sandboxed(db_url, tmp_path):
        run_id = await start_run(client, "coder", "park")
        await wait_for(lambda: _waiting(client, run_id), timeout=60, what="the approval")
    assert await docker.find(run_id) is not None
    # The run ends while no worker runs: its sandbox's reap waits in its mailbox, and the
    # sandbox actor is taken away, as if its database rows were lost with its host.
    await cancel(client, run_id, by=person("ana"))
    sandbox = "sandbox/" + run_id.removeprefix("run/")
    await client.pool.execute("DELETE FROM toren.mailbox WHERE actor_id = $1", sandbox)
    await client.pool.execute("DELETE FROM toren.actors WHERE actor_id = $1", sandbox)
    async with sandboxed(db_url, tmp_path, sandbox_reap_seconds=2.0):
        await wait_for(lambda: _gone(docker, run_id), timeout=60, what="the orphan reaped")
        assert await settled(client, run_id) == "cancelled"


async def test_other_actors_read_and_write_a_runs_workspace_through_the_file_api(
    client: Client, db_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, docker: Docker
) -> None:
    from toren import Settings
    from toren.sandboxes.files import NoWorkspace, open_store, read_workspace_file, write_files

    load_app("tests.sandbox_app")
    steps: list[Step] = [
        [tool("write_file", "w1", path="draft.md", content="# draft\n")],
        [bash("cat inbox/photo.txt; echo", "b1")],  # asked about: the test writes first
        "{results}",
    ]
    store_dir = str(tmp_path / "workspaces")
    store = open_store(Settings(workspace_store=store_dir))
    async with model(steps, monkeypatch), sandboxed(db_url, tmp_path):
        run_id = await start_run(client, "coder", "draft")
        with pytest.raises(NoWorkspace):
            await write_files(client, "run/00000000-0000-0000-0000-000000000000", {"a": b"x"})
        await wait_for(lambda: _waiting(client, run_id), timeout=60, what="the approval")
        data, size = await read_workspace_file(client, store, run_id, "draft.md")
        assert (data, size) == (b"# draft\n", 8)
        checkpoint = await write_files(client, run_id, {"inbox/photo.txt": b"a photo\0\xff"})
        assert checkpoint
        await decide_waiting(client, run_id, approved=True, by=person("ana"))
        assert await wait_for(lambda: settled(client, run_id), timeout=60) == "completed"
    state = await read_run(client, run_id)
    assert "a photo" in state.results["b1"].content
    data, _ = await read_workspace_file(client, store, run_id, "inbox/photo.txt")
    assert data == b"a photo\0\xff"
    await store.close()


async def test_a_worker_without_a_docker_daemon_says_so_and_serves_no_sandboxes(
    db_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from toren import Settings
    from toren.actors.sandboxes import runtime
    from toren.kernel import create_pool
    from toren.runs import Agents

    monkeypatch.setenv("DOCKER_HOST", f"unix://{tmp_path}/no-docker.sock")
    caplog.set_level("INFO", logger="toren.sandbox")
    pool = await create_pool(db_url, size=1)
    try:
        settings = Settings(database_url=db_url, workspace_store=str(tmp_path / "ws"))
        agents = Agents()
        sandboxes = await runtime.open_sandboxes(settings, pool, agents)
        assert not sandboxes.available
    finally:
        await pool.close()
    assert "sandbox" not in agents.served_routes()
    assert "sandboxes unavailable on this worker" in caplog.text
    with pytest.raises(Unavailable, match="docker"):
        sandboxes.current()
