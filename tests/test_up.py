"""``toren up`` (migrations + worker + API in one process), ``/readyz``, and settings and
secrets read from files (``X_FILE``)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import anyio
import pytest

from tests.conftest import ROOT, wait_for
from toren import Client
from toren._core.errors import ConfigError
from toren._core.migrate import schema_status
from toren._core.secret_files import read_secret_files
from toren._surfaces.serve import serving
from toren._surfaces.tokens import create_token
from toren.demo import DEMO_INPUT, demo_model
from toren.runs import start_run
from toren.testing import AnthropicServer, ScriptedModel

pytestmark = pytest.mark.anyio

SECRET_KEY = "sk-from-a-file-7f3a9c"  # a model key: it must appear in no log line


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TOREN_", "ANTHROPIC_"))}
    env["PYTHONPATH"] = str(ROOT)
    env.update(extra)
    return env


def run_toren(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "toren", *args],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


async def get_json(url: str) -> tuple[int, dict[str, Any]]:
    async with aiohttp.ClientSession() as http, http.get(url) as r:
        return r.status, await r.json()


# --- toren up ------------------------------------------------------------------------------------


def test_up_without_a_database_url_exits_2_and_names_what_to_set(tmp_path: Path) -> None:
    done = run_toren("up", "--port", "0", env=clean_env(TOREN_HOME=str(tmp_path)))
    assert done.returncode == 2, done.stderr
    assert "TOREN_DATABASE_URL" in done.stderr
    assert "embedded" in done.stderr
    assert not (tmp_path / "pgdata").exists()  # no embedded Postgres was started


@pytest.fixture
async def model() -> AsyncIterator[AnthropicServer]:
    async with AnthropicServer(ScriptedModel(demo_model, name="toren.demo:demo_model")) as server:
        yield server


async def test_up_migrates_serves_readiness_runs_the_demo_and_drains_on_sigterm(
    empty_db_url: str, model: AnthropicServer, tmp_path: Path
) -> None:
    # The database URL and the model key come from files, as a container's secrets do.
    (tmp_path / "db").write_text(empty_db_url + "\n")
    (tmp_path / "key").write_text(SECRET_KEY + "\n")
    port = free_port()
    env = clean_env(
        TOREN_HOME=str(tmp_path / "home"),
        TOREN_DATABASE_URL_FILE=str(tmp_path / "db"),
        ANTHROPIC_API_KEY_FILE=str(tmp_path / "key"),
        ANTHROPIC_BASE_URL=model.base_url,
        TOREN_APP="toren.demo",
        TOREN_PORT=str(port),
        TOREN_SANDBOXES="false",
        TOREN_GRACE_SECONDS="10",
    )
    log_path = tmp_path / "up.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "toren", "--log-level", "DEBUG", "up"],
            env=env,
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    base = f"http://127.0.0.1:{port}"
    try:

        async def ready() -> dict[str, Any] | None:
            assert proc.poll() is None, log_path.read_text()
            try:
                status, body = await get_json(f"{base}/readyz")
            except aiohttp.ClientConnectionError:
                return None
            return body if status == 200 else None

        shown = await wait_for(ready, timeout=60, what="/readyz to answer 200")
        assert shown["worker"] == "running"
        assert shown["schema_version"] == shown["schema_latest"] > 0
        assert (await get_json(f"{base}/healthz"))[0] == 200
        async with await Client.connect(empty_db_url, pool_size=2) as c:
            current, latest = await schema_status(c.pool)
            assert current == latest  # toren up migrated the empty database
            _, token = await create_token(c.pool, "up-test", scopes=("read", "operate", "approve"))
            headers = {"Authorization": f"Bearer {token}"}
            async with aiohttp.ClientSession(headers=headers) as http:
                body = {"agent": "concierge", "input": DEMO_INPUT}
                async with http.post(f"{base}/runs", json=body) as r:
                    assert r.status == 201, await r.text()
                    run_id = (await r.json())["id"]
                path = f"{base}/runs/{run_id.removeprefix('run/')}"

                async def run_status(status: str) -> dict[str, Any] | None:
                    async with http.get(path) as r:
                        shown: dict[str, Any] = await r.json()
                    return shown if shown["status"] == status else None

                parked = await wait_for(lambda: run_status("parked"), what="the refund approval")
                [waiting] = parked["waiting_on"]
                decision = {"call_id": waiting["call_id"], "approved": True}
                async with http.post(f"{path}/approvals", json=decision) as r:
                    assert r.status == 200, await r.text()
                done = await wait_for(lambda: run_status("completed"), what="completion")
            assert "refund" in done["output"]
            assert DEMO_INPUT in str(model.requests[0]["messages"][0]["content"])
            auth = [
                v
                for r in model.received
                for k, v in r.headers.items()
                if k.lower() in ("x-api-key", "authorization")
            ]
            assert auth, "the model key was sent"
            assert all(SECRET_KEY in v for v in auth)  # the key came from its file
            pid_rows = await c.pool.fetchval(
                "SELECT count(*) FROM toren.workers WHERE pid = $1", proc.pid
            )
            assert pid_rows == 1
            proc.send_signal(signal.SIGTERM)
            code = await anyio.to_thread.run_sync(proc.wait, 30)
            assert code == 0, log_path.read_text()
            left = await c.pool.fetchval(
                "SELECT count(*) FROM toren.workers WHERE pid = $1", proc.pid
            )
            assert left == 0  # deregistered on the way out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    log_text = log_path.read_text()
    assert "draining" in log_text
    assert "read from files: ANTHROPIC_API_KEY, TOREN_DATABASE_URL" in log_text
    assert SECRET_KEY not in log_text
    assert "Traceback" not in log_text


def test_up_refuses_a_zero_it_is_given_as_worker_does() -> None:
    """`--grace-seconds 0` is an error (it was dropped as if not given: grace 30 s)."""
    env = clean_env(TOREN_DATABASE_URL="postgresql://u@127.0.0.1:1/x")
    for option in ("--grace-seconds", "--max-actors"):
        done = run_toren("up", option, "0", env=env)
        assert done.returncode == 2, done.stderr
        assert f"{option[2:].replace('-', '_')} must be a positive" in done.stderr


@pytest.mark.parametrize("command", ["up", "serve"])
async def test_a_host_that_reads_as_markup_is_said_to_be_one_it_cannot_listen_on(
    db_url: str, command: str
) -> None:
    """TOREN_HOST is printed in the warning about listening beyond loopback: as text."""
    env = clean_env(TOREN_DATABASE_URL=db_url, TOREN_HOST="[/x]", TOREN_PORT="0")
    done = await anyio.to_thread.run_sync(lambda: run_toren(command, env=env))
    assert "Traceback" not in done.stderr, done.stderr
    assert "listening on [/x]: anyone who can reach it" in done.stderr
    assert "error: cannot listen on [/x]" in done.stderr
    assert done.returncode == 2


# --- toren serve ---------------------------------------------------------------------------------


async def test_serve_stops_on_sigterm_telling_its_streams_and_writing_its_last_access_lines(
    db_url: str, tmp_path: Path
) -> None:
    # A container or a service manager stops toren serve with SIGTERM. An open event stream is
    # told why it ends, and its access line, kept until the server stops (a line is written a
    # tenth of a second after its request ends, or when the server stops), is written.
    async with await Client.connect(db_url, pool_size=2) as c:
        run_id = await start_run(c, "support", "hello")
        token_id, token = await create_token(c.pool, "serve-test", scopes=("read",))
    port = free_port()
    log_path = tmp_path / "serve.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "toren", "serve"],
            env=clean_env(TOREN_DATABASE_URL=db_url, TOREN_PORT=str(port)),
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    base = f"http://127.0.0.1:{port}"
    events = f"/runs/{run_id.removeprefix('run/')}/events"
    received = ""
    try:

        async def answering() -> bool:
            assert proc.poll() is None, log_path.read_text()
            try:
                return (await get_json(f"{base}/healthz"))[0] == 200
            except aiohttp.ClientConnectionError:
                return False

        await wait_for(answering, timeout=60, what="toren serve to answer")
        headers = {"Authorization": f"Bearer {token}", "Accept": "text/event-stream"}
        async with aiohttp.ClientSession(headers=headers) as http, http.get(base + events) as r:
            assert r.status == 200, await r.text()  # the stream is open
            proc.send_signal(signal.SIGTERM)
            with anyio.fail_after(30), contextlib.suppress(aiohttp.ClientPayloadError):
                async for line in r.content:  # until the server ends the stream
                    received += line.decode()
        code = await anyio.to_thread.run_sync(proc.wait, 30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    text = log_path.read_text()
    assert code == 0, text
    assert "event: toren.closed" in received, received
    assert 'data: {"reason":"stopping"}' in received, received
    assert f"GET {events} 200 127.0.0.1 token:{token_id} " in text, text
    assert "Traceback" not in text


# --- /readyz -------------------------------------------------------------------------------------


async def test_readyz_is_503_with_a_reason_until_the_schema_is_migrated(
    empty_db_url: str,
) -> None:
    async with serving(empty_db_url, port=0) as base:
        status, body = await get_json(f"{base}/readyz")
        assert status == 503
        assert body["ready"] is False
        assert "migrations not applied" in body["reason"]
        assert body["worker"] is None  # toren serve runs no worker


async def test_readyz_follows_the_worker_this_process_runs(db_url: str) -> None:
    states: list[tuple[uuid.UUID | None, str]] = [(None, "starting")]
    async with serving(db_url, port=0, worker=lambda: states[-1]) as base:
        status, body = await get_json(f"{base}/readyz")
        assert (status, body["worker"], body["reason"]) == (
            503,
            "starting",
            "this process's worker is starting",
        )
        states.append((uuid.uuid4(), "running"))  # running, but no such row in toren.workers
        status, body = await get_json(f"{base}/readyz")
        assert (status, body["reason"]) == (503, "this process's worker is not registered")
        async with await Client.connect(db_url, pool_size=1) as c:
            worker_id = uuid.uuid4()
            await c.pool.execute(
                "INSERT INTO toren.workers (worker_id, lock_key, name, version, host, pid) "
                "VALUES ($1, 0, 'readyz-test', 'v', 'h', 1)",
                worker_id,
            )
        states.append((worker_id, "running"))
        status, body = await get_json(f"{base}/readyz")
        assert (status, body["ready"], body["reason"]) == (200, True, None)
        states.append((None, "draining"))
        status, body = await get_json(f"{base}/readyz")
        assert (status, body["reason"]) == (503, "this process's worker is draining")
        status, _ = await get_json(f"{base}/healthz")
        assert status == 200  # alive all along: readiness is a separate question


async def test_readyz_probes_at_once_share_one_database_check(db_url: str) -> None:
    """Anyone may ask /readyz: a flood of probes must not take every pooled connection the API
    needs. With the schema table locked (each check waits on it), at most one waits."""
    blocked = (
        "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
        "AND query LIKE '%schema_migrations%' AND pid <> pg_backend_pid()"
    )
    async with (
        await Client.connect(db_url, pool_size=2) as c,
        serving(db_url, port=0) as base,
        aiohttp.ClientSession() as http,
    ):
        seen: list[int] = []
        answered: list[int] = []

        async def probe() -> None:
            async with http.get(f"{base}/readyz") as r:
                answered.append(r.status)

        async with c.pool.acquire() as locker, locker.transaction():
            await locker.execute("LOCK TABLE toren.schema_migrations IN ACCESS EXCLUSIVE MODE")
            async with anyio.create_task_group() as tg:
                for _ in range(12):
                    tg.start_soon(probe)

                async def waiting() -> bool:
                    seen.append(await c.pool.fetchval(blocked))
                    return len(answered) == 12

                await wait_for(waiting, what="every probe answered", timeout=60)
        assert set(answered) == {503}  # the database did not answer in time
        assert max(seen) == 1, seen
        status, body = await get_json(f"{base}/readyz")  # the table free again: checked anew
        assert (status, body["ready"]) == (200, True)


# --- X_FILE --------------------------------------------------------------------------------------


def test_a_file_gives_its_variable_its_content_without_the_trailing_newline(
    tmp_path: Path,
) -> None:
    (tmp_path / "url").write_text("postgresql://u:p@db/toren\n")
    (tmp_path / "key").write_text("sk-abc\r\n")
    (tmp_path / "bot").write_text("123:tok\n")
    env = {
        "TOREN_DATABASE_URL_FILE": str(tmp_path / "url"),
        "OPENAI_API_KEY_FILE": str(tmp_path / "key"),
        "SUPPORT_BOT_TOKEN_FILE": str(tmp_path / "bot"),
        "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent/credentials",  # a path in its own right
        "LOG_FILE": "/nonexistent/log",  # not a setting or a secret: left alone
    }
    assert read_secret_files(env) == ["OPENAI_API_KEY", "SUPPORT_BOT_TOKEN", "TOREN_DATABASE_URL"]
    assert env["TOREN_DATABASE_URL"] == "postgresql://u:p@db/toren"
    assert env["OPENAI_API_KEY"] == "sk-abc"
    assert env["SUPPORT_BOT_TOKEN"] == "123:tok"
    assert "AWS_SHARED_CREDENTIALS" not in env
    assert "LOG" not in env


def test_a_file_saved_with_a_byte_order_mark_gives_the_value_without_it(tmp_path: Path) -> None:
    """Windows editors save UTF-8 with a BOM; in a key it would fail every request's header."""
    (tmp_path / "key").write_bytes(b"\xef\xbb\xbfsk-ant-bom\r\n")
    env = {"ANTHROPIC_API_KEY_FILE": str(tmp_path / "key")}
    read_secret_files(env)
    assert env["ANTHROPIC_API_KEY"] == "sk-ant-bom"


def test_a_variable_an_agent_names_is_read_from_its_file(tmp_path: Path) -> None:
    (tmp_path / "t").write_text("42:abc")
    env = {"HELPDESK_BOT_FILE": str(tmp_path / "t")}  # no secret-like ending: named by an agent
    assert read_secret_files(env) == []
    assert read_secret_files(env, names=["HELPDESK_BOT"]) == ["HELPDESK_BOT"]
    assert env["HELPDESK_BOT"] == "42:abc"


def test_an_empty_file_variable_is_unset_and_another_programs_never_stops_toren(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Compose's ``${VAR:-}`` gives ``X_FILE=``: unset, not an error. A variable covered only by
    its ending may be another program's (a path it reads itself): unreadable, it is warned about
    and left unset; one of Toren's own names is still refused."""
    env = {
        "ANTHROPIC_API_KEY_FILE": "",
        "AZURE_FEDERATED_TOKEN_FILE": "/nonexistent/token",  # a path in its own right
        "DEPLOY_SIGNING_KEY_FILE": "/nonexistent/signing.pem",
    }
    with caplog.at_level("WARNING", logger="toren.secrets"):
        assert read_secret_files(env) == []
    assert "ANTHROPIC_API_KEY" not in env
    assert "DEPLOY_SIGNING_KEY" not in env
    assert "AZURE_FEDERATED_TOKEN" not in env
    assert "DEPLOY_SIGNING_KEY_FILE: cannot read" in caplog.text
    assert "AZURE" not in caplog.text
    with pytest.raises(ConfigError, match="TOREN_DATABASE_URL_FILE: cannot read"):
        read_secret_files({"TOREN_DATABASE_URL_FILE": "/nonexistent/url"})


def test_a_variable_given_both_ways_is_refused(tmp_path: Path) -> None:
    (tmp_path / "key").write_text("from-file")
    env = {"ANTHROPIC_API_KEY": "inline", "ANTHROPIC_API_KEY_FILE": str(tmp_path / "key")}
    with pytest.raises(ConfigError, match="both ANTHROPIC_API_KEY and ANTHROPIC_API_KEY_FILE"):
        read_secret_files(env)
    assert env["ANTHROPIC_API_KEY"] == "inline"


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        (None, "cannot read"),
        (b"", "is empty"),
        (b"\n", "is empty"),
        (b"\xff\xfeZQ7", "not UTF-8"),
        (b"ZQ7" * 30000, "larger than 64 KiB"),
    ],
)
def test_a_bad_file_is_refused_naming_the_variable_never_the_content(
    tmp_path: Path, content: bytes | None, expected: str
) -> None:
    path = tmp_path / "secret"
    if content is not None:
        path.write_bytes(content)
    (tmp_path / "fine").write_text("fine-value")
    env = {"TOREN_DATABASE_URL_FILE": str(path), "OPENAI_API_KEY_FILE": str(tmp_path / "fine")}
    with pytest.raises(ConfigError) as raised:
        read_secret_files(env)
    message = str(raised.value)
    assert expected in message
    assert "TOREN_DATABASE_URL_FILE" in message
    assert "ZQ7" not in message  # the content is never shown
    assert "OPENAI_API_KEY" not in env  # nothing is set when one file fails


def test_a_pipe_nobody_writes_to_is_refused_not_waited_on_forever(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    env = clean_env(TOREN_DATABASE_URL_FILE=str(fifo))
    done = subprocess.run(  # before the fix: blocked in open() until killed
        [sys.executable, "-m", "toren", "workers"],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert done.returncode == 2, done.stderr
    assert f"TOREN_DATABASE_URL_FILE: nothing came from {str(fifo)!r} within 5 s" in done.stderr


def test_a_pipe_with_a_writer_is_read_to_its_end() -> None:
    """``X_FILE=<(pass show db)``: a shell's process substitution is a pipe, read as a file."""
    read_end, write_end = os.pipe()
    try:
        os.write(write_end, b"from-a-pipe\n")
        os.close(write_end)
        env = {"OPENAI_API_KEY_FILE": f"/dev/fd/{read_end}"}
        assert read_secret_files(env) == ["OPENAI_API_KEY"]
        assert env["OPENAI_API_KEY"] == "from-a-pipe"
    finally:
        os.close(read_end)


def test_a_directory_or_an_endless_device_is_refused(tmp_path: Path) -> None:
    for path, says in ((tmp_path, "cannot read"), (Path("/dev/zero"), "larger than 64 KiB")):
        with pytest.raises(ConfigError, match=says):
            read_secret_files({"OPENAI_API_KEY_FILE": str(path)})


def test_the_cli_reads_files_at_boot_and_a_bad_one_exits_2(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    done = run_toren("workers", env=clean_env(TOREN_DATABASE_URL_FILE=str(missing)))
    assert done.returncode == 2
    assert f"TOREN_DATABASE_URL_FILE: cannot read '{missing}'" in done.stderr


@pytest.mark.parametrize(
    "url",
    [
        "postgres ql://u:ZQ7pw@127.0.0.1:1/x",  # a typo: it does not parse as a URL
        "postgresql://u:ZQ7pw@127.0.0.1:port/x",  # a port that is not a number
        "postgresql://u:ZQ7pw@[::1/x",  # a broken IPv6 address
        "postgresql://u@127.0.0.1:1/x?password=ZQ7pw",  # libpq's query parameter
        "postgresql://u:a@127.0.0.1:1/x?sslpassword=ZQ7pw",
        "host=127.0.0.1 port=1 password=ZQ7pw",  # a key/value string: not a URL
    ],
)
def test_a_bad_database_url_from_a_file_is_an_error_that_never_shows_its_password(
    tmp_path: Path, url: str
) -> None:
    (tmp_path / "url").write_text(url)
    done = run_toren("workers", env=clean_env(TOREN_DATABASE_URL_FILE=str(tmp_path / "url")))
    assert done.returncode in (1, 2), done.stderr
    assert "Traceback" not in done.stderr
    assert "cannot reach Postgres" in done.stderr
    assert "ZQ7" not in done.stderr


def test_the_log_level_is_read_from_its_file_too(tmp_path: Path) -> None:
    """Every TOREN_* setting can come from a file, the log level too (though --log-level is
    parsed before files are read)."""
    (tmp_path / "level").write_text("debug\n")
    (tmp_path / "junk").write_text("LOUD\n")
    (tmp_path / "url").write_text("postgresql://u@127.0.0.1:1/x")
    url = {"TOREN_DATABASE_URL_FILE": str(tmp_path / "url")}
    done = run_toren("workers", env=clean_env(TOREN_LOG_LEVEL_FILE=str(tmp_path / "level"), **url))
    assert " DEBUG " in done.stderr, done.stderr
    chosen = run_toren(
        "--log-level",
        "WARNING",
        "workers",
        env=clean_env(TOREN_LOG_LEVEL_FILE=str(tmp_path / "level"), **url),
    )
    assert " DEBUG " not in chosen.stderr  # the flag wins
    assert " INFO " not in chosen.stderr
    junk = run_toren("workers", env=clean_env(TOREN_LOG_LEVEL_FILE=str(tmp_path / "junk")))
    assert junk.returncode == 2
    assert "TOREN_LOG_LEVEL_FILE does not hold a log level" in junk.stderr
    assert "LOUD" not in junk.stderr


def test_the_variables_an_apps_channels_read_are_the_ones_read_from_files() -> None:
    from tests import telegram_app
    from toren._cli.boot import channel_variables

    names = channel_variables(telegram_app)
    assert {telegram_app.TOKEN_ENV, telegram_app.BRIEF_TOKEN_ENV} <= set(names)
    assert "TELEGRAM_WEBHOOK_SECRET" in names  # the default webhook_secret_env
