"""Sandboxes on real Docker: container create + start, one command round trip, and a checkpoint
of a 10 MB workspace with one changed file, beside Docker's own baselines in the same run.

- **create + start**: Toren's ``Docker.create`` (the image's user checked, every default limit
  set) and ``Docker.start``, against a bare aiodocker create + start with a minimal config (the
  image, network none), ``docker run -d`` (the CLI's create + start, detached) and ``docker run
  --rm IMAGE true`` (the CLI's whole life of a container: create, start, wait, remove). Each
  round times the four in turn, so the machine's noise falls on all of them; removals between
  rounds are not timed.
- **exec round trip**: ``Docker.run`` of ``true`` (the helper script: its own process group under
  ``timeout -k``, a marker, a record in /tmp, the capped output read back), against a bare
  aiodocker exec of ``true`` (created, started attached, read to its end, inspected for the exit
  code) on the same hardened container. The record is forgotten after each round, untimed.
- **checkpoint**: a hardened container whose workspace holds ten files of 1 MiB of random bytes
  and a 1 KiB file (:func:`bench.workspace.workspace_tar`). Each round writes a new 1 KiB file
  (untimed), then times ``Docker.export`` and ``checkpoint()`` of that tar to a local directory
  and to moto's S3 server on 127.0.0.1; beside them a bare aiodocker exec of ``tar -cf - .`` in
  the workspace (the export without its helper script).

Every container is named ``toren-bench-...``, has network ``none``, and is removed when the
section ends, whatever happens; ``sandbox_containers_left`` counts those Docker still lists then.
Without a Docker daemon or the image the section is skipped and says why (``sandbox_skipped``).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import aiodocker
import anyio
import attrs
from aiodocker.containers import DockerContainer

from bench._common import Bench, median_ms, p99_ms
from bench.workspace import MiB, moto_store, workspace_tar
from toren.actors.sandboxes.docker import (
    DEFAULT_IMAGE,
    LABEL_RUN,
    LABEL_SANDBOX,
    LABEL_SCOPE,
    Docker,
    Unavailable,
)
from toren.actors.sandboxes.hardening import Limits
from toren.sandboxes.checkpoints import Manifest, checkpoint
from toren.sandboxes.store import LocalStore, WorkspaceStore

PREFIX = "toren-bench-"
SCOPE = "toren-bench"  # no worker's database scope: no orphan reaper removes these mid-run
CLI_SECONDS = 60.0


@attrs.define
class _Made:
    """The containers this section named, to remove whatever happens."""

    docker: Docker
    bare: aiodocker.Docker
    names: list[str] = attrs.field(factory=list)

    def name(self) -> str:
        name = PREFIX + uuid.uuid4().hex[:12]
        self.names.append(name)
        return name

    def labels(self, name: str) -> dict[str, str]:
        return {LABEL_RUN: f"bench-{name}", LABEL_SANDBOX: name, LABEL_SCOPE: SCOPE}

    async def hardened(self) -> str:
        """Toren's create + start: the hardened config with the default limits."""
        name = self.name()
        cid = await self.docker.create(
            name=name, image=DEFAULT_IMAGE, limits=Limits(), labels=self.labels(name)
        )
        await self.docker.start(cid)
        return cid

    async def remove_all(self) -> int:
        """Removes every container named here; returns how many Docker still lists after 10 s."""
        for name in self.names:
            with contextlib.suppress(aiodocker.DockerError):  # counted below if it stayed
                await self.docker.remove(name)
        named = set(self.names)
        left: set[str] = set()
        with anyio.move_on_after(10):
            while True:
                found = await self.bare.containers.list(
                    all=True, filters=json.dumps({"name": [PREFIX]})
                )
                left = {c._container["Names"][0].lstrip("/") for c in found} & named
                if not left:
                    break
                await anyio.sleep(0.2)
        return len(left)


async def _timed(action: Callable[[], Awaitable[object]]) -> float:
    start = time.perf_counter()
    await action()
    return time.perf_counter() - start


async def _docker_or_why() -> tuple[Docker | None, str]:
    try:
        docker = await Docker.connect()
    except Unavailable as error:
        return None, str(error)
    try:
        await docker.check_image(DEFAULT_IMAGE)
    except Unavailable as error:
        await docker.close()
        return None, str(error)
    return docker, ""


async def run(b: Bench) -> None:
    docker, why = await _docker_or_why()
    if docker is None:
        b.progress.console.print(f"sandbox section skipped: {why}", markup=False)
        b.record("sandbox_skipped", why, "sandbox section", "skipped", why)
        return
    bare = aiodocker.Docker()
    made = _Made(docker, bare)
    n = b.count(30, 2)
    b.results["sandbox_n"] = n
    try:
        await _create_start(b, made, n)
        await _exec(b, made, b.count(100, 2))
        await _checkpoint(b, made, n)
    finally:
        with anyio.CancelScope(shield=True):
            left = await made.remove_all()
            await bare.close()
            await docker.close()
    b.results["sandbox_containers_left"] = left
    if left:
        raise RuntimeError(f"{left} {PREFIX}* containers are still there after removal")


def _show(b: Bench, key: str, seconds: list[float], figure: str, note: str = "") -> float:
    """Records the median and p99 of ``seconds`` in ms (``KEY_median_ms``, ``KEY_p99_ms``);
    returns the median."""
    median, worst = median_ms(seconds), p99_ms(seconds)
    b.results[f"{key}_p99_ms"] = round(worst, 2)
    b.record(f"{key}_median_ms", round(median, 2), figure, f"{median:.1f} / {worst:.1f} ms", note)
    return median


async def _create_start(b: Bench, made: _Made, n: int) -> None:
    docker, bare = made.docker, made.bare
    cli = shutil.which("docker")
    times: dict[str, list[float]] = {"toren": [], "bare": [], "run_d": [], "run_rm": []}

    async def minimal() -> None:
        config: dict[str, Any] = {"Image": DEFAULT_IMAGE, "HostConfig": {"NetworkMode": "none"}}
        container = await bare.containers.create(config, name=made.name())
        await container.start()

    async def docker_run(*args: str) -> None:
        command = [str(cli), "run", "--name", made.name(), "--network", "none", *args]
        with anyio.fail_after(CLI_SECONDS):
            await anyio.run_process(command)

    rounds: list[tuple[str, Callable[[], Awaitable[object]]]] = [
        ("toren", made.hardened),
        ("bare", minimal),
    ]
    if cli is not None:
        rounds.append(("run_d", lambda: docker_run("-d", DEFAULT_IMAGE)))
        rounds.append(("run_rm", lambda: docker_run("--rm", DEFAULT_IMAGE, "true")))
    else:
        b.progress.console.print(
            "sandbox: no docker CLI on PATH, so no `docker run` baseline", markup=False
        )
    with b.task("sandbox: create + start", n + 1) as task:
        for i in range(n + 1):  # the first round warms the daemon's caches, untimed
            for key, action in rounds:
                took = await _timed(action)
                if i:
                    times[key].append(took)
                await docker.remove(made.names[-1])
            b.progress.advance(task)
    toren_ms = _show(
        b,
        "sandbox_create_start",
        times["toren"],
        "sandbox: create + start, hardened (median / p99)",
        "Docker.create + Docker.start, default limits",
    )
    _show(
        b,
        "sandbox_bare_create_start",
        times["bare"],
        "sandbox: bare aiodocker create + start",
        "image and network none only",
    )
    b.ratio(
        "sandbox_create_start_vs_bare",
        toren_ms,
        "sandbox_bare_create_start_median_ms",
        "sandbox: create + start / bare aiodocker",
        "reported, no target",
    )
    if cli is None:
        return
    _show(b, "sandbox_docker_run_d", times["run_d"], "sandbox: `docker run -d`", "create + start")
    _show(
        b,
        "sandbox_docker_run_rm",
        times["run_rm"],
        "sandbox: `docker run --rm IMAGE true`",
        "create, start, wait, remove",
    )
    b.ratio(
        "sandbox_create_start_vs_docker_run_d",
        toren_ms,
        "sandbox_docker_run_d_median_ms",
        "sandbox: create + start / `docker run -d`",
        "reported, no target",
    )


async def _bare_exec(container: DockerContainer, cmd: list[str]) -> bytes:
    """An exec as plainly as aiodocker does it: its stdout, once Docker has its exit code 0."""
    execution = await container.exec(cmd)
    out = bytearray()
    async with execution.start(detach=False) as stream:
        while (message := await stream.read_out()) is not None:
            if message.stream == 1:
                out.extend(message.data)
    while (state := await execution.inspect())["Running"]:  # Docker has no event for it
        await anyio.sleep(0.001)
    if state["ExitCode"] != 0:
        raise RuntimeError(f"{cmd} exited {state['ExitCode']} in a bench container")
    return bytes(out)


async def _exec(b: Bench, made: _Made, n: int) -> None:
    docker = made.docker
    cid = await made.hardened()
    container = made.bare.containers.container(cid)
    times: dict[str, list[float]] = {"toren": [], "bare": []}

    async def toren(i: int) -> None:
        outcome = await docker.run(
            cid, marker=f"bench-{i}", command="true", timeout=30, output_cap=65536
        )
        if outcome.exit_code != 0:
            raise RuntimeError(f"`true` through Docker.run ended {outcome}")

    with b.task("sandbox: exec round trips", n + 2) as task:
        for i in range(n + 2):  # two warm-up rounds, untimed
            took = await _timed(lambda: toren(i))  # noqa: B023  # awaited within the iteration
            await docker.forget(cid, f"bench-{i}")
            bare = await _timed(lambda: _bare_exec(container, ["true"]))
            if i >= 2:
                times["toren"].append(took)
                times["bare"].append(bare)
            b.progress.advance(task)
    b.results["sandbox_exec_n"] = n
    toren_ms = _show(
        b,
        "sandbox_exec",
        times["toren"],
        "sandbox: one command round trip (median / p99)",
        "Docker.run of `true`: marker, timeout -k, record",
    )
    _show(b, "sandbox_bare_exec", times["bare"], "sandbox: bare aiodocker exec of `true`")
    b.ratio(
        "sandbox_exec_vs_bare",
        toren_ms,
        "sandbox_bare_exec_median_ms",
        "sandbox: round trip / bare exec",
        "reported, no target",
    )


async def _stores(b: Bench, stack: contextlib.AsyncExitStack) -> dict[str, WorkspaceStore]:
    """A local directory and, where moto is installed (the ``dev`` extra), its S3 server."""
    stores: dict[str, WorkspaceStore] = {"local": LocalStore(b.tmp / "workspaces")}
    if importlib.util.find_spec("moto") is None:
        why = "moto is not installed (pip install 'moto[server]'): no S3 checkpoint figure"
        b.progress.console.print(f"sandbox: {why}", markup=False)
        b.results["sandbox_s3_skipped"] = why
    else:
        stores["s3"] = await stack.enter_async_context(moto_store("bench-sandbox"))
    return stores


async def _checkpoint(b: Bench, made: _Made, n: int) -> None:
    docker = made.docker
    cid = await made.hardened()
    container = made.bare.containers.container(cid)
    big = [os.urandom(MiB) for _ in range(10)]
    await docker.import_(cid, workspace_tar(big, os.urandom(1024)), clear=True)
    times: dict[str, list[float]] = {"export": [], "tar": [], "local": [], "s3": []}
    uploaded = 0
    async with contextlib.AsyncExitStack() as stack:
        stores = await _stores(b, stack)
        tar = await docker.export(cid)
        previous: dict[str, Manifest] = {}
        for key, store in stores.items():
            previous[key], first = await checkpoint(store, tar, None)
            b.results[f"sandbox_checkpoint_first_{key}_bytes_uploaded"] = first.bytes_uploaded
        with b.task("sandbox: checkpoints", n) as task:
            for _ in range(n):
                await docker.write_file(cid, "notes", os.urandom(1024))
                start = time.perf_counter()
                tar = await docker.export(cid)
                times["export"].append(time.perf_counter() - start)
                for key, store in stores.items():
                    start = time.perf_counter()
                    previous[key], stats = await checkpoint(store, tar, previous[key])
                    times[key].append(time.perf_counter() - start)
                    if stats.blobs_uploaded != 1:
                        raise RuntimeError(f"one changed file, {stats.blobs_uploaded} blobs")
                    uploaded = max(uploaded, stats.bytes_uploaded)
                cmd = ["tar", "-C", "/workspace", "-cf", "-", "."]
                times["tar"].append(await _timed(lambda: _bare_exec(container, cmd)))  # noqa: B023
                b.progress.advance(task)
    b.results["sandbox_workspace_bytes"] = len(tar)
    for key in stores:
        total = [e + c for e, c in zip(times["export"], times[key], strict=True)]
        where = "a local directory" if key == "local" else "moto's S3 server on 127.0.0.1"
        _show(
            b,
            f"sandbox_checkpoint_{key}",
            total,
            f"sandbox: export + checkpoint, {key} (median / p99)",
            f"10 MB workspace, one new 1 KiB file, to {where}",
        )
        b.results[f"sandbox_checkpoint_only_{key}_median_ms"] = round(median_ms(times[key]), 2)
    export_ms = _show(b, "sandbox_export", times["export"], "sandbox: Docker.export alone")
    _show(b, "sandbox_bare_tar", times["tar"], "sandbox: bare aiodocker exec of `tar -cf -`")
    b.ratio(
        "sandbox_export_vs_bare_tar",
        export_ms,
        "sandbox_bare_tar_median_ms",
        "sandbox: export / bare tar exec",
        "reported, no target",
    )
    b.record(
        "sandbox_checkpoint_bytes_uploaded_max",
        uploaded,
        "sandbox: bytes uploaded per checkpoint, max",
        f"{uploaded:,} B",
        "the new blob and the manifest, as handed to the store",
    )
