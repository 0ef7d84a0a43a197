"""Attacks on sandboxes (review of issue 15), on a real Docker daemon and a real Postgres.

Each test is an attack that revealed a problem: it asserts what should happen and fails on the
code as it was reviewed. Hostile commands and tool arguments, hostile workspaces, stale messages,
Docker refusing a setting, crashes at the sandbox's kill points. Traffic stays on loopback.
"""

from __future__ import annotations

import contextlib
import signal
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import pytest

import toren.providers.anthropic  # noqa: F401  (the SDK import is paid here, not in a step)
from tests.conftest import WorkerFactory, person, running_worker, wait_for
from tests.sandbox_support import docker_fixture, sandbox  # noqa: F401  (the fixture)
from tests.steps import Step, bash, model, settled, tool
from toren import Agent, Client, Settings
from toren._agent.app import load_app
from toren.actors.sandboxes.docker import Docker
from toren.actors.sandboxes.hardening import Limits
from toren.actors.sandboxes.outcomes import ExecFailed, Outcome
from toren.runs import cancel, read_run, start_run
from toren.sandboxes import Sandbox
from toren.sandboxes.files import list_workspace, open_store

pytestmark = pytest.mark.anyio

MODEL = "anthropic/claude-sonnet-4-6"
MiB = 1024 * 1024

# Plain commands run without asking (as tests/sandbox_app.py's coder).
prober = Agent(
    name="prober",
    model=MODEL,
    system="prober",
    sandbox=Sandbox(allow=["*"], command_timeout="60s", idle_stop="1h"),
)
# Only exact or subcommand rules, as docs/sandboxes.md recommends ("Prefer exact rules, and
# prefixes of subcommands").
gatekeeper = Agent(
    name="allow_gatekeeper",
    model=MODEL,
    system="gatekeeper",
    sandbox=Sandbox(allow=["ls", "git status", "python3 -m pytest *"], idle_stop="1h"),
)
# A small workspace.
tiny = Agent(
    name="tiny",
    model=MODEL,
    system="tiny",
    sandbox=Sandbox(allow=["*"], workspace_size="8MiB", idle_stop="1h"),
)
# A limit Sandbox() accepts and Docker refuses (no machine has 4,096 CPUs to give).
greedy = Agent(
    name="greedy",
    model=MODEL,
    system="greedy",
    sandbox=Sandbox(allow=["*"], cpus=4096, idle_stop="1h"),
)

APP = "tests.test_sandbox_attacks"


@pytest.fixture
async def runs(docker: Docker) -> AsyncIterator[list[str]]:
    """Run ids whose containers the test removes at its end: a run left waiting for ever (what
    several tests here show) never reaps its own, and its database is dropped after the test."""
    started: list[str] = []
    yield started
    with anyio.CancelScope(shield=True):
        for run_id in started:
            while (info := await docker.find(run_id)) is not None:
                await docker.remove(info.container_id)


def sandboxed(db_url: str, tmp_path: Path, **overrides: Any) -> Any:
    return running_worker(
        db_url, sandboxes=True, workspace_store=str(tmp_path / "workspaces"), **overrides
    )


def sandbox_of(run_id: str) -> str:
    return "sandbox/" + run_id.removeprefix("run/")


async def journal(client: Client, actor_id: str) -> list[tuple[str, dict[str, Any]]]:
    rows = await client.pool.fetch(
        "SELECT type, data FROM toren.journal WHERE actor_id = $1 ORDER BY seq", actor_id
    )
    return [(r["type"], r["data"]) for r in rows]


async def workspace_names(client: Client, tmp_path: Path, run_id: str) -> set[str]:
    store = open_store(Settings(workspace_store=str(tmp_path / "workspaces")))
    try:
        return {name for name, _, _ in await list_workspace(client, store, run_id)}
    finally:
        await store.close()


# -- the model's ordinary mistakes ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("calls", "says"),
    [
        ([tool("read_file", "x", path="missing.txt")], "no such file"),
        ([tool("read_file", "x", path=".")], "directory"),
        ([tool("list_files", "x", path="nope")], "no such file"),
        (
            [
                tool("write_file", "w", path="f", content="x"),
                tool("write_file", "x", path="f/g", content="y"),
            ],
            "not a directory",
        ),
    ],
    ids=["read-missing", "read-directory", "list-missing", "write-under-a-file"],
)
async def test_a_file_tool_on_a_wrong_path_gives_an_error_result_and_the_run_goes_on(
    client: Client,
    db_url: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    docker: Docker,
    runs: list[str],
    calls: list[Any],
    says: str,
) -> None:
    """read_file of a file that does not exist is the model's most common mistake. The Docker
    layer raises FileNotFoundError (IsADirectoryError, NotADirectoryError); the actor catches
    only PathRefused, so the step fails, is retried four times, and is dead-lettered. The
    sandbox's on_dead_letter then records command.finished and *sends* run.sandbox_done, but the
    kernel's dead-letter statement commits the events only, never the messages: the run waits
    for ever."""
    load_app(APP)
    steps: list[Step] = [calls, "{results}"]
    async with model(steps, monkeypatch), sandboxed(db_url, tmp_path):
        run_id = await start_run(client, "prober", "probe")
        runs.append(run_id)
        try:
            status = await wait_for(lambda: settled(client, run_id), timeout=45)
        except AssertionError:
            status = None
    finished = [d for t, d in await journal(client, sandbox_of(run_id)) if t == "command.finished"]
    assert status == "completed", (
        f"the run never got the call's result (status {status}); the sandbox recorded "
        f"{[(d['call_id'], d['state'], d['content'][:120]) for d in finished]}"
    )
    result = (await read_run(client, run_id)).results["x"]
    assert result.is_error
    assert says in result.content
    assert "could not run this call" not in result.content  # an answer, not four retries


async def test_a_limit_docker_refuses_fails_the_run_with_class_config(
    client: Client,
    db_url: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    docker: Docker,
    runs: list[str],
) -> None:
    """Sandbox(cpus=4096) (or [agents.NAME.sandbox] cpus) passes validation; Docker refuses the
    create with a 400. Only Unavailable is turned into a config failure; the DockerError fails
    the step four times, is dead-lettered, and the run is never told (see above)."""
    load_app(APP)
    async with model([[bash("ls", "b1")], "{results}"], monkeypatch), sandboxed(db_url, tmp_path):
        run_id = await start_run(client, "greedy", "list")
        runs.append(run_id)
        try:
            status = await wait_for(lambda: settled(client, run_id), timeout=45)
        except AssertionError:
            status = None
    state = await read_run(client, run_id)
    assert status == "failed", f"the run is left {state.status}, waiting for ever"
    assert state.error_class == "config"
    assert "cpu" in (state.error or "").lower()


async def test_a_workspace_store_that_cannot_be_written_fails_the_run_visibly(
    client: Client,
    db_url: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    docker: Docker,
    runs: list[str],
) -> None:
    """The store is a directory under a regular file (as a mistyped or read-only path would
    be). The worker says at boot that sandboxes are available (the store is not tried), the
    command runs once, its checkpoint raises NotADirectoryError four times, the step is
    dead-lettered and the run waits for ever. (An S3 bucket that does not exist goes the same
    way: its ConfigError is raised by the first checkpoint, not at boot.)"""
    load_app(APP)
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    steps: list[Step] = [[bash("touch a", "b1")], "{results}"]
    async with (
        model(steps, monkeypatch),
        running_worker(db_url, sandboxes=True, workspace_store=str(blocker / "workspaces")),
    ):
        run_id = await start_run(client, "prober", "touch")
        runs.append(run_id)
        try:
            status = await wait_for(lambda: settled(client, run_id), timeout=45)
        except AssertionError:
            status = None
    state = await read_run(client, run_id)
    assert status == "failed", f"the run is left {state.status}, waiting for ever"
    assert "not-a-directory" in (state.error or "")


# -- approvals ------------------------------------------------------------------------------------

BYPASSES = {
    # git runs core.fsmonitor (a shell command) on `git status`; the repository's config is a
    # file of the workspace, which write_file writes without asking.
    "git status": {
        ".git/HEAD": "ref: refs/heads/main\n",
        ".git/config": (
            '[core]\n\trepositoryformatversion = 0\n\tfsmonitor = "touch pwned; false"\n'
        ),
        ".git/objects/.keep": "",
        ".git/refs/.keep": "",
    },
    # `python3 -m X` imports X from the working directory first.
    "python3 -m pytest -q": {"pytest.py": "open('pwned', 'w').write('not approved')\n"},
}


@pytest.mark.parametrize("allowed", sorted(BYPASSES))
async def test_write_file_and_an_allowed_command_run_code_no_human_approved(
    client: Client,
    db_url: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    docker: Docker,
    runs: list[str],
    allowed: str,
) -> None:
    """A documented limit, kept true by this test: write_file needs no approval, so an allow
    rule for a program that runs what is in the workspace ("git status" runs a core.fsmonitor
    hook from .git/config; "python3 -m pytest -q" imports pytest.py from the working directory)
    runs whatever the model wrote, and no one is asked. docs/sandboxes.md says so and tells
    operators to allow only commands that read and do not run the workspace. (The container
    still bounds it.) If this test fails, the behaviour changed: fix the docs with it."""
    load_app(APP)
    writes = [
        tool("write_file", f"w{i}", path=path, content=content)
        for i, (path, content) in enumerate(BYPASSES[allowed].items())
    ]
    steps: list[Step] = [writes, [bash(allowed, "b1")], "{results}"]
    async with model(steps, monkeypatch), sandboxed(db_url, tmp_path):
        run_id = await start_run(client, "allow_gatekeeper", "check the tests")
        runs.append(run_id)
        assert await wait_for(lambda: settled(client, run_id), timeout=60) == "completed"
    state = await read_run(client, run_id)
    ran = "pwned" in await workspace_names(client, tmp_path, run_id)
    assert ran
    assert not state.asked
    docs = (Path(__file__).parent.parent / "docs" / "sandboxes.md").read_text()
    assert "A rule for a program that reads code or configuration from the workspace" in docs


# -- hostile workspaces ---------------------------------------------------------------------------


async def test_a_sparse_file_does_not_make_the_worker_read_past_the_workspace_size(
    client: Client,
    db_url: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    docker: Docker,
    runs: list[str],
) -> None:
    """`truncate -s 200M big` in an 8 MiB workspace: tmpfs keeps a sparse file of any length
    within its size cap, tar exports its 200 MB of zeros, and the worker reads the whole stream
    into memory, hashes it and stores a 200 MB blob. With `truncate -s 1T` (a plain command,
    allowed by "*") the worker runs out of memory, and so does the next one to take the run
    over. The sizes here are bounded: 200 MB."""
    load_app(APP)
    steps: list[Step] = [[bash("truncate -s 200M big", "t1")], [bash("ls -ls", "t2")], "{results}"]
    async with model(steps, monkeypatch), sandboxed(db_url, tmp_path):
        run_id = await start_run(client, "tiny", "sparse")
        runs.append(run_id)
        await wait_for(lambda: settled(client, run_id), timeout=120)
    checkpointed = [
        d for t, d in await journal(client, sandbox_of(run_id)) if t == "workspace.checkpointed"
    ]
    blobs = tmp_path / "workspaces" / "blobs"
    largest = max((p.stat().st_size for p in blobs.iterdir()), default=0) if blobs.exists() else 0
    assert largest <= 8 * MiB, f"a {largest}-byte blob from an 8 MiB workspace"
    assert all(d["bytes"] <= 8 * MiB for d in checkpointed), checkpointed


# -- commands that outlive themselves, records a command can break ---------------------------------


async def test_a_daemonized_command_does_not_outlive_its_command_or_kill_all(
    docker: Docker,
) -> None:
    """`setsid -f env -i sleep 600` (no shell control syntax: any "*" rule allows it) leaves
    its process group and drops the marker: it escapes the end-of-command kill, the time limit
    and kill_all (what a new owner runs after a crash). docker.py's docstring admits it;
    docs/sandboxes.md promises that a never-ending command is killed at the time limit and that
    every command still running from before is killed. The escaped process also holds the
    output fifo open, so the command took 10 s more to return."""
    async with sandbox(docker) as container:
        started = time.monotonic()
        await docker.run(
            container,
            marker="daemon",
            # The plain `setsid -f env -i sleep 600` escapes too, unless the end-of-command kill
            # wins the race with setsid (1 run in 3 here): the sleep makes the test certain.
            command="setsid -f env -i sleep 600; sleep 1",
            timeout=5,
            output_cap=4096,
        )
        took = time.monotonic() - started
        await docker.kill_all(container)
        ps = await docker.run(
            container, marker="ps", command="ps -eo args", timeout=30, output_cap=65536
        )
    assert "sleep 600" not in ps.output, f"alive after its command and kill_all:\n{ps.output}"
    assert took < 6, f"the command returned after {took:.1f}s"


async def test_a_full_tmp_does_not_cost_later_commands_their_exit_status_and_output(
    docker: Docker,
) -> None:
    """Command records live in the container's /tmp, which commands fill (pip, pytest, sort,
    a build's temporary files; 64 MiB by default). Once it is full, every later command has no
    `exit` record and no stored output: it is reported `interrupted` with exit None and no
    output (the actor shows the model `[in /workspace; exit None]` as an error), even
    `rm /tmp/fill`, until the container is restarted."""
    async with sandbox(docker, Limits(tmp_bytes=8 * MiB)) as container:
        await docker.run(
            container,
            marker="fill",
            command="head -c 20M /dev/zero > /tmp/fill",
            timeout=30,
            output_cap=4096,
        )
        later = await docker.run(
            container, marker="later", command="echo hello", timeout=30, output_cap=4096
        )
    assert later == Outcome(state="finished", exit_code=0, output="hello\n", output_bytes=6)


async def test_a_command_cannot_make_recover_and_kill_all_kill_themselves(
    docker: Docker,
) -> None:
    """A command writes 0 into its own pid record and kills its wrapper. kill_command then runs
    `kill -KILL -- -0`, which is the helper's own process group: recover and kill_all die with
    137 every time. The actor's first step of every new activation runs kill_all, so each
    command of the run fails (and is dead-lettered) until the container is stopped."""
    command = (
        "sleep 0.5; echo 0 > /run/toren/$TOREN_COMMAND.pid; "
        "kill -9 $(cat /run/toren/$TOREN_COMMAND.wrapper); sleep 600"
    )
    async with sandbox(docker) as container:
        with pytest.raises(ExecFailed, match="exit 137"):  # its wrapper was killed
            await docker.run(
                container, marker="poison", command=command, timeout=30, output_cap=4096
            )
        killed = await docker.kill_all(container)
        recovered = await docker.recover(container, "poison")
    assert killed >= 0
    assert recovered.state == "interrupted"


async def test_a_forgotten_marker_still_runs_at_most_once(docker: Docker) -> None:
    """The marker is what stops a worker that lost its lease between ensure_lease() and the
    exec (a GC pause, SIGSTOP, a VM freeze) from running a command the next owner already ran:
    run() refuses a marker whose record exists (MarkerUsed). But the next owner forgets the
    records of its journaled commands before its next command (`_forget`), and forget deletes
    the whole record, `started` included: the stalled worker's exec then runs the command a
    second time. Keeping `<marker>.started` (a few bytes) would keep the guard."""
    async with sandbox(docker) as container:
        await docker.run(
            container, marker="once", command="echo x >> ran", timeout=30, output_cap=4096
        )
        await docker.forget(container, "once")  # the next owner, before its next command
        with contextlib.suppress(ValueError):  # the stalled worker, resumed (MarkerUsed)
            await docker.run(
                container, marker="once", command="echo x >> ran", timeout=30, output_cap=4096
            )
        data, _ = await docker.read_file(container, "ran", 100)
    assert data == b"x\n", f"the command ran {data.count(b'x')} times"


# -- lists ----------------------------------------------------------------------------------------


async def test_list_files_lists_recursively_as_its_description_says(
    client: Client,
    db_url: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    docker: Docker,
    runs: list[str],
) -> None:
    """The tool's description tells the model "List a directory of the workspace, recursively,
    with sizes"; the actor calls the Docker layer's list_files with recursive=False."""
    load_app(APP)
    steps: list[Step] = [
        [tool("write_file", "w1", path="src/pkg/mod.py", content="x = 1\n")],
        [tool("list_files", "l1", path=".")],
        "{results}",
    ]
    async with model(steps, monkeypatch), sandboxed(db_url, tmp_path):
        run_id = await start_run(client, "prober", "list")
        runs.append(run_id)
        assert await wait_for(lambda: settled(client, run_id), timeout=60) == "completed"
    listing = (await read_run(client, run_id)).results["l1"].content
    assert "src/pkg/mod.py" in listing, listing


async def test_list_files_says_when_it_is_cut(
    client: Client,
    db_url: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    docker: Docker,
    runs: list[str],
) -> None:
    """At 1,000 entries the list is cut without a word (the helper prints the total; the
    actor drops it): the model takes the first 1,000 names for the whole directory."""
    load_app(APP)
    steps: list[Step] = [
        [bash("touch many{0001..1500}", "b1")],
        [tool("list_files", "l2", path=".")],
        "{results}",
    ]
    async with model(steps, monkeypatch), sandboxed(db_url, tmp_path):
        run_id = await start_run(client, "prober", "list")
        runs.append(run_id)
        assert await wait_for(lambda: settled(client, run_id), timeout=60) == "completed"
    lines = (await read_run(client, run_id)).results["l2"].content.splitlines()
    assert len(lines) == 1500 or "stops at 1000 entries" in lines[-1], (
        f"{len(lines)} lines, the last {lines[-1]!r}: 500 entries left out without a word"
    )


# -- the run's end, crashes ---------------------------------------------------------------------


async def test_a_cancelled_runs_command_in_flight_runs_to_its_end(
    client: Client,
    db_url: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    docker: Docker,
    runs: list[str],
) -> None:
    """docs/sandboxes.md: "A cancelled run's command in flight is not cut short ... the
    container is removed once the command ends". The orphan reaper removes the container of an
    ended run at its next round (every sandbox_reap_seconds) whatever runs in it; the sandbox's
    step then fails (exit 137), and its retry makes a new container for the ended run, restores
    its workspace into it, checkpoints it and reports the command interrupted."""
    load_app(APP)
    steps: list[Step] = [[bash("sleep 20", "s1")], "never"]
    async with model(steps, monkeypatch), sandboxed(db_url, tmp_path, sandbox_reap_seconds=2.0):
        run_id = await start_run(client, "prober", "sleep")
        runs.append(run_id)
        await wait_for(lambda: _sleeping(docker, run_id), timeout=60, what="the command running")
        await cancel(client, run_id, by=person("ana"))
        # An absence window, bounded: the container must NOT go while the command runs. In 8 s
        # the reaper (every 2 s) has had four rounds; the command still has 10 s or more left.
        await anyio.sleep(8)
        alive = await docker.find(run_id)
        await wait_for(
            lambda: _finished(client, run_id), timeout=60, what="the sandbox's command.finished"
        )
        events = await journal(client, sandbox_of(run_id))
    [finished] = [d for t, d in events if t == "command.finished"]
    assert alive is not None, (
        f"removed mid-command, then a new container made for the ended run and the command "
        f"reported {finished['state']}: {[t for t, _ in events]}"
    )
    assert finished["state"] == "finished"


async def _sleeping(docker: Docker, run_id: str) -> bool:
    """Whether the run's container runs the test's ``sleep 20`` (seen by ``pgrep`` inside)."""
    found = await docker.find(run_id)
    if found is None:
        return False
    command = ["docker", "exec", found.container_id, "pgrep", "-f", "sleep 20"]
    done = await anyio.run_process(command, check=False)
    return done.returncode == 0


async def _finished(client: Client, run_id: str) -> bool:
    return any(t == "command.finished" for t, _ in await journal(client, sandbox_of(run_id)))


async def test_a_command_whose_container_was_never_made_is_run_not_reported_interrupted(
    client: Client,
    db_url: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    docker: Docker,
    runs: list[str],
    workers: WorkerFactory,
) -> None:
    """The worker dies at the kill point sandbox.creating: no container exists, nothing ran.
    The next owner's create makes the container `fresh`, and a fresh container on a second
    delivery reports the command interrupted ("Exit status unknown ... Check what it did") for
    a command that certainly never started: the model is told to check an effect that cannot
    exist, and the command is lost."""
    store = str(tmp_path / "workspaces")
    frozen = tmp_path / "kill-point"
    frozen.mkdir()
    steps: list[Step] = [[bash("touch ran.txt", "b1")], "{results}"]
    async with model(steps, monkeypatch):
        first = workers(
            APP,
            sandboxes="true",
            workspace_store=store,
            kill_point="sandbox.creating#1",
            kill_point_dir=str(frozen),
        )
        run_id = await start_run(client, "prober", "touch")
        runs.append(run_id)

        async def hit() -> bool:
            return (frozen / "hit").exists()

        await wait_for(hit, timeout=60, what="the worker at sandbox.creating")
        first.signal(signal.SIGKILL)
        first.wait(10)
        second = workers(APP, sandboxes="true", workspace_store=store)
        assert await wait_for(lambda: settled(client, run_id), timeout=90) == "completed", (
            second.log()
        )
    result = (await read_run(client, run_id)).results["b1"]
    assert not result.is_error, result.content
    assert "ran.txt" in await workspace_names(client, tmp_path, run_id)
