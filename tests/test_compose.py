"""The image and the compose files, as a user runs them: docker/compose.yaml (Postgres and one
``toren up`` container) and docker/compose.cluster.yaml (Postgres, three workers, one API).

Nothing can be pulled here, so each base file is used with its override in docker/test/: a
Postgres built from Debian's package (scripts/postgres-image) instead of postgres:16, and every
service in the host's network namespace on 127.0.0.1 and free ports (traffic stays on loopback).
Host networking cannot publish ports, so the test runs the merged configuration
(``docker-compose config``) without the base files' ``ports``. The model is a scripted Anthropic
server in this process; the containers reach it through ANTHROPIC_BASE_URL, and their secrets
(database URL, model key, Postgres password) come from files through ``*_FILE`` variables.

Needs Docker and docker-compose (skipped with the reason without them; failed under CI=true).
The images are built first (scripts/toren-image --debian-base, scripts/postgres-image): seconds
when cached, a few minutes the first time.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import anyio
import pytest
import yaml

from tests.conftest import ROOT, wait_for
from tests.sandbox_support import unavailable
from toren import Client
from toren.demo import DEMO_INPUT, demo_model
from toren.testing import AnthropicServer, ScriptedModel

# A first build of the images takes minutes (CI builds them before the tests).
pytestmark = [pytest.mark.anyio, pytest.mark.processes, pytest.mark.timeout(900)]

DOCKER = ROOT / "docker"
TOREN_IMAGE = "toren:latest"
POSTGRES_IMAGE = "toren/test-postgres:15"
PASSWORD = "compose-test-pw"
MODEL_KEY = "sk-compose-test-key"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@pytest.fixture(scope="module")
def images() -> None:
    """Docker and docker-compose answer, and both images are built from this tree."""
    if shutil.which("docker-compose") is None:
        unavailable("docker-compose is not installed (apt-get install docker-compose)", "compose")
    if subprocess.run(["docker", "version"], capture_output=True, check=False).returncode != 0:
        unavailable("no Docker daemon answers (`docker version` failed)", "compose")
    for script in (["scripts/postgres-image"], ["scripts/toren-image", "--debian-base"]):
        started = time.monotonic()
        print(f"compose test: {' '.join(script)} (seconds when cached; minutes the first time)")
        done = subprocess.run(
            script, cwd=ROOT, capture_output=True, text=True, timeout=900, check=False
        )
        if done.returncode != 0:
            pytest.fail(f"{script[0]} failed:\n{done.stdout}\n{done.stderr}", pytrace=False)
        print(f"compose test: {script[0]} done in {time.monotonic() - started:.0f}s")


class Stack:
    """One compose project: a base file from docker/ with its override from docker/test/."""

    def __init__(self, base: str, tmp_path: Path, model_url: str) -> None:
        self.project = f"toren-test-{uuid.uuid4().hex[:8]}"
        self.pg_port, self.api_port = free_port(), free_port()
        self.api = f"http://127.0.0.1:{self.api_port}"
        self.database_url = f"postgresql://toren:{PASSWORD}@127.0.0.1:{self.pg_port}/toren"
        secrets = tmp_path / "secrets"
        secrets.mkdir()
        for name, value in (
            ("postgres_password", PASSWORD),
            ("database_url", self.database_url),
            ("anthropic_api_key", MODEL_KEY),
        ):
            (secrets / name).write_text(value + "\n")
            (secrets / name).chmod(0o644)  # the containers' users are not this one
        self.env = dict(
            os.environ,
            TOREN_IMAGE=TOREN_IMAGE,
            TOREN_TEST_POSTGRES_IMAGE=POSTGRES_IMAGE,
            TOREN_TEST_PG_PORT=str(self.pg_port),
            TOREN_TEST_API_PORT=str(self.api_port),
            TOREN_TEST_MODEL_URL=model_url,
            TOREN_TEST_SECRETS=str(secrets),
        )
        self.files = [DOCKER / base, DOCKER / "test" / base]
        self.merged = tmp_path / "compose.merged.yaml"

    async def compose(self, *args: str, check: bool = True) -> str:
        done = await anyio.run_process(
            ["docker-compose", "-p", self.project, "-f", str(self.merged), *args],
            env=self.env,
            check=False,
        )
        output = done.stdout.decode(errors="replace") + done.stderr.decode(errors="replace")
        if check and done.returncode != 0:
            raise AssertionError(f"docker-compose {' '.join(args)} failed:\n{output}")
        return output

    async def up(self) -> None:
        files = [arg for f in self.files for arg in ("-f", str(f))]
        done = await anyio.run_process(
            ["docker-compose", "-p", self.project, *files, "config"], env=self.env
        )
        config = yaml.safe_load(done.stdout)
        for service in config["services"].values():
            assert service["network_mode"] == "host", service  # every service on loopback
            service.pop("ports", None)  # meaningless (and refused) in the host's namespace
        self.merged.write_text(yaml.safe_dump(config))
        await self.compose("up", "-d", "--no-build")

    async def down(self) -> None:
        await self.compose("down", "-v", "--remove-orphans", "-t", "5", check=False)

    async def container(self, service: str) -> str:
        return (await self.compose("ps", "-q", service)).strip()

    async def state(self, service: str) -> tuple[str, int]:
        done = await anyio.run_process(
            [
                "docker",
                "inspect",
                "-f",
                "{{.State.Status}} {{.State.ExitCode}}",
                await self.container(service),
            ]
        )
        status, code = done.stdout.decode().split()
        return status, int(code)

    async def logs(self, service: str = "") -> str:
        return await self.compose("logs", "--no-color", *([service] if service else []))

    async def wait_ready(self, timeout: float = 180) -> dict[str, Any]:
        async def ready() -> dict[str, Any] | None:
            try:
                async with aiohttp.ClientSession() as http, http.get(f"{self.api}/readyz") as r:
                    body: dict[str, Any] = await r.json()
                    return body if r.status == 200 else None
            except aiohttp.ClientError:
                return None

        try:
            return await wait_for(ready, timeout=timeout, interval=0.5, what="/readyz 200")
        except AssertionError:
            raise AssertionError(await self.logs()) from None

    def token(self) -> str:
        """A token made with the CLI against the stack's database, as docs/api.md says."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("TOREN_")}
        env.update(TOREN_DATABASE_URL=self.database_url, PYTHONPATH=str(ROOT))
        name, scopes = f"ops-{self.project}", "read,operate,approve"
        done = subprocess.run(
            [sys.executable, "-m", "toren", "tokens", "create", name, "--scope", scopes],
            env=env,
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        return done.stdout.strip()


@contextlib.asynccontextmanager
async def stack(base: str, tmp_path: Path, model: AnthropicServer) -> AsyncIterator[Stack]:
    s = Stack(base, tmp_path, model.base_url)
    try:
        await s.up()
        yield s
    except BaseException:
        with anyio.CancelScope(shield=True):
            print(await s.logs())  # shown with the failure
        raise
    finally:
        with anyio.CancelScope(shield=True):
            await s.down()


@contextlib.asynccontextmanager
async def demo_model_server() -> AsyncIterator[AnthropicServer]:
    async with AnthropicServer(ScriptedModel(demo_model, name="toren.demo:demo_model")) as model:
        yield model


class Api:
    """The stack's HTTP API with a token."""

    def __init__(self, http: aiohttp.ClientSession, base: str) -> None:
        self.http, self.base = http, base

    async def start_demo(self) -> str:
        body = {"agent": "concierge", "input": DEMO_INPUT}
        async with self.http.post(f"{self.base}/runs", json=body) as r:
            assert r.status == 201, await r.text()
            run_id: str = (await r.json())["id"]
            return run_id

    async def run(self, run_id: str) -> dict[str, Any]:
        async with self.http.get(f"{self.base}/runs/{run_id.removeprefix('run/')}") as r:
            assert r.status == 200, await r.text()
            body: dict[str, Any] = await r.json()
            return body

    async def wait_status(self, run_id: str, status: str, timeout: float = 60) -> dict[str, Any]:
        async def reached() -> dict[str, Any] | None:
            shown = await self.run(run_id)
            assert shown["status"] != "failed", shown
            return shown if shown["status"] == status else None

        result: dict[str, Any] = await wait_for(reached, timeout=timeout, what=status)
        return result

    async def health(self) -> dict[str, Any]:
        async with self.http.get(f"{self.base}/healthz") as r:
            assert r.status == 200, await r.text()
            body: dict[str, Any] = await r.json()
            return body

    async def approve_waiting(self, run_id: str) -> None:
        [waiting] = (await self.run(run_id))["waiting_on"]
        body = {"call_id": waiting["call_id"], "approved": True, "reason": "compose test"}
        path = f"{self.base}/runs/{run_id.removeprefix('run/')}/approvals"
        async with self.http.post(path, json=body) as r:
            assert r.status == 200, await r.text()


@contextlib.asynccontextmanager
async def api(s: Stack) -> AsyncIterator[Api]:
    token = await anyio.to_thread.run_sync(s.token)
    headers = {"Authorization": f"Bearer {token}"}
    async with aiohttp.ClientSession(headers=headers) as http:
        yield Api(http, s.api)


async def test_the_single_container_migrates_serves_and_runs_the_demo_to_completion(
    images: None, tmp_path: Path
) -> None:
    async with demo_model_server() as model, stack("compose.yaml", tmp_path, model) as s:
        ready = await s.wait_ready()
        assert ready["worker"] == "running"
        assert ready["schema_version"] == ready["schema_latest"]
        status, _ = await s.state("toren")
        assert status == "running"
        async with api(s) as http:
            run_id = await http.start_demo()
            await http.wait_status(run_id, "parked")
            await http.approve_waiting(run_id)
            done = await http.wait_status(run_id, "completed")
        assert "refund" in done["output"]
        assert done["receipt"]["calls_made"] == len(model.received) == 3
        # The model key reached the SDK from its secret file.
        sent = {v for r in model.received for k, v in r.headers.items() if k.lower() == "x-api-key"}
        sent |= {
            v.removeprefix("Bearer ")
            for r in model.received
            for k, v in r.headers.items()
            if k.lower() == "authorization"
        }
        assert MODEL_KEY in sent
        # Docker's own health check (python's urllib against /readyz) agrees.
        container = await s.container("toren")

        async def healthy() -> bool:
            done = await anyio.run_process(
                ["docker", "inspect", "-f", "{{.State.Health.Status}}", container]
            )
            return done.stdout.decode().strip() == "healthy"

        await wait_for(healthy, timeout=60, interval=1, what="the container's health check")
        logs = await s.logs("toren")
        assert MODEL_KEY not in logs
        assert PASSWORD not in logs


async def owner(client: Client, run_id: str) -> str | None:
    name: str | None = await client.pool.fetchval(
        "SELECT w.name FROM toren.actors a JOIN toren.workers w ON w.worker_id = a.owner "
        "WHERE a.actor_id = $1",
        run_id,
    )
    return name


async def test_the_cluster_finishes_a_run_on_another_worker_after_sigterm_and_sigkill(
    images: None, tmp_path: Path
) -> None:
    async with demo_model_server() as model, stack("compose.cluster.yaml", tmp_path, model) as s:
        ready = await s.wait_ready()
        assert ready["worker"] is None  # the API server runs no worker
        async with await Client.connect(s.database_url, pool_size=2) as db, api(s) as http:

            async def three_workers() -> bool:
                names = await db.pool.fetch("SELECT name FROM toren.workers")
                return sorted(r["name"] for r in names) == ["worker-1", "worker-2", "worker-3"]

            await wait_for(three_workers, timeout=120, interval=0.5, what="three live workers")

            # SIGTERM while the first model call is in flight: the worker finishes it, releases
            # the run and exits 0; another worker takes the run on.
            first = model.hold(1)
            run_id = await http.start_demo()
            with anyio.fail_after(60):
                await first.arrived.wait()
            drained = await wait_for(lambda: owner(db, run_id), what="the run's owner")
            await s.compose("kill", "-s", "SIGTERM", drained)

            async def draining() -> bool:
                return "draining" in await s.logs(drained)

            await wait_for(draining, timeout=30, interval=0.2, what=f"{drained} draining")
            first.release()

            async def exited(service: str) -> tuple[str, int] | None:
                state = await s.state(service)
                return state if state[0] == "exited" else None

            state = await wait_for(lambda: exited(drained), timeout=60, what=f"{drained} exit")
            assert state == ("exited", 0), await s.logs(drained)
            await http.wait_status(run_id, "parked")
            assert len(model.received) == 2  # the call in hand was finished, not made again

            # SIGKILL while the last model call is in flight: the call is made again, once, by
            # a worker still alive.
            third = model.hold(3)
            await http.approve_waiting(run_id)
            with anyio.fail_after(60):
                await third.arrived.wait()
            killed = await wait_for(lambda: owner(db, run_id), what="the run's owner")
            assert killed != drained
            await s.compose("kill", "-s", "SIGKILL", killed)
            state = await wait_for(lambda: exited(killed), timeout=60, what=f"{killed} exit")
            assert state == ("exited", 137)
            third.release()
            done = await http.wait_status(run_id, "completed", timeout=90)
            assert "refund" in done["output"]
            assert len(model.received) == 4  # the call lost with the killed worker, once more
            health = await http.health()
            alive = {w["name"] for w in health["workers"]}
            assert alive == {"worker-1", "worker-2", "worker-3"} - {drained, killed}


def test_the_secrets_directory_the_compose_file_names_is_never_committed() -> None:
    """docker/compose.yaml tells users to put their database password and model key in
    docker/secrets/, inside their checkout: `git add .` must not pick them up."""
    assert "./secrets/database_url" in (DOCKER / "compose.yaml").read_text()
    for name in ("database_url", "anthropic_api_key", "postgres_password"):
        done = subprocess.run(
            ["git", "check-ignore", "-q", f"docker/secrets/{name}"], cwd=ROOT, check=False
        )
        assert done.returncode == 0, f"docker/secrets/{name} is not ignored by git"


def test_every_toren_container_runs_without_privileges_to_gain() -> None:
    """The image runs as uid 10001; its base has setuid binaries: the compose files let no
    Toren process gain privileges through them, nor hold any capability."""
    for name in ("compose.yaml", "compose.cluster.yaml"):
        services = yaml.safe_load((DOCKER / name).read_text())["services"]
        toren = {k: v for k, v in services.items() if k != "postgres"}
        assert toren, name
        for service, spec in toren.items():
            assert spec.get("security_opt") == ["no-new-privileges:true"], (name, service)
            assert spec.get("cap_drop") == ["ALL"], (name, service)


def test_every_published_port_binds_loopback_only() -> None:
    """The API is plain HTTP: published on every interface it would take bearer tokens and
    session cookies in clear from the network. The compose files bind it to 127.0.0.1; reaching
    it from elsewhere goes through a reverse proxy that terminates TLS (docs/operations.md)."""
    published = []
    for path in sorted(DOCKER.glob("compose*.yaml")):
        for service, spec in yaml.safe_load(path.read_text())["services"].items():
            for port in spec.get("ports", []):
                published.append((path.name, service))
                if isinstance(port, dict):  # the long syntax
                    host_ip = port.get("host_ip", "")
                else:  # HOST_IP:HOST_PORT:CONTAINER_PORT; without HOST_IP, every interface
                    parts = str(port).split(":")
                    host_ip = parts[0] if len(parts) == 3 else ""
                assert host_ip == "127.0.0.1", (path.name, service, port)
    assert ("compose.yaml", "toren") in published
    assert ("compose.cluster.yaml", "api") in published


async def test_two_image_builds_at_once_take_turns(images: None, tmp_path: Path) -> None:
    """scripts/toren-image empties and refills docker/wheels/: a second one at the same time
    waits for the first instead of building from its half-copied wheels."""
    import fcntl

    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "toren"
    out = tmp_path / "out"
    with (cache / "toren-image.lock").open("w") as held:  # as a first build holds it
        fcntl.flock(held, fcntl.LOCK_EX)
        with out.open("w") as sink:
            second = subprocess.Popen(
                ["scripts/toren-image", "--debian-base"], cwd=ROOT, stdout=sink, stderr=sink
            )
        try:

            async def waiting() -> bool:
                assert second.poll() is None, out.read_text()
                return "waiting for another scripts/toren-image" in out.read_text()

            await wait_for(waiting, timeout=60, what="the second build waiting its turn")
            assert "building" not in out.read_text()
        except BaseException:
            second.kill()
            raise
    status = await anyio.to_thread.run_sync(lambda: second.wait(600))
    assert status == 0, out.read_text()
    assert "built toren:latest" in out.read_text()
