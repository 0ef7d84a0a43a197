"""``toren init NAME``: the app it writes passes its own test, answers under ``toren dev
--model-script`` from a clean HOME, and bad names or a non-empty directory are refused."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import ROOT

NAME = "shopdesk"
NO_CACHE = ("-p", "no:cacheprovider")


def clean_env(home: Path) -> dict[str, str]:
    """The environment of a new user: no TOREN_ or provider settings, a fresh HOME."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("TOREN_", "ANTHROPIC_", "OPENAI_", "AWS_", "PYTEST_"))
    }
    env.update({"HOME": str(home), "PYTHONPATH": str(ROOT)})
    return env


def toren(*args: str, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "toren", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@pytest.fixture
def project(tmp_path: Path) -> Path:
    """A directory where ``toren init shopdesk`` ran; returns the app's directory."""
    result = toren("init", NAME, cwd=tmp_path, env=clean_env(tmp_path / "home"))
    assert result.returncode == 0, result.stderr
    assert f"toren dev --app {NAME}.app --model-script {NAME}.model:script" in result.stdout
    return tmp_path / NAME


@pytest.fixture
def in_checkout(tmp_path: Path) -> Path:
    """Where the quickstart runs ``toren init``: a checkout's root, whose pytest settings
    (pyproject.toml, conftest.py) apply to the app's test too; returns the app's directory."""
    for name in ("pyproject.toml", "conftest.py"):
        if (ROOT / name).exists():
            shutil.copy(ROOT / name, tmp_path / name)
    result = toren("init", NAME, cwd=tmp_path, env=clean_env(tmp_path / "home"))
    assert result.returncode == 0, result.stderr
    assert "pip install pytest" in result.stdout  # what the "Next:" lines ask for, no more
    return tmp_path / NAME


def test_init_writes_an_app_whose_own_test_passes_with_only_pytest_installed(
    in_checkout: Path, tmp_path: Path
) -> None:
    """Run as its README says, in a checkout, with pytest but not pytest-timeout (which only
    Toren's own test dependencies bring): ``-p no:timeout`` leaves the installed one out."""
    project = in_checkout
    assert sorted(str(p.relative_to(project)) for p in project.rglob("*") if p.is_file()) == [
        "README.md",
        "conftest.py",
        f"{NAME}/__init__.py",
        f"{NAME}/app.py",
        f"{NAME}/model.py",
        f"tests/test_{NAME}.py",
        "toren.toml",
    ]
    readme = (project / "README.md").read_text()
    assert f"toren dev --app {NAME}.app --model-script {NAME}.model:script" in readme
    result = subprocess.run(
        [str(Path(sys.executable).parent / "pytest"), "-q", *NO_CACHE, "-p", "no:timeout"],
        cwd=project,
        env=clean_env(tmp_path / "home"),
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "2 passed" in result.stdout


def test_the_model_script_answers_a_message_sent_after_the_answer(project: Path) -> None:
    """A run that answered takes more messages (toren jobs send): the script passes the next
    one on as it did the task (it failed the run with a ValueError)."""
    from toren.testing import Message, ModelRequest, Text, ToolCall, ToolResult

    namespace: dict[str, object] = {}
    exec((project / NAME / "model.py").read_text(), namespace)
    script = namespace["script"]
    task = Message(role="user", content=(Text(text="Release is out."),))
    sent = ToolCall(id="send-1", name="send_message", arguments={"to": "team", "text": "x"})
    later = (
        task,
        Message(role="assistant", content=(sent,)),
        Message(role="user", content=(ToolResult(tool_call_id="send-1", content="sent"),)),
        Message(role="assistant", content=(Text(text="Done: sent."),)),
        Message(role="user", content=(Text(text="And the notes are up."),)),
    )
    reply = script(ModelRequest(model="m", system="", messages=later))  # type: ignore[operator]
    [call] = [b for b in reply.content if isinstance(b, ToolCall)]
    assert call.arguments == {"to": "team", "text": "And the notes are up."}
    assert call.id == "send-3"  # not the first call's id


def test_dev_runs_the_new_app_offline_and_a_second_terminal_drives_a_run(
    project: Path, tmp_path: Path
) -> None:
    env = clean_env(tmp_path / "home")
    log_path = tmp_path / "dev.log"
    with log_path.open("w") as log:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "toren",
                "dev",
                "--app",
                f"{NAME}.app",
                "--model-script",
                f"{NAME}.model:script",
                "--port",
                str(free_port()),
            ],
            cwd=project,
            env=env,
            stdout=log,
            stderr=log,
        )
        try:
            deadline = time.monotonic() + 90
            while "OFFLINE model" not in log_path.read_text():
                assert proc.poll() is None, log_path.read_text()
                assert time.monotonic() < deadline, log_path.read_text()
                time.sleep(0.2)
            banner = log_path.read_text()
            assert f"scripted by {NAME}.model:script" in banner
            # Receipts show dollars: the banner says what they are, and that nothing is paid.
            assert "nothing is paid: the script's token counts are made up" in banner
            started = toren("run", NAME, "Tell the team the release is out.", cwd=project, env=env)
            assert started.returncode == 0, started.stderr
            run_id = re.search(r"run/[0-9a-f-]{36}", started.stdout + started.stderr)
            assert run_id is not None, started
            status = ""
            while status != "parked":
                assert time.monotonic() < deadline, status
                shown = toren("jobs", "show", run_id[0], "--json", cwd=project, env=env)
                status = json.loads(shown.stdout)["status"] if shown.returncode == 0 else ""
                time.sleep(0.2)
            approved = toren("jobs", "approve", run_id[0], cwd=project, env=env)
            assert approved.returncode == 0, approved.stderr
            while (
                record := json.loads(
                    toren("jobs", "show", run_id[0], "--json", cwd=project, env=env).stdout
                )
            )["status"] != "completed":
                assert time.monotonic() < deadline, record
                time.sleep(0.2)
            assert record["output"] == "Done: sent to team."
            assert "ANTHROPIC_API_KEY" not in log_path.read_text()  # no missing-key warning
        finally:
            proc.send_signal(signal.SIGINT)
            proc.wait(30)
    assert proc.returncode == 0, log_path.read_text()


@pytest.mark.parametrize(
    ("name", "needle"),
    [
        ("my-app", "is not a Python identifier"),
        ("class", "is not a Python identifier"),
        ("json", "is already a Python module"),
        ("toren", "is already a Python module"),
        ("../up", "is not a Python identifier"),
        ("café", "is not a Python identifier"),  # [agents.café] is not TOML
        ("\uff21\uff22\uff23", "is not a Python identifier"),  # full-width: imported as ABC
        ("conftest", "a name the app's own files take"),
    ],
)
def test_init_refuses_a_name_that_cannot_be_a_package(
    name: str, needle: str, tmp_path: Path
) -> None:
    result = toren("init", name, cwd=tmp_path, env=clean_env(tmp_path / "home"))
    assert result.returncode == 2
    assert needle in result.stderr
    assert not (tmp_path / name).exists()


def test_init_never_writes_into_a_non_empty_directory(tmp_path: Path) -> None:
    (tmp_path / NAME).mkdir()
    (tmp_path / NAME / "notes.txt").write_text("mine")
    result = toren("init", NAME, cwd=tmp_path, env=clean_env(tmp_path / "home"))
    assert result.returncode == 2
    assert "already exists and is not an empty directory" in result.stderr
    assert [p.name for p in (tmp_path / NAME).iterdir()] == ["notes.txt"]
    assert (tmp_path / NAME / "notes.txt").read_text() == "mine"


@pytest.mark.parametrize("dangling", [False, True])
def test_init_never_writes_through_a_symbolic_link(tmp_path: Path, dangling: bool) -> None:
    elsewhere = tmp_path / "elsewhere"
    if not dangling:
        elsewhere.mkdir()
    (tmp_path / "work").mkdir()
    (tmp_path / "work" / NAME).symlink_to(elsewhere)
    result = toren("init", NAME, cwd=tmp_path / "work", env=clean_env(tmp_path / "home"))
    assert result.returncode == 2, result.stderr
    assert "already exists and is not an empty directory" in result.stderr
    assert "Traceback" not in result.stderr
    assert not dangling or not elsewhere.exists()
    assert dangling or not any(elsewhere.iterdir())
