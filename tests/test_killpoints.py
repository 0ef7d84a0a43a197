"""Kill points: disarmed they do nothing; armed, the process stops there until told to go."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import asyncpg
import orjson
import pytest

from tests import app
from tests.conftest import running_worker, wait_for
from toren import Client
from toren._core import killpoints as kp

pytestmark = pytest.mark.anyio


@pytest.fixture
def disarm_after() -> object:
    yield
    kp.arm({})


def test_disarmed_points_return_at_once() -> None:
    kp.arm({})
    start = time.perf_counter()
    for _ in range(100_000):
        kp.kill_point("step.committing")
    assert time.perf_counter() - start < 0.5


@pytest.mark.usefixtures("disarm_after")
def test_arming_validates_its_environment(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="name#k"):
        kp.arm({"TOREN_KILL_POINT": "step.committing#0", "TOREN_KILL_POINT_DIR": str(tmp_path)})
    with pytest.raises(ValueError, match="TOREN_KILL_POINT_DIR"):
        kp.arm({"TOREN_KILL_POINT": "step.committing"})


@pytest.mark.usefixtures("disarm_after")
def test_a_trace_records_every_point_reached(tmp_path: Path) -> None:
    trace = tmp_path / "trace"
    kp.arm({"TOREN_KILL_POINT_TRACE": str(trace)})
    kp.kill_point("actor.claimed")
    kp.kill_points_for("committed:", ["model.called", "model.called", "tool.intent"])
    assert trace.read_text().split() == [
        "actor.claimed",
        "committed:model.called",
        "committed:tool.intent",
    ]


@pytest.mark.usefixtures("disarm_after")
def test_an_armed_point_blocks_at_its_occurrence_until_go(tmp_path: Path) -> None:
    kp.arm({"TOREN_KILL_POINT": "x#2", "TOREN_KILL_POINT_DIR": str(tmp_path)})
    kp.kill_point("x")  # the first occurrence passes
    assert not (tmp_path / "hit").exists()
    threading.Timer(0.3, (tmp_path / "go").touch).start()
    start = time.monotonic()
    kp.kill_point("x")
    assert time.monotonic() - start >= 0.25
    assert orjson.loads((tmp_path / "hit").read_bytes())["point"] == "x"


@pytest.mark.usefixtures("disarm_after")
async def test_a_commit_cut_by_a_dropped_connection_is_made_again_without_the_handler(
    client: Client, db_url: str, tmp_path: Path
) -> None:
    """The step's connections are terminated while it waits to commit: the same step is
    committed again on a new connection; the handler does not run a second time."""
    kp.arm({"TOREN_KILL_POINT": "step.committing#1", "TOREN_KILL_POINT_DIR": str(tmp_path)})

    def terminate_then_go() -> None:
        while not (tmp_path / "hit").exists():
            time.sleep(0.005)

        async def terminate() -> None:
            conn = await asyncpg.connect(db_url)
            try:
                await conn.execute(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                    "WHERE datname = current_database() AND application_name = 'toren-worker'"
                )
            finally:
                await conn.close()

        asyncio.run(terminate())
        (tmp_path / "go").touch()

    helper = threading.Thread(target=terminate_then_go)
    helper.start()
    app.Counter.handled = 0
    await client.spawn(app.Counter, "c/k")
    await client.send("c/k", app.Add(n=1, tag="a"))
    async with running_worker(db_url):

        async def journaled() -> bool:
            return len(await client.journal("c/k")) == 1

        await wait_for(journaled, what="the step committed")
    helper.join(5)
    assert app.Counter.handled == 1
    assert await client.pool.fetchval("SELECT count(*) FROM toren.mailbox") == 0


def test_the_worker_refuses_a_malformed_kill_point(tmp_path: Path) -> None:
    import os
    import subprocess
    import sys

    from tests.conftest import ROOT

    env = dict(os.environ, TOREN_KILL_POINT="step.committing#zero", PYTHONPATH=str(ROOT))
    env["TOREN_KILL_POINT_DIR"] = str(tmp_path)
    done = subprocess.run(
        [sys.executable, "-m", "toren", "worker"],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert "TOREN_KILL_POINT" in done.stderr
