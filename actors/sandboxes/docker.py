"""The Docker layer of sandboxes: hardened containers, commands that can be found and killed,
the workspace in and out as tar. The only module that talks to Docker (through ``aiodocker``).

Every container is created hardened (:mod:`toren.actors.sandboxes.hardening` says how: a numeric
non-root user, no capabilities, no network, a read-only root, size-limited tmpfs for /tmp and
/workspace, memory, CPU and PID limits); what the helper script's execs come back with is read
in :mod:`toren.actors.sandboxes.outcomes`.

Docker's API cannot kill an exec, so each command runs under a helper script
(:mod:`toren.actors.sandboxes._script`) in its own process group under ``timeout -k``, with
``TOREN_COMMAND=<marker>`` in its environment, and leaves a record in the container's /run/toren;
``recover`` and ``kill_all`` find commands by those after a worker died. A process that leaves
its group (setsid) and drops the marker together hangs from the container's init: at the end of
every command, and in ``kill_all``, whatever hangs from init besides the container's main process
(and what descends from a running exec) is killed too. A command can
also write its own record (same user): it can misreport only its own outcome.

A user's own image needs bash 4.4 or later, GNU coreutils and GNU tar on its PATH, and a numeric
non-root ``USER uid:gid`` (checked before create: a name could be root). Its entrypoint and
command are replaced by ``sleep infinity``.

Errors (those a helper script's exit status means are defined in
:mod:`toren.actors.sandboxes.outcomes`)::

    Exception
    ├── Unavailable          no daemon answers, or the image is missing: the message says what to do
    │   └── UnsafeImage      the image would run as root (or as a user that cannot be checked)
    ├── ExecFailed           a helper script failed inside the container (image without bash or
    │                        coreutils, a full workspace on write, a tar that does not extract)
    └── ValueError
        ├── PathRefused      a path outside the workspace, with a NUL, or not a regular file
        └── MarkerUsed       run() with a marker that already ran in this container
    aiodocker.DockerError    anything else Docker refuses (404: no such container; 409: it is not
                             running; 500: the daemon failed): not retried here
    FileNotFoundError, IsADirectoryError, NotADirectoryError from the file functions
"""

from __future__ import annotations

import builtins
import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

import aiodocker
import aiohttp
import anyio
import attrs
from aiodocker.stream import Stream

from toren.actors.sandboxes._script import SCRIPT
from toren.actors.sandboxes.hardening import WORKSPACE, Limits, hardened_config
from toren.actors.sandboxes.outcomes import (
    MARKER_ENV,
    ExecFailed,
    MarkerUsed,
    Outcome,
    PathRefused,
    ScriptDone,
    WorkspaceTooLarge,
    check_marker,
    raise_for_path,
    read_listing,
    read_outcome,
)

DEFAULT_IMAGE = "toren/sandbox:latest"
"""The image ``scripts/sandbox-image`` builds from ``docker/sandbox/Dockerfile``."""

LABEL_RUN = "toren.run"
LABEL_SANDBOX = "toren.sandbox"
LABEL_SCOPE = "toren.scope"
"""Which database's containers these are: workers reap only their own scope's orphans."""
LABEL_MANAGED = "toren.managed"
"""Set to ``1`` on every container Toren creates: what ``list`` (and the orphan reaper) finds."""

BUILD_HINT = "scripts/sandbox-image"
STOP_SECONDS = 2
_CONNECT_SECONDS = 10.0
_EXIT_CODE_SECONDS = 5.0
_HOW_TO_GET_DOCKER = (
    "Sandboxes need a Docker daemon: install it (Debian: apt-get install docker.io), start it "
    "(systemctl start docker, or dockerd in the background), and let this user reach its socket "
    "(the docker group), or point DOCKER_HOST at a daemon."
)


@attrs.frozen(kw_only=True)
class Info:
    """A sandbox container as Docker lists it."""

    container_id: str
    name: str
    run_id: str
    sandbox_id: str
    state: str  # Docker's: created, running, exited, ...
    created: float
    scope: str = ""  # the toren.scope label


class Unavailable(Exception):
    """No Docker daemon answers (or the image is missing): what to do about it is the message."""


class UnsafeImage(Unavailable):
    """The image's user is root, unset, or not numeric (so it cannot be checked before running)."""

    def __init__(self, image: str, user: str) -> None:
        self.image = image
        self.user = user
        super().__init__(
            f"The sandbox image {image} runs as user {user or '(unset: root)'!s}; sandboxes run "
            "only as a numeric non-root user. Set USER uid:gid (for example USER 1000:1000) in "
            f"its Dockerfile, as docker/sandbox/Dockerfile does, and rebuild it."
        )


class Docker:
    """One aiodocker client per worker process."""

    def __init__(self, client: aiodocker.Docker) -> None:
        self._client = client

    @classmethod
    async def connect(cls, url: str | None = None) -> Docker:
        """Connects to ``url``, else DOCKER_HOST, else the local socket, and checks it answers.

        Raises:
            Unavailable: no daemon answers within 10 s; the message says how to get Docker.
        """
        try:
            client = aiodocker.Docker(url=url)
        except (AssertionError, ValueError) as error:  # aiodocker's "no socket found"
            raise Unavailable(f"No Docker socket found. {_HOW_TO_GET_DOCKER}") from error
        try:
            with anyio.fail_after(_CONNECT_SECONDS):
                await client.version()
        except (OSError, TimeoutError, aiohttp.ClientError, aiodocker.DockerError) as error:
            await client.close()
            raise Unavailable(
                f"No Docker daemon answers at {client._connection_info} ({error}). "
                f"{_HOW_TO_GET_DOCKER}"
            ) from error
        return cls(client)

    async def close(self) -> None:
        await self._client.close()

    async def check_image(self, image: str) -> None:
        """Raises Unavailable if ``image`` is not present locally (nothing is ever pulled)."""
        await self._image_config(image)

    async def find(self, run_id: str) -> Info | None:
        """The container of run ``run_id`` in any state (the newest if several), or None."""
        found = await self._list({"label": [f"{LABEL_MANAGED}=1", f"{LABEL_RUN}={run_id}"]})
        return max(found, key=lambda info: info.created, default=None)

    async def list(self) -> builtins.list[Info]:
        """Every container Toren created (labelled ``toren.managed=1``), in any state."""
        return await self._list({"label": [f"{LABEL_MANAGED}=1"]})

    async def create(
        self,
        *,
        name: str,
        image: str,
        limits: Limits,
        labels: Mapping[str, str],
        overrides: Mapping[str, Any] | None = None,
    ) -> str:
        """Create (not start) a hardened container; returns its id.

        ``overrides`` is for tests and their control runs only (see
        :func:`~toren.actors.sandboxes.hardening.hardened_config`).

        Raises:
            Unavailable: the image is missing (the message names ``scripts/sandbox-image``).
            UnsafeImage: the image's user is root, unset or not numeric.
            aiodocker.DockerError: 409 if the name is taken; 400 if Docker refuses a limit.
        """
        uid, gid = await self._image_user(image)
        config = hardened_config(
            image=image,
            uid=uid,
            gid=gid,
            limits=limits,
            labels={**labels, LABEL_MANAGED: "1"},
            overrides=overrides,
        )
        container = await self._client.containers.create(config, name=name)
        return container.id

    async def start(self, container_id: str) -> None:
        """Start it if it is not running (idempotent). DockerError 404 if it does not exist."""
        await self._client.containers.container(container_id).start()

    async def stop(self, container_id: str) -> None:
        """Stop it (SIGKILL after 2 s); running commands die with it. A missing one is fine."""
        try:
            await self._client.containers.container(container_id).stop(t=STOP_SECONDS)
        except aiodocker.DockerError as error:
            if error.status != 404:
                raise

    async def remove(self, container_id: str) -> None:
        """Remove it, running or not, with its tmpfs. A missing one (or one going) is fine."""
        try:
            await self._client.containers.container(container_id).delete(force=True, v=True)
        except aiodocker.DockerError as error:
            if error.status not in (404, 409):
                raise

    async def run(
        self,
        container_id: str,
        *,
        marker: str,
        command: str,
        timeout: float,  # noqa: ASYNC109  # the command's limit, enforced in the container
        output_cap: int,
        kill_grace: float = 2.0,
    ) -> Outcome:
        """Run ``command`` with ``bash -c`` in /workspace as the container's user; wait for it.

        The command gets its own process group under ``timeout -k kill_grace timeout`` and
        ``TOREN_COMMAND=<marker>`` in its environment; stdout and stderr are merged, stdin is
        empty. The first ``output_cap`` bytes are kept, the rest counted. When its first process
        ends, whatever it left running (in its group or carrying its marker) is killed.
        Cancelling this call leaves the command running: ``recover`` finds and kills it.

        Raises:
            ValueError: a marker that is not ``[A-Za-z0-9_-]{1,128}``, a timeout that is not
                positive, a negative cap, a NUL in the command.
            MarkerUsed: the marker ran before in this container.
            ExecFailed: the record could not be made (a full /tmp, an image without coreutils).
            aiodocker.DockerError: 409 if the container is not running, 404 if it is gone.
        """
        check_marker(marker)
        if not timeout > 0 or not kill_grace > 0 or output_cap < 0:
            raise ValueError("timeout and kill_grace must be positive, output_cap not negative")
        if "\0" in command:
            raise ValueError("a command cannot contain a NUL byte")
        args = ["run", marker, str(output_cap), f"{timeout:.3f}", f"{kill_grace:.3f}", command]
        done = await self._exec(container_id, args, env={MARKER_ENV: marker})
        if done.exit_code == 97:
            raise MarkerUsed(marker)
        return read_outcome("run", done)

    async def recover(self, container_id: str, marker: str) -> Outcome:
        """What became of a command started before a crash; kills it if it is still running.

        ``finished`` with its exit code and stored output; ``interrupted`` (exit code None, the
        output stored until it was killed) if it started and did not finish; ``not_started`` if
        the container has no trace of it.
        """
        check_marker(marker)
        return read_outcome("recover", await self._exec(container_id, ["recover", marker]))

    async def kill_all(self, container_id: str) -> int:
        """Kill every command running in the container; returns how many processes were killed.

        Their records stay: ``recover`` reports each as interrupted.
        """
        done = await self._exec(container_id, ["kill_all"])
        if done.exit_code != 0:
            raise ExecFailed("kill_all", done.exit_code, done.stderr)
        return int(done.stdout)

    async def forget(self, container_id: str, marker: str) -> None:
        """Delete a command's record (its stored output) once its result is safely journaled."""
        check_marker(marker)
        await self._checked("forget", container_id, ["forget", marker])

    async def export(self, container_id: str, cap: int = 1 << 30) -> bytes:
        """A tar of /workspace: members ``./...``, sorted by name, numeric owners.

        Every file and directory is first made readable and writable by its owner (the sandbox
        user owns them all), so that a command's ``chmod 000`` cannot make checkpoints fail.

        Raises:
            WorkspaceTooLarge: its files hold more than ``cap`` bytes (a sparse file counts
                whole: a tmpfs keeps one of any length past the workspace's size).
        """
        limit = cap + cap // 8 + (1 << 20)  # what tar adds: headers, padding
        done = await self._exec(container_id, ["export", str(cap)], limit=limit)
        if done.exit_code == 8:
            raise WorkspaceTooLarge(done.stderr.strip())
        if done.exit_code != 0:
            raise ExecFailed("export", done.exit_code, done.stderr.strip())
        return done.stdout

    async def import_(self, container_id: str, tar: bytes, *, clear: bool = False) -> None:
        """Extract ``tar`` into /workspace (modes kept, owned by the container's user).

        With ``clear``, the workspace is emptied first, so it ends up exactly as the tar.
        """
        await self._checked("import", container_id, ["import", "1" if clear else "0"], stdin=tar)

    async def read_file(self, container_id: str, path: str, cap: int) -> tuple[bytes, int]:
        """The first ``cap`` bytes of a workspace file, and its whole size.

        ``path`` is relative to /workspace or absolute under it; it is resolved inside the
        container (symlinks followed, ``..`` applied) and must stay under /workspace.

        Raises:
            PathRefused: outside the workspace, a NUL, or not a regular file.
            FileNotFoundError, IsADirectoryError: as the names say.
        """
        done = await self._path_exec("read", container_id, path, [str(max(cap, 0))])
        sizes = [line for line in done.stderr.splitlines() if line.startswith("size ")]
        return done.stdout, int(sizes[-1].split()[1])

    async def write_file(self, container_id: str, path: str, data: bytes) -> None:
        """Write ``data`` to a workspace file (replaced whole, its mode kept), making parents.

        Raises:
            PathRefused: outside the workspace, a NUL, or an existing non-regular file.
            IsADirectoryError, NotADirectoryError: as the names say.
            ExecFailed: the write failed, for example the workspace is full (the file is
                unchanged).
        """
        await self._path_exec("write", container_id, path, [str(len(data))], stdin=data)

    async def list_files(
        self, container_id: str, path: str, *, recursive: bool = False, limit: int = 1000
    ) -> builtins.list[tuple[str, str, int]]:
        """Entries of a workspace directory as (path relative to /workspace, kind, size).

        Kind is ``file``, ``dir``, ``link`` (not followed; its size is its target's length) or
        ``other``. One level unless ``recursive`` (symlinked directories are not entered); at
        most ``limit`` entries, sorted by path. A file's path lists that file alone.

        Raises:
            PathRefused, FileNotFoundError: as for ``read_file``.
        """
        done = await self._path_exec(
            "list", container_id, path, ["1" if recursive else "0", str(max(limit, 0))]
        )
        return read_listing(done.stdout)

    async def _path_exec(
        self,
        action: str,
        container_id: str,
        path: str,
        args: Sequence[str],
        *,
        stdin: bytes | None = None,
    ) -> ScriptDone:
        if "\0" in path:
            raise PathRefused(path, "it contains a NUL byte")
        done = await self._exec(container_id, [action, path, *args], stdin=stdin)
        raise_for_path(action, path, done)
        return done

    async def _checked(
        self, action: str, container_id: str, args: Sequence[str], *, stdin: bytes | None = None
    ) -> ScriptDone:
        done = await self._exec(container_id, args, stdin=stdin)
        if done.exit_code != 0:
            raise ExecFailed(action, done.exit_code, done.stderr.strip())
        return done

    async def _exec(
        self,
        container_id: str,
        args: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        stdin: bytes | None = None,
        limit: int | None = None,
    ) -> ScriptDone:
        """The helper script with ``args``, as the container's user in /workspace; at most
        ``limit`` bytes of its stdout are read (past it: :class:`WorkspaceTooLarge`)."""
        container = self._client.containers.container(container_id)
        execution = await container.exec(
            ["bash", "-c", SCRIPT, "toren", *args],
            stdin=stdin is not None,
            environment=env,
            workdir=WORKSPACE,
        )
        stdout = bytearray()
        stderr = bytearray()
        async with execution.start(detach=False) as stream, anyio.create_task_group() as group:
            if stdin is not None:
                group.start_soon(_feed, stream, stdin)
            while (message := await stream.read_out()) is not None:
                (stdout if message.stream == 1 else stderr).extend(message.data)
                if limit is not None and len(stdout) > limit:
                    group.cancel_scope.cancel()
                    raise WorkspaceTooLarge(f"the workspace's export passed {limit} bytes")
        # The stream ends as the process does; Docker may record the exit code a moment later.
        with anyio.fail_after(_EXIT_CODE_SECONDS):
            while (state := await execution.inspect())["Running"]:  # noqa: ASYNC110  # no event
                await anyio.sleep(0.005)
        return ScriptDone(state["ExitCode"], bytes(stdout), stderr.decode(errors="replace"))

    async def _image_config(self, image: str) -> dict[str, Any]:
        try:
            found = await self._client.images.inspect(image)
        except aiodocker.DockerError as error:
            if error.status != 404:
                raise
            hint = (
                f"build it with {BUILD_HINT}"
                if image == DEFAULT_IMAGE
                else "build it (docker build) or load it (docker load) on this host"
            )
            raise Unavailable(
                f"The sandbox image {image} is not in the local Docker, and nothing is pulled: "
                f"{hint}."
            ) from error
        config: dict[str, Any] = found.get("Config") or {}
        return config

    async def _image_user(self, image: str) -> tuple[int, int]:
        """The image's numeric (uid, gid); gid defaults to uid. Refuses root and names."""
        user = str((await self._image_config(image)).get("User") or "")
        match = re.fullmatch(r"(\d+)(?::(\d+))?", user)
        if match is None or int(match[1]) == 0:
            raise UnsafeImage(image, user)
        uid = int(match[1])
        return uid, int(match[2]) if match[2] is not None else uid

    async def _list(self, filters: Mapping[str, builtins.list[str]]) -> builtins.list[Info]:
        found = await self._client.containers.list(all="true", filters=json.dumps(filters))
        return [_info(container._container) for container in found]


def _info(data: Mapping[str, Any]) -> Info:
    labels = data.get("Labels") or {}
    names = data.get("Names") or [""]
    return Info(
        container_id=data["Id"],
        name=names[0].lstrip("/"),
        run_id=labels.get(LABEL_RUN, ""),
        sandbox_id=labels.get(LABEL_SANDBOX, ""),
        state=data.get("State", ""),
        created=float(data.get("Created", 0)),
        scope=labels.get(LABEL_SCOPE, ""),
    )


async def _feed(stream: Stream, data: bytes) -> None:
    """Writes ``data`` to an exec's stdin, then closes it so the process reads end-of-file."""
    view = memoryview(data)
    try:
        for start in range(0, len(view), 1 << 20):
            await stream.write_in(bytes(view[start : start + (1 << 20)]))
    except (OSError, RuntimeError, aiohttp.ClientError):
        return  # the process ended without reading it all: its exit status says why
    # aiodocker closes stdin only together with the whole stream: half-close the socket instead.
    response = stream._resp
    if response is not None and response.connection is not None:
        transport = response.connection.transport
        if transport is not None and transport.can_write_eof():
            transport.write_eof()
