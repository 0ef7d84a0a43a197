"""Escape attempts against a hardened sandbox, on the real Docker daemon.

Each attack asserts the specific cause that stops it (an errno, an OOM kill, a kill at the time
limit, the truncation) and has a control run: the same attempt with only the protection in
question loosened (through ``create``'s test-only ``overrides`` or a larger limit) succeeds, so
the test shows the protection is what stops it. Limits and attacks are sized so that neither the
attack nor its control can exhaust the machine: the attack sits between the hardened limit and
the control's bounded one. Network tests use only loopback: a listener on the host's 127.0.0.1,
and for the control the host's network namespace (never a bridge or any other address).

Then the Docker layer's own behaviour: recovering and killing commands after their caller went
away, paths confined to the workspace, the workspace out and in as tar, and the hardened
container as Docker reports it.
"""

from __future__ import annotations

import hashlib
import io
import os
import secrets
import tarfile
import time
from pathlib import Path
from typing import Any

import aiodocker
import anyio
import anyio.abc
import pytest

from tests.conftest import wait_for
from tests.sandbox_support import (  # noqa: F401  (the fixtures)
    committed,
    docker_fixture,
    raw_docker_fixture,
    sandbox,
)
from toren.actors.sandboxes.docker import (
    DEFAULT_IMAGE,
    LABEL_MANAGED,
    LABEL_RUN,
    Docker,
    Unavailable,
    UnsafeImage,
)
from toren.actors.sandboxes.hardening import WORKSPACE, Limits
from toren.actors.sandboxes.outcomes import ExecFailed, MarkerUsed, Outcome, PathRefused

pytestmark = pytest.mark.anyio

MiB = 1024 * 1024
# Counts the sleeps commands started ("sleep N"), not the container's own "sleep infinity"; the
# pattern does not match its own command line.
SLEEPS = "pgrep -c -f '^sleep [0-9]+$'"
_count = iter(range(1_000_000))

# Attack programs report failures as "error ERRNO_NAME strerror" so tests assert the errno.
REPORT = """
import errno, os, sys

def report(e):
    print("error", errno.errorcode[e.errno], e.strerror, flush=True)
"""


async def sh(
    docker: Docker,
    container: str,
    command: str,
    *,
    timeout: float = 60,
    grace: float = 2,
    cap: int = MiB,
) -> Outcome:
    """Run ``command`` in the sandbox with a fresh marker."""
    marker = f"t{next(_count)}"
    return await docker.run(
        container,
        marker=marker,
        command=command,
        timeout=timeout,
        kill_grace=grace,
        output_cap=cap,
    )


async def program(docker: Docker, container: str, name: str, source: str) -> None:
    await docker.write_file(container, name, (REPORT + source).encode())


# -- escape attempts ------------------------------------------------------------------------------

CONNECT = """
import socket
try:
    with socket.create_connection(("127.0.0.1", int(sys.argv[1])), timeout=5) as s:
        print("connected:", s.recv(100).decode().strip(), flush=True)
except OSError as e:
    report(e)
"""


async def test_network_out_is_refused_and_the_hosts_listener_sees_no_connection(
    docker: Docker,
) -> None:
    """Network ``none``: the only interface is the container's own loopback, so 127.0.0.1 is not
    the host's and the connect is refused. Control: the host's network reaches the listener."""
    seen: list[str] = []

    async def greet(stream: anyio.abc.SocketStream) -> None:
        async with stream:
            seen.append(str(stream.extra(anyio.abc.SocketAttribute.remote_address)))
            await stream.send(b"hello from the host\n")

    listener = await anyio.create_tcp_listener(local_host="127.0.0.1")
    port = listener.extra(anyio.abc.SocketAttribute.local_port)
    async with listener, anyio.create_task_group() as group:
        group.start_soon(listener.serve, greet)
        command = f"ls /sys/class/net; python3 connect.py {port}"

        async with sandbox(docker) as container:
            await program(docker, container, "connect.py", CONNECT)
            attack = await sh(docker, container, command)
        assert attack.output == "lo\nerror ECONNREFUSED Connection refused\n"
        assert seen == []

        async with sandbox(docker, Limits(network="host")) as container:
            await program(docker, container, "connect.py", CONNECT)
            control = await sh(docker, container, command)
        assert "connected: hello from the host" in control.output
        assert len(seen) == 1
        group.cancel_scope.cancel()


async def test_writing_to_the_root_filesystem_fails_read_only(docker: Docker) -> None:
    """/var/tmp is world-writable in the image: only the read-only root stops the write (and
    writing to / itself fails read-only before its permissions are even looked at). Control: the
    same container with a writable root writes /var/tmp."""
    command = "touch /escape; touch /var/tmp/escape && echo written"

    async with sandbox(docker) as container:
        attack = await sh(docker, container, command)
    assert attack.output == (
        "touch: cannot touch '/escape': Read-only file system\n"
        "touch: cannot touch '/var/tmp/escape': Read-only file system\n"
    )
    assert attack.exit_code == 1

    writable = {"HostConfig": {"ReadonlyRootfs": False}}
    async with sandbox(docker, overrides=writable) as container:
        control = await sh(docker, container, command)
    assert control.output == "touch: cannot touch '/escape': Permission denied\nwritten\n"


SETUID = """
print("euid", os.geteuid(), flush=True)
try:
    os.setuid(0)
    print("setuid(0) worked", flush=True)
except OSError as e:
    report(e)
try:
    with open("/etc/shadow") as f:
        print("read /etc/shadow:", f.readline().split(":")[0], flush=True)
except OSError as e:
    report(e)
"""


async def test_a_setuid_root_program_gives_no_privileges(docker: Docker) -> None:
    """The default image has no setuid program; this test adds one (a setuid-root copy of
    python3). Under no-new-privileges it runs as the sandbox user: setuid(0) fails EPERM and
    /etc/shadow EACCES. Control: without no-new-privileges (capabilities still all dropped) the
    same program is root and reads /etc/shadow."""
    prepare = (
        "cp /usr/bin/python3.11 /usr/local/bin/suid-python && chmod 4755 /usr/local/bin/suid-python"
    )
    command = "stat -c '%a %U' /usr/local/bin/suid-python; suid-python setuid.py"
    async with committed(docker, as_root=prepare, changes=["USER 1000:1000"]) as image:
        async with sandbox(docker, image=image) as container:
            await program(docker, container, "setuid.py", SETUID)
            attack = await sh(docker, container, command)
        assert attack.output == (
            "4755 root\neuid 1000\n"
            "error EPERM Operation not permitted\nerror EACCES Permission denied\n"
        )

        privileges: dict[str, Any] = {"HostConfig": {"SecurityOpt": []}}
        async with sandbox(docker, image=image, overrides=privileges) as container:
            await program(docker, container, "setuid.py", SETUID)
            control = await sh(docker, container, command)
        assert control.output == "4755 root\neuid 0\nsetuid(0) worked\nread /etc/shadow: root\n"


SPAWN = """
made = 0
try:
    for made in range(1, int(sys.argv[1]) + 1):
        os.posix_spawn("/bin/sleep", ["sleep", "60"], os.environ)
    print("made", made, flush=True)
except OSError as e:
    print("made", made - 1, flush=True)
    report(e)
"""


async def test_a_fork_bomb_stops_at_the_pid_limit(docker: Docker) -> None:
    """600 processes against a limit of 256: fork fails EAGAIN. Control: with 2,048 they are
    all made. What a command leaves running is killed when it ends, so neither lingers."""
    command = "python3 spawn.py 600"
    async with sandbox(docker, Limits(pids=256)) as container:
        await program(docker, container, "spawn.py", SPAWN)
        attack = await sh(docker, container, command)
        left = await sh(docker, container, SLEEPS)
    made, error = attack.output.splitlines()
    assert error == "error EAGAIN Resource temporarily unavailable"
    assert 200 < int(made.split()[1]) < 256
    assert left.output == "0\n"

    async with sandbox(docker, Limits(pids=2048)) as container:
        await program(docker, container, "spawn.py", SPAWN)
        control = await sh(docker, container, command)
    assert control.output == "made 600\n"


ALLOCATE = """
chunks = []
for n in range(int(sys.argv[1]) // 8):
    chunks.append(bytes([1]) * (8 << 20))  # written, so really resident
print("allocated", len(chunks) * 8, "MiB", flush=True)
"""


async def test_a_memory_bomb_is_oom_killed(docker: Docker) -> None:
    """600 MiB against 512 MiB without swap: the kernel kills it (exit 137, an OOM kill counted
    by the container's memory cgroup). Control: with 1 GiB it allocates all of it."""
    command = "python3 allocate.py 600"
    async with sandbox(docker, Limits(memory_bytes=512 * MiB)) as container:
        await program(docker, container, "allocate.py", ALLOCATE)
        attack = await sh(docker, container, command)
    assert attack.oom_killed
    assert attack.exit_code == 137
    assert not attack.timed_out
    assert "allocated" not in attack.output

    async with sandbox(docker, Limits(memory_bytes=1024 * MiB)) as container:
        await program(docker, container, "allocate.py", ALLOCATE)
        control = await sh(docker, container, command)
    assert control.output == "allocated 600 MiB\n"
    assert (control.exit_code, control.oom_killed) == (0, False)


FILL = """
written = 0
try:
    with open("fill", "wb") as f:
        for _ in range(int(sys.argv[1])):
            f.write(bytes(1 << 20))
            f.flush()
            written += 1
    print("wrote", written, "MiB", flush=True)
except OSError as e:
    report(e)
"""


async def test_filling_the_workspace_fails_no_space(docker: Docker) -> None:
    """100 MiB into a 32 MiB workspace: ENOSPC. Control: a 256 MiB workspace takes it all."""
    command = "python3 fill.py 100"
    async with sandbox(docker, Limits(workspace_bytes=32 * MiB)) as container:
        await program(docker, container, "fill.py", FILL)
        attack = await sh(docker, container, command)
        _, size = await docker.read_file(container, "fill", 0)
    assert attack.output == "error ENOSPC No space left on device\n"
    assert 24 * MiB < size <= 32 * MiB

    async with sandbox(docker, Limits(workspace_bytes=256 * MiB)) as container:
        await program(docker, container, "fill.py", FILL)
        control = await sh(docker, container, command)
    assert control.output == "wrote 100 MiB\n"


async def test_host_files_are_not_visible(docker: Docker, tmp_path: Path) -> None:
    """A file the test writes on the host is not in the sandbox (its /tmp is its own). Control:
    bind-mounting that path, which the hardened create never does, makes it readable."""
    token = secrets.token_hex(16)
    secret = tmp_path / "host-secret.txt"
    secret.write_text(token + "\n")
    secret.chmod(0o644)
    command = f"cat {secret}"

    async with sandbox(docker) as container:
        attack = await sh(docker, container, command)
    assert attack.output == f"cat: {secret}: No such file or directory\n"

    bind = {"HostConfig": {"Binds": [f"{secret}:{secret}:ro"]}}
    async with sandbox(docker, overrides=bind) as container:
        control = await sh(docker, container, command)
    assert control.output == token + "\n"


async def test_the_workers_environment_is_not_visible(
    docker: Docker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A secret in the worker's environment is neither in a command's environment nor in the
    container's first process's. Control: a container given that variable shows it in both."""
    token = secrets.token_hex(16)
    monkeypatch.setenv("TOREN_TEST_SECRET", token)
    command = "env; tr '\\0' '\\n' </proc/1/environ"

    async with sandbox(docker) as container:
        attack = await sh(docker, container, command)
    assert attack.exit_code == 0
    assert "HOME=/tmp" in attack.output  # both environments were read
    assert token not in attack.output
    assert [line for line in attack.output.splitlines() if line.startswith("TOREN_")] == [
        line for line in attack.output.splitlines() if line.startswith("TOREN_COMMAND=")
    ]

    leaked = {"Env": ["HOME=/tmp", f"TOREN_TEST_SECRET={os.environ['TOREN_TEST_SECRET']}"]}
    async with sandbox(docker, overrides=leaked) as container:
        control = await sh(docker, container, command)
    assert control.output.count(f"TOREN_TEST_SECRET={token}") == 2


async def test_a_never_ending_command_is_killed_at_the_time_limit(docker: Docker) -> None:
    """A command that ignores SIGTERM and never ends: TERM at 1 s, KILL 1 s later (exit 137,
    timed out), nothing of it left running; the call returns within limit + grace + a margin
    for a loaded machine. Control: the same command ending by itself within a longer limit."""
    command = "trap '' TERM; echo started; sleep {}; echo ended"
    async with sandbox(docker) as container:
        started = time.monotonic()
        attack = await sh(docker, container, command.format(3600), timeout=1, grace=1)
        elapsed = time.monotonic() - started
        left = await sh(docker, container, SLEEPS)
        control = await sh(docker, container, command.format(2), timeout=30, grace=1)
    assert attack.timed_out
    assert (attack.exit_code, attack.output) == (137, "started\n")
    assert 1.9 < elapsed < 1 + 1 + 10
    assert left.output == "0\n"
    assert (control.exit_code, control.timed_out, control.output) == (0, False, "started\nended\n")


WRITE = """
line = b"0123456789abcde\\n"
for _ in range(int(sys.argv[1])):
    sys.stdout.buffer.write(line * 65536)  # 1 MiB
sys.stdout.buffer.flush()
"""


async def test_a_hundred_megabytes_of_output_is_capped_and_counted(docker: Docker) -> None:
    """100 MiB of output against a 1 MiB cap: 1 MiB kept, every byte counted, the truncation
    visible, and the writer never stopped by a closed pipe (exit 0). Control: a 128 MiB cap
    (with a /tmp large enough to hold the record) keeps all of it. Bounded: the test holds at
    most a few hundred MiB while it checks the control."""
    command = "python3 write.py 100"
    async with sandbox(docker) as container:
        await program(docker, container, "write.py", WRITE)
        attack = await sh(docker, container, command, cap=MiB)
    assert attack.exit_code == 0
    assert attack.output_bytes == 100 * MiB
    assert len(attack.output) == MiB
    assert attack.truncated
    assert attack.output == "0123456789abcde\n" * 65536

    async with sandbox(docker, Limits(tmp_bytes=192 * MiB, records_bytes=192 * MiB)) as container:
        await program(docker, container, "write.py", WRITE)
        control = await sh(docker, container, command, cap=128 * MiB)
    assert (control.exit_code, control.output_bytes, control.truncated) == (0, 100 * MiB, False)
    assert (
        hashlib.sha256(control.output.encode()).digest()
        == hashlib.sha256(b"0123456789abcde\n" * 65536 * 100).digest()
    )


# -- commands after their caller went away --------------------------------------------------------


async def _start_and_drop(docker: Docker, container: str, marker: str, command: str) -> None:
    """Start ``command`` and drop the exec stream once it has written ``ready`` (as a worker
    that dies does): the command goes on running in the container."""
    async with anyio.create_task_group() as group:
        group.start_soon(_run_quietly, docker, container, marker, command)
        await wait_for(lambda: _exists(docker, container, f"ready-{marker}"), what=marker)
        group.cancel_scope.cancel()


async def _run_quietly(docker: Docker, container: str, marker: str, command: str) -> None:
    await docker.run(container, marker=marker, command=command, timeout=600, output_cap=MiB)


async def _exists(docker: Docker, container: str, path: str) -> bool:
    return any(entry[0] == path for entry in await docker.list_files(container, ""))


async def test_recover_kills_a_command_left_running_and_returns_its_partial_output(
    docker: Docker,
) -> None:
    async with sandbox(docker) as container:
        await _start_and_drop(
            docker, container, "long", "echo before; touch ready-long; sleep 300; echo after"
        )
        running = await sh(docker, container, SLEEPS)
        assert running.output == "1\n"

        outcome = await docker.recover(container, "long")
        left = await sh(docker, container, f"{SLEEPS}; pgrep -c -f 'toren run lon[g] '")

    assert outcome == Outcome(
        state="interrupted", exit_code=None, output="before\n", output_bytes=7
    )
    assert left.output == "0\n0\n"


async def test_recover_reports_a_finished_command_and_knows_no_unknown_one(
    docker: Docker,
) -> None:
    async with sandbox(docker) as container:
        ran = await docker.run(
            container, marker="done", command="echo done; exit 7", timeout=10, output_cap=100
        )
        recovered = await docker.recover(container, "done")
        unknown = await docker.recover(container, "never")
        for bad in ("", "a.b", "../x", "x" * 129):
            with pytest.raises(ValueError, match="a marker is"):
                await docker.recover(container, bad)
        with pytest.raises(MarkerUsed):
            await docker.run(
                container, marker="done", command="echo again", timeout=10, output_cap=100
            )
        await docker.forget(container, "done")
        forgotten = await docker.recover(container, "done")
        # The record goes, the marker stays used: a worker that stalled past its lease and
        # wakes up cannot run it a second time.
        with pytest.raises(MarkerUsed):
            await docker.run(
                container, marker="done", command="echo again", timeout=10, output_cap=100
            )

    assert (
        recovered == ran == Outcome(state="finished", exit_code=7, output="done\n", output_bytes=5)
    )
    assert unknown == Outcome(state="not_started", exit_code=None, output="", output_bytes=0)
    assert forgotten == Outcome(state="interrupted", exit_code=None, output="", output_bytes=0)


async def test_kill_all_kills_every_command_left_running(docker: Docker) -> None:
    async with sandbox(docker) as container:
        for marker in ("one", "two"):
            await _start_and_drop(
                docker, container, marker, f"touch ready-{marker}; sleep 300 & sleep 301"
            )
        assert (await sh(docker, container, SLEEPS)).output == "4\n"

        killed = await docker.kill_all(container)
        left = await sh(docker, container, SLEEPS)
        states = [(await docker.recover(container, m)).state for m in ("one", "two")]

    assert killed >= 4  # the sleeps, and each command's wrapper and timeout
    assert left.output == "0\n"
    assert states == ["interrupted", "interrupted"]


async def test_what_a_command_leaves_running_is_killed_when_it_ends(docker: Docker) -> None:
    async with sandbox(docker) as container:
        started = time.monotonic()
        outcome = await sh(docker, container, "sleep 300 & setsid sleep 301 & echo started")
        elapsed = time.monotonic() - started
        left = await sh(docker, container, SLEEPS)
    assert (outcome.exit_code, outcome.output) == (0, "started\n")
    assert elapsed < 10
    assert left.output == "0\n"


async def test_the_command_is_an_argument_never_part_of_the_script(docker: Docker) -> None:
    async with sandbox(docker) as container:
        quoted = await sh(docker, container, "printf '%s\\n' \"$0\" '$1 `x` $(y)' \"it's\"")
        broken = await sh(docker, container, "echo ' \" $(")
    assert quoted.output == "bash\n$1 `x` $(y)\nit's\n"
    assert broken.exit_code == 2  # the command's own bash refuses it; the wrapper reports it
    assert "unexpected EOF" in broken.output


# -- files -----------------------------------------------------------------------------------------


async def test_paths_outside_the_workspace_are_refused(docker: Docker) -> None:
    async with sandbox(docker) as container:
        await sh(docker, container, "ln -s /etc/passwd passwd; ln -s /etc etc; mkdir -p a/b")
        refused = {
            "../etc/passwd": "resolves to /etc/passwd, outside /workspace",
            "/etc/passwd": "resolves to /etc/passwd, outside /workspace",
            "a/../../tmp/x": "resolves to /tmp/x, outside /workspace",
            "passwd": "resolves to /etc/passwd, outside /workspace",
            "etc/hostname": "resolves to /etc/hostname, outside /workspace",
            "a\0b": "it contains a NUL byte",
        }
        for path, reason in refused.items():
            with pytest.raises(PathRefused) as read:
                await docker.read_file(container, path, 100)
            assert read.value.reason.endswith(reason), path
            with pytest.raises(PathRefused):
                await docker.write_file(container, path, b"x")
            with pytest.raises(PathRefused):
                await docker.list_files(container, path)

        await docker.write_file(container, "/workspace/a/b/../c.txt", b"inside")
        assert await docker.read_file(container, "a/c.txt", 100) == (b"inside", 6)
        listed = await sh(docker, container, "cat /etc/passwd | wc -l")
    assert int(listed.output) > 10  # the symlinks' targets exist: refused for where they lead


async def test_files_are_read_written_and_listed(docker: Docker) -> None:
    data = bytes(range(256)) * 8192  # 2 MiB, every byte value
    async with sandbox(docker) as container:
        await docker.write_file(container, "deep/er/data.bin", data)
        await docker.write_file(container, "run.sh", b"#!/bin/sh\necho run\n")
        await sh(docker, container, "chmod +x run.sh; ln -s deep link; mkfifo pipe")
        await docker.write_file(container, "run.sh", b"#!/bin/sh\necho replaced\n")

        head, size = await docker.read_file(container, "deep/er/data.bin", 1000)
        whole, _ = await docker.read_file(container, "deep/er/data.bin", 4 * MiB)
        ran = await sh(docker, container, "./run.sh")
        top = await docker.list_files(container, "")
        everything = await docker.list_files(container, ".", recursive=True)
        limited = await docker.list_files(container, "", recursive=True, limit=2)
        errors = []
        for call in (
            docker.read_file(container, "missing", 10),
            docker.read_file(container, "deep", 10),
            docker.read_file(container, "pipe", 10),
            docker.write_file(container, "deep", b""),
            docker.write_file(container, "run.sh/x", b""),
        ):
            try:
                await call
            except (OSError, PathRefused) as error:
                errors.append(type(error).__name__)

    assert (head, size) == (data[:1000], len(data))
    assert whole == data
    assert ran.output == "replaced\n"  # rewritten whole, its mode kept
    assert top == [
        ("deep", "dir", 60),
        ("link", "link", 4),
        ("pipe", "other", 0),
        ("run.sh", "file", 24),
    ]
    assert [entry[0] for entry in everything] == [
        "deep", "deep/er", "deep/er/data.bin", "link", "pipe", "run.sh"
    ]  # fmt: skip
    assert [entry[0] for entry in limited] == ["deep", "deep/er"]
    assert errors == [
        "FileNotFoundError",
        "IsADirectoryError",
        "PathRefused",
        "IsADirectoryError",
        "NotADirectoryError",
    ]


async def test_the_workspace_goes_out_and_back_in_as_tar(docker: Docker) -> None:
    big = os.urandom(10 * MiB)
    async with sandbox(docker) as container:
        await docker.write_file(container, "big.bin", big)
        await docker.write_file(container, "src/main.py", b"print('hi')\n")
        await sh(docker, container, "chmod 0750 src/main.py; ln -s src/main.py main; mkdir empty")
        await sh(
            docker, container, "mkdir -p locked/in; touch locked/in/x; chmod 000 locked big.bin"
        )
        tar = await docker.export(container)
        before = await docker.list_files(container, "", recursive=True)

    with tarfile.open(fileobj=io.BytesIO(tar)) as archive:
        names = archive.getnames()
    assert names == [
        ".", "./big.bin", "./empty", "./locked", "./locked/in", "./locked/in/x", "./main", "./src",
        "./src/main.py",
    ]  # fmt: skip

    async with sandbox(docker) as container:
        await docker.write_file(container, "stale.txt", b"from before the import")
        await docker.import_(container, tar, clear=True)
        after = await docker.list_files(container, "", recursive=True)
        copy, _ = await docker.read_file(container, "big.bin", 11 * MiB)
        modes = await sh(docker, container, "stat -c '%a %U %n' src/main.py; readlink main")
        await docker.import_(container, tar)  # again, over itself: same files
        again = await docker.list_files(container, "", recursive=True)

    assert after == before == again
    assert copy == big
    assert modes.output == "750 sandbox src/main.py\nsrc/main.py\n"


async def test_import_rejects_a_broken_tar_and_write_rejects_a_full_workspace(
    docker: Docker,
) -> None:
    async with sandbox(docker, Limits(workspace_bytes=4 * MiB)) as container:
        with pytest.raises(ExecFailed, match="tar"):
            await docker.import_(container, b"not a tar" * 100)
        await docker.write_file(container, "keep.txt", b"kept")
        with pytest.raises(ExecFailed, match="No space left on device"):
            await docker.write_file(container, "keep.txt", bytes(5 * MiB))
        assert await docker.read_file(container, "keep.txt", 100) == (b"kept", 4)


# -- the container as Docker sees it ---------------------------------------------------------------


async def test_containers_are_created_hardened(
    docker: Docker, raw_docker: aiodocker.Docker
) -> None:
    limits = Limits(memory_bytes=300 * MiB, cpus=0.5, pids=99, workspace_bytes=7 * MiB)
    async with sandbox(docker, limits, start=False) as container:
        config = await raw_docker.containers.container(container).show()
        image = await raw_docker.images.inspect(DEFAULT_IMAGE)
        await docker.start(container)
        await docker.start(container)  # idempotent
        inside = await sh(
            docker,
            container,
            "id -u; grep -E '^(CapEff|NoNewPrivs|Seccomp):' /proc/self/status; "
            "ls /sys/class/net; ls /var/run/docker.sock /run/docker.sock 2>&1; "
            "grep -E ' /(tmp|workspace) ' /proc/mounts; "
            "find / -xdev -perm /6000 -type f 2>/dev/null | wc -l",
        )
    host = config["HostConfig"]
    assert host["CapDrop"] == ["ALL"]
    assert not host["CapAdd"]
    assert host["SecurityOpt"] == ["no-new-privileges"]  # no seccomp=unconfined: the default
    assert host["Privileged"] is False
    assert host["ReadonlyRootfs"] is True
    assert host["NetworkMode"] == "none"
    assert (host["Memory"], host["MemorySwap"]) == (300 * MiB, 300 * MiB)
    assert host["NanoCpus"] == 500_000_000
    assert host["PidsLimit"] == 99
    assert host["Init"] is True
    assert host["AutoRemove"] is False
    assert host["RestartPolicy"]["Name"] == "no"
    assert not host["Binds"]
    assert not host.get("Mounts")
    assert not config["Mounts"]  # nothing but the two tmpfs (Docker lists those apart)
    assert set(host["Tmpfs"]) == {"/tmp", WORKSPACE, "/run/toren"}
    assert config["Config"]["User"] == "1000:1000"
    assert sorted(config["Config"]["Env"]) == sorted([*image["Config"]["Env"], "HOME=/tmp"])
    assert config["Config"]["Labels"][LABEL_MANAGED] == "1"
    assert config["Config"]["Labels"][LABEL_RUN].startswith("test-")

    lines = inside.output.splitlines()
    assert lines[:4] == ["1000", "CapEff:\t0000000000000000", "NoNewPrivs:\t1", "Seccomp:\t2"]
    assert lines[4] == "lo"
    assert "No such file or directory" in lines[5]
    assert "No such file or directory" in lines[6]
    tmp, workspace = sorted(lines[7:9])
    assert tmp.split()[3].split(",")[:5] == ["rw", "nosuid", "nodev", "noexec", "relatime"]
    assert "size=65536k" in tmp
    assert workspace.split()[3].split(",")[:4] == ["rw", "nosuid", "nodev", "relatime"]
    assert "size=7168k" in workspace
    assert "uid=1000" in workspace
    assert lines[9] == "0"  # no setuid or setgid program in the image


async def test_find_and_list_see_the_containers_of_a_run(docker: Docker) -> None:
    async with sandbox(docker, start=False) as container:
        info = await docker.find(f"test-{(await _name(docker, container))}")
        everything = await docker.list()
        await docker.stop(container)  # not running: fine
    assert info is not None
    assert info.container_id == container
    assert info.state == "created"
    assert container in {i.container_id for i in everything}
    assert await docker.find("no-such-run") is None
    await docker.stop(container)  # gone: fine
    await docker.remove(container)


async def _name(docker: Docker, container: str) -> str:
    return next(i.name for i in await docker.list() if i.container_id == container)


async def test_root_or_unverifiable_images_and_missing_ones_are_refused(docker: Docker) -> None:
    for user in ("0:0", "sandbox"):
        async with committed(docker, changes=[f"USER {user}"]) as image:
            with pytest.raises(UnsafeImage, match=f"runs as user {user}"):
                await docker.create(
                    name="toren-test-never", image=image, limits=Limits(), labels={}
                )
    with pytest.raises(Unavailable, match="nothing is pulled"):
        await docker.check_image("toren-test/missing:never")
    with pytest.raises(Unavailable, match=r"apt-get install docker\.io"):
        await Docker.connect("unix:///nonexistent/docker.sock")
