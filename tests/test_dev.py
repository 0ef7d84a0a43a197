"""``toren dev`` as a newcomer meets it, run as a real process with a clean HOME: the record it
leaves for other terminals, a second ``toren dev``, a stale record, and Ctrl-C at any moment."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest

from tests.conftest import ROOT, wait_for
from toren import recorded_dev_url

pytestmark = [pytest.mark.anyio, pytest.mark.processes]


@pytest.fixture
def tmp_path() -> Iterator[Path]:
    """A fresh directory outside pytest's own: the embedded Postgres runs as another user when
    tests run as root, and pytest makes its base directory private (0700) at every session
    start, which would lock a running server out of its data."""
    path = Path(tempfile.mkdtemp(prefix="toren-dev-test-"))
    path.chmod(0o755)
    yield path
    for pid in postgres_running_in(path):  # a failed test's server: never left behind
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGQUIT)
    shutil.rmtree(path, ignore_errors=True)


def clean_env(home: Path, **extra: str) -> dict[str, str]:
    """This environment without Toren's or a provider's variables, HOME at ``home``."""
    drop = ("TOREN_", "ANTHROPIC_", "OPENAI_", "AWS_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    env.update({"HOME": str(home), "PYTHONPATH": str(ROOT), **extra})
    return env


def toren(home: Path, *args: str, **extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "toren", *args],
        env=clean_env(home, **extra),
        cwd=home,
        capture_output=True,
        text=True,
        timeout=90,
        check=False,
    )


class Dev:
    """A ``toren dev --port 0`` in its own session (so that a signal can go to its whole
    process group, as a terminal's Ctrl-C does), its output in files."""

    def __init__(self, home: Path, *args: str, **extra: str) -> None:
        home.mkdir(parents=True, exist_ok=True)
        self.home = home
        self.record_path = home / ".toren" / "database.json"
        self.data_dir = home / ".toren" / "pgdata"
        self._out = (home / "dev.out").open("w")
        self._err_path = home / "dev.err"
        self._err = self._err_path.open("w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "toren", "dev", "--port", "0", *args],
            env=clean_env(home, **extra),
            cwd=home,
            stdout=self._out,
            stderr=self._err,
            start_new_session=True,
        )
        self.pid = self.proc.pid

    @property
    def stderr(self) -> str:
        return self._err_path.read_text()

    def record(self) -> dict[str, object] | None:
        try:
            data: dict[str, object] = json.loads(self.record_path.read_text())
        except (OSError, ValueError):
            return None
        return data

    async def until_printed(self, text: str, timeout: float = 60) -> None:
        async def printed() -> bool:
            assert self.proc.poll() is None, f"exited {self.proc.returncode}:\n{self.stderr}"
            return text in self.stderr

        await wait_for(printed, timeout=timeout, what=f"{text!r} on stderr")

    async def until_up(self) -> dict[str, object]:
        async def recorded() -> dict[str, object] | None:
            assert self.proc.poll() is None, f"exited {self.proc.returncode}:\n{self.stderr}"
            record = self.record()
            return record if record and record["pid"] == self.pid else None

        record: dict[str, object] = await wait_for(recorded, timeout=90, what="the record")
        return record

    def interrupt(self, *, group: bool = False) -> None:
        if group:
            os.killpg(self.pid, signal.SIGINT)
        else:
            self.proc.send_signal(signal.SIGINT)

    async def exit_status(self) -> int:
        status = await anyio.to_thread.run_sync(lambda: self.proc.wait(60))
        self._out.close()
        self._err.close()
        return status

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._out.close()
        self._err.close()


def postgres_running_in(data_dir: Path) -> list[int]:
    """The pids of live (not zombie) processes whose command line names ``data_dir``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue  # gone meanwhile
        if str(data_dir) in cmdline:  # a zombie's command line is empty
            found.append(int(entry.name))
    return found


async def test_a_second_dev_says_where_the_first_runs_and_leaves_its_record(
    tmp_path: Path,
) -> None:
    first = Dev(tmp_path / "a", PATH="/usr/bin:/bin")  # as after `pip install`: no toren on PATH
    try:
        record = await first.until_up()
        await second_terminal_follows_the_banner(first)
        kept = first.record_path.read_bytes()
        assert first.record_path.stat().st_mode & 0o777 == 0o600  # a URL may hold a password
        assert recorded_dev_url(first.home / ".toren") == record["database_url"]
        assert record["data_dir"] == str(first.data_dir.resolve())
        api = str(record["api_url"])
        assert api.startswith("http://127.0.0.1:")

        # The same HOME: refused before anything starts, saying where the first one runs.
        second = await anyio.to_thread.run_sync(lambda: toren(first.home, "dev", "--port", "0"))
        assert second.returncode == 1, second.stderr
        assert f"pid {first.pid}" in second.stderr
        assert api in second.stderr
        assert "Demo run" not in second.stderr + second.stdout
        assert "Traceback" not in second.stderr

        # Another HOME on the same data: refused as well.
        other = tmp_path / "b"
        other.mkdir()
        shared = await anyio.to_thread.run_sync(
            lambda: toren(other, "dev", "--port", "0", "--data-dir", str(first.data_dir))
        )
        assert shared.returncode == 1, shared.stderr
        assert str(first.data_dir.resolve()) in shared.stderr
        assert not (other / ".toren" / "database.json").exists()

        # Another HOME, its own data, but the first one's port: it fails, recording nothing.
        port = api.rsplit(":", 1)[1]
        busy = await anyio.to_thread.run_sync(lambda: toren(other, "dev", "--port", port))
        assert busy.returncode == 2, busy.stderr
        assert f"cannot listen on 127.0.0.1:{port}" in busy.stderr
        assert "Traceback" not in busy.stderr
        assert not (other / ".toren" / "database.json").exists()
        assert postgres_running_in(other / ".toren" / "pgdata") == []

        assert first.record_path.read_bytes() == kept
        workers = await anyio.to_thread.run_sync(lambda: toren(first.home, "workers", "--json"))
        assert workers.returncode == 0, workers.stderr
        assert [w["pid"] for w in json.loads(workers.stdout)] == [first.pid]
    finally:
        first.stop()
    assert first.proc.returncode == 0, first.stderr
    assert not first.record_path.exists()  # ours, removed on a clean exit
    assert recorded_dev_url(first.home / ".toren") is None
    assert postgres_running_in(first.data_dir.resolve()) == []


async def second_terminal_follows_the_banner(dev: Dev) -> None:
    """The banner's commands are whole on their lines and work, as printed, in a terminal
    without toren on its PATH; no third-party log line came before or after."""
    await dev.until_printed("toren dev is running")
    [show] = re.findall(r"^  (.+ jobs show run/\S+) {2,}its timeline", dev.stderr, re.M)
    assert "Traceback" not in dev.stderr

    async def parked() -> bool:
        shown = await anyio.to_thread.run_sync(
            lambda: subprocess.run(
                shlex.split(show),
                env=clean_env(dev.home, PATH="/usr/bin:/bin"),
                cwd=dev.home,
                capture_output=True,
                text=True,
                timeout=60,
                check=False,
            )
        )
        assert shown.returncode == 0, shown.stderr
        return "approval requested for issue_refund" in shown.stdout

    await wait_for(parked, timeout=60, what="the demo run parked, seen from a second terminal")
    for noise in ("pgserver", "initdb", "XDG_RUNTIME_DIR", "HTTP Request", "httpx"):
        assert noise not in dev.stderr, dev.stderr


async def test_a_killed_devs_record_is_reported_stale_then_replaced_and_its_postgres_stopped(
    tmp_path: Path,
) -> None:
    home = tmp_path / "home"
    killed = Dev(home)
    try:
        await killed.until_up()
        os.kill(killed.pid, signal.SIGKILL)  # its embedded Postgres lives on, orphaned
        assert await killed.exit_status() == -signal.SIGKILL
    finally:
        killed.stop()
    data_dir = killed.data_dir.resolve()
    assert postgres_running_in(data_dir) != []
    assert killed.record() is not None

    stale = await anyio.to_thread.run_sync(lambda: toren(home, "workers"))
    assert stale.returncode == 2
    assert "no `toren dev` is running" in stale.stderr
    assert f"pid {killed.pid}) has exited" in stale.stderr
    assert "Traceback" not in stale.stderr

    dev = Dev(home)
    try:
        record = await dev.until_up()  # on the orphaned server, which it now owns
        assert record["pid"] == dev.pid
        workers = await anyio.to_thread.run_sync(lambda: toren(home, "workers", "--json"))
        assert workers.returncode == 0, workers.stderr
    finally:
        dev.stop()
    assert dev.proc.returncode == 0, dev.stderr
    assert not dev.record_path.exists()
    assert postgres_running_in(data_dir) == []  # the orphan too: its killed user was forgotten
    after = await anyio.to_thread.run_sync(lambda: toren(home, "workers"))
    assert after.returncode == 2
    assert "no `toren dev` is running" in after.stderr


def test_a_record_whose_pid_another_process_now_has_is_stale(tmp_path: Path) -> None:
    """After a reboot the recorded pid is soon some other process's: the record is stale all the
    same (no `toren dev` holds the home), not a database to connect to."""
    import fcntl

    home = tmp_path / ".toren"
    home.mkdir()
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        record = {"pid": other.pid, "database_url": "postgresql://u@127.0.0.1:1/gone"}
        (home / "database.json").write_text(json.dumps(record))
        (home / "dev.lock").write_text(str(other.pid))
        assert recorded_dev_url(home) is None
        stale = toren(tmp_path, "workers")
        assert stale.returncode == 2, stale.stderr
        assert f"(pid {other.pid}) has exited" in stale.stderr
        with (home / "dev.lock").open() as held:  # as a running `toren dev` holds it
            fcntl.flock(held, fcntl.LOCK_EX)
            assert recorded_dev_url(home) == record["database_url"]
            # Held by another (a `toren dev` starting, that has not recorded itself yet).
            (home / "dev.lock").write_text(str(os.getpid()))
            assert recorded_dev_url(home) is None
    finally:
        other.kill()
        other.wait()


async def test_a_data_dir_that_reads_as_markup_is_printed_as_text(tmp_path: Path) -> None:
    """A path is printed as it is: ``[/x]`` in one is not rich markup (it crashed toren dev)."""
    data = tmp_path / "[/x]"
    dev = Dev(tmp_path / "home", "--data-dir", str(data))
    try:
        record = await dev.until_up()
    finally:
        dev.stop()
    assert record["data_dir"] == str(data)
    assert f"starting embedded Postgres in {data} ..." in dev.stderr
    assert "Traceback" not in dev.stderr
    assert postgres_running_in(data) == []


async def test_dev_with_an_app_warns_of_missing_keys_then_says_it_runs(tmp_path: Path) -> None:
    dev = Dev(tmp_path / "home", "--app", "tests.run_app")
    try:
        await dev.until_up()
        await dev.until_printed("toren dev is running")
        log = dev.stderr
    finally:
        dev.stop()
    assert dev.proc.returncode == 0, dev.stderr
    assert "Agents: " in log
    assert "support (anthropic/claude-sonnet-4-6)" in log
    assert "run AGENT TEXT --wait" in log
    missing = "agent support uses anthropic/claude-sonnet-4-6, but ANTHROPIC_API_KEY is not set"
    assert log.count(missing) == 1
    assert log.index(missing) < log.index("toren dev is running")
    assert "Traceback" not in log


def test_only_agents_with_a_sandbox_have_toren_dev_ask_docker() -> None:
    """The demo and an app without sandboxes leave Docker alone (the demo's runs never asked it,
    yet every start did, with a long line when none answered); the coding agent needs it."""
    from examples.coding_agent import app as coding
    from examples.refund_approval import app as refunds
    from toren._cli.dev import _has_sandboxes

    assert not _has_sandboxes(None)  # the demo
    assert not _has_sandboxes(refunds)
    assert _has_sandboxes(coding)


def test_a_home_it_cannot_use_is_a_configuration_error(tmp_path: Path) -> None:
    taken = tmp_path / "a-file"
    taken.write_text("not a directory")
    result = toren(tmp_path, "dev", "--port", "0", TOREN_HOME=str(taken))
    assert result.returncode == 2, result.stderr
    assert f"toren dev cannot use {taken}" in result.stderr
    assert "TOREN_HOME" in result.stderr
    assert "Traceback" not in result.stderr


# Each moment: how to reach it (a line printed, or a kill point the process is frozen at), and
# whether the signal goes to the whole process group, as a terminal's Ctrl-C does.
MOMENTS = {
    "postgres starting": ("point", "dev.postgres_starting", False),
    "initdb running": ("printed", "starting embedded Postgres", True),
    "migrating": ("point", "dev.migrating", False),
    "API and worker starting": ("printed", "schema ready", True),
    "serving": ("printed", "toren dev is running", True),
}


@pytest.mark.parametrize("moment", list(MOMENTS))
async def test_ctrl_c_at_any_moment_stops_cleanly(tmp_path: Path, moment: str) -> None:
    how, where, group = MOMENTS[moment]
    points = tmp_path / "points"
    points.mkdir()
    extra = (
        {"TOREN_KILL_POINT": where, "TOREN_KILL_POINT_DIR": str(points)} if how == "point" else {}
    )
    dev = Dev(tmp_path / "home", **extra)
    try:
        if how == "point":

            async def frozen() -> bool:
                assert dev.proc.poll() is None, dev.stderr
                return (points / "hit").exists()

            await wait_for(frozen, timeout=60, what=f"kill point {where}")
            dev.interrupt(group=group)
            (points / "go").touch()
        else:
            await dev.until_printed(where)
            dev.interrupt(group=group)
        status = await dev.exit_status()
    finally:
        dev.stop()
    assert "Traceback" not in dev.stderr, dev.stderr
    assert postgres_running_in(dev.data_dir.resolve()) == [], dev.stderr
    assert not (dev.data_dir / "postmaster.pid").exists()
    assert not dev.record_path.exists()
    if moment == "serving":
        assert status == 0, dev.stderr
        assert "toren dev: stopped" in dev.stderr
    else:
        assert status == 130, dev.stderr
        assert "interrupted while starting" in dev.stderr


def test_a_demo_run_cancelled_on_an_earlier_start_is_not_said_to_park() -> None:
    """A demo run cancelled before this start (from another terminal or the console) has
    ended: the banner says so and offers a new run, not an approval it can no longer take."""
    from toren._cli.dev import _demo_next
    from toren.runs import RunFailed, RunStarted, RunState
    from toren.runs.state import fold

    state = RunState()
    for event in (
        RunStarted(agent="concierge", input="refund", at=1.0),
        RunFailed(error_class="cancelled", message="cancelled by ann"),
    ):
        state = fold(state, event)
    assert state.status == "cancelled"
    where, commands = _demo_next("run/x", state)
    assert where == "was cancelled (on an earlier start)"
    shown = " ".join(command for command, _ in commands)
    assert "jobs approve" not in shown
    assert "jobs tail" not in shown
    assert " run concierge " in shown  # a new demo run
