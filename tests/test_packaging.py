"""Packaging (issue 11): Toren's ``actors`` and ``supervisors`` are importable only as
``toren.actors`` and ``toren.supervisors``, so a user app with top-level packages of those names
loads, both in the editable install and from a wheel built from the repository."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import zipfile
from importlib.metadata import distribution, requires
from pathlib import Path
from typing import Any

import anyio
import pytest

from tests.conftest import ROOT, wait_for
from toren import Client

APP_FILES = {
    "actors/__init__.py": '"""The app\'s own actors."""\nOWNER = "app"\n',
    "actors/greeting.py": 'GREETING = "You greet people."\n',
    "supervisors/__init__.py": '"""The app\'s own supervisors."""\nOWNER = "app"\n',
    "myapp.py": '''"""A user's app whose own top-level packages are named like Toren's internals."""

import actors
import supervisors
from actors.greeting import GREETING

from toren import Agent

assert actors.OWNER == supervisors.OWNER == "app"

greeter = Agent(name="greeter", model="anthropic/claude-sonnet-4-6", system=GREETING)
''',
}

# Run in the app's directory by the Python under test; prints what resolved where, as JSON.
# "toren-first" imports Toren's worker tree before the app, "app-first" after it: either way
# round, neither may take the other's modules.
PROBE = """
import json, sys

import toren
from toren._agent.registry import served_routes
from toren._agent.app import load_app  # the loader `toren worker --app` uses


def internals():
    import toren.actors.runs
    import toren.supervisors.worker

    return toren.actors.runs, toren.supervisors.worker


if sys.argv[1] == "toren-first":
    run, worker = internals()
app = load_app("myapp")
if sys.argv[1] == "app-first":
    run, worker = internals()

import actors
import supervisors

print(json.dumps({
    "toren": toren.__file__,
    "run": run.__file__,
    "worker": worker.__file__,
    "actors": actors.__file__,
    "supervisors": supervisors.__file__,
    "app_uses_them": app.actors is actors and app.supervisors is supervisors,
    "routes": served_routes(),
    "top_level": sorted(
        m for m in sys.modules if m.partition(".")[0] in ("actors", "supervisors")
    ),
}))
"""


def clean_env(**extra: str) -> dict[str, str]:
    """The environment without anything that would put the repository on ``sys.path``."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("TOREN_", "PYTHON", "PIP_")) and k != "VIRTUAL_ENV"
    }
    env.update(PYTHONNOUSERSITE="1", PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_NO_INPUT="1")
    env.update(extra)
    return env


def run(*args: str | Path, cwd: Path, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(
        [str(a) for a in args],
        cwd=cwd,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    command = " ".join(str(a) if len(str(a)) < 200 else "<script>" for a in args)
    assert result.returncode == 0, f"{command} failed:\n{result.stdout}\n{result.stderr}"
    return result


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A wheel built from the repository, as a user's ``pip install`` would get it."""
    out = tmp_path_factory.mktemp("wheel")
    before = {p.name for p in ROOT.iterdir()}
    run(
        sys.executable,
        *("-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index"),
        *("--no-cache-dir", "--wheel-dir", out, ROOT),
        cwd=out,
    )
    after = {p.name for p in ROOT.iterdir()}
    assert not {n for n in after - before if n in ("build", "dist") or n.endswith(".egg-info")}
    [built] = out.glob("toren-*.whl")
    return built


@pytest.fixture(scope="module")
def installed(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh virtualenv with only the wheel installed; Toren's dependencies come from this
    interpreter's site-packages, named by a plain path line (whose own ``.pth`` files, such as
    the editable install's, are not processed: the repository stays off ``sys.path``)."""
    venv = tmp_path_factory.mktemp("venv")
    run(sys.executable, "-m", "venv", "--without-pip", venv, cwd=venv)
    python = venv / "bin" / "python"
    run(
        sys.executable,
        *("-m", "pip", "--python", python, "install", "--no-deps", "--no-index"),
        *("--no-cache-dir", "--quiet", wheel),
        cwd=venv,
    )
    site = run(python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))", cwd=venv)
    (Path(site.stdout.strip()) / "toren_test_dependencies.pth").write_text(
        "".join(f"{d}\n" for d in dependency_dirs())
    )
    return venv


def dependency_dirs() -> list[str]:
    """The directories Toren's installed dependencies live in (this virtualenv's
    site-packages, as a rule)."""
    names = [
        re.match(r"[A-Za-z0-9._-]+", r)[0] for r in requires("toren") or [] if "extra" not in r
    ]
    return sorted({str(distribution(name).locate_file("")) for name in names})


@pytest.fixture(scope="module")
def user_app(tmp_path_factory: pytest.TempPathFactory) -> Path:
    app = tmp_path_factory.mktemp("user_app")
    for name, text in APP_FILES.items():
        (app / name).parent.mkdir(exist_ok=True)
        (app / name).write_text(text)
    return app


def probe(python: Path | str, app: Path, order: str) -> dict[str, Any]:
    result = run(python, "-c", PROBE, order, cwd=app)
    found: dict[str, Any] = json.loads(result.stdout.splitlines()[-1])
    return found


def assert_each_package_is_its_owners(found: dict[str, Any], toren_dir: Path, app: Path) -> None:
    assert found["toren"] == str(toren_dir / "__init__.py")
    assert found["run"] == str(toren_dir / "actors" / "runs" / "__init__.py")
    assert found["worker"] == str(toren_dir / "supervisors" / "worker" / "__init__.py")
    assert found["actors"] == str(app / "actors" / "__init__.py")
    assert found["supervisors"] == str(app / "supervisors" / "__init__.py")
    assert found["app_uses_them"]
    # The agent's route, and its version's (agent:NAME@VERSION: see docs/versioning.md).
    assert found["routes"][0] == "agent:greeter", found["routes"]
    assert [r.split("@")[0] for r in found["routes"]] == ["agent:greeter"] * 2
    # Nothing of Toren's was imported under a top-level name.
    assert found["top_level"] == ["actors", "actors.greeting", "supervisors"]


def test_wheel_ships_actors_and_supervisors_only_under_toren(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    assert "toren/actors/runs/__init__.py" in names
    assert "toren/supervisors/worker/hosts.py" in names
    assert "toren/supervisors/worker/tree.py" in names
    assert "toren/_core/migrations/0001_kernel.sql" in names
    dist_info = "-".join(wheel.name.split("-")[:2]) + ".dist-info"
    assert {n.split("/")[0] for n in names} == {"toren", dist_info}  # no actors/, supervisors/


@pytest.mark.parametrize("order", ["app-first", "toren-first"])
def test_an_app_with_its_own_actors_and_supervisors_loads_from_the_wheel(
    installed: Path, user_app: Path, order: str
) -> None:
    found = probe(installed / "bin" / "python", user_app, order)
    # The wheel's Toren, not the repository's (which would hide a packaging mistake).
    assert found["toren"].startswith(str(installed) + os.sep)
    assert_each_package_is_its_owners(found, Path(found["toren"]).parent, user_app)


@pytest.mark.parametrize("order", ["app-first", "toren-first"])
def test_an_app_with_its_own_actors_and_supervisors_loads_in_the_editable_install(
    user_app: Path, order: str
) -> None:
    # The interpreter running the tests has the repository installed in editable mode.
    found = probe(sys.executable, user_app, order)
    assert_each_package_is_its_owners(found, ROOT / "toren", user_app)


@pytest.mark.anyio
async def test_the_installed_toren_worker_runs_an_app_with_its_own_actors_and_supervisors(
    installed: Path, user_app: Path, client: Client, db_url: str, tmp_path: Path
) -> None:
    log_path = tmp_path / "worker.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [installed / "bin" / "toren", "--log-level", "DEBUG", "worker", "--app", "myapp"],
            cwd=user_app,
            env=clean_env(
                TOREN_DATABASE_URL=db_url,
                TOREN_LEASE_SECONDS="3",
                TOREN_RENEW_SECONDS="0.5",
                TOREN_POLL_SECONDS="0.2",
                TOREN_GRACE_SECONDS="5",
                TOREN_SANDBOXES="false",  # its routes are its agents only
            ),
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:

        async def serving_the_apps_agent() -> bool:
            if proc.poll() is not None:
                raise AssertionError(
                    f"worker exited with {proc.returncode}:\n{log_path.read_text()}"
                )
            stats = await client.pool.fetchval(
                "SELECT stats FROM toren.workers WHERE pid = $1", proc.pid
            )
            routes = (stats or {}).get("routes") or []
            return [r.split("@")[0] for r in routes] == ["agent:greeter"] * 2

        await wait_for(serving_the_apps_agent, timeout=30, what="the worker to register")
        proc.send_signal(signal.SIGTERM)
        with anyio.fail_after(20):
            code = await anyio.to_thread.run_sync(proc.wait, 20)
        assert code == 0, log_path.read_text()
        assert (
            await client.pool.fetchval(
                "SELECT count(*) FROM toren.workers WHERE pid = $1", proc.pid
            )
            == 0
        )
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
