"""Real Docker for the sandbox tests.

``docker``: a session-wide :class:`Docker` whose daemon answers and whose default image is built.
Without them a test skips with the reason printed, except under ``CI=true``, where it fails: CI
must run every sandbox test. Import the fixture into a test module as ``docker_fixture`` (its
name stays ``docker``, and no parameter shadows an import); ``raw_docker_fixture`` likewise.

``sandbox(docker, limits, ...)``: a throwaway hardened container, named ``toren-test-...``,
started, and removed whatever happens in the ``async with`` block.

``committed(docker, ...)``: a throwaway image made from the default one (a command run as root in
a container without network, then ``docker commit``), removed afterwards: how tests get images
the build script must not make (a setuid program, a root user).
"""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any, NoReturn

import aiodocker
import anyio
import pytest

from toren.actors.sandboxes.docker import (
    BUILD_HINT,
    DEFAULT_IMAGE,
    LABEL_RUN,
    LABEL_SANDBOX,
    Docker,
    Unavailable,
)
from toren.actors.sandboxes.hardening import Limits

PREFIX = "toren-test-"


def unavailable(reason: str, what: str = "sandbox") -> NoReturn:
    """Skip the test (printing why), or fail it when CI=true: CI skips no Docker test."""
    if os.environ.get("CI") == "true":
        pytest.fail(f"CI=true and {what} tests cannot run: {reason}", pytrace=False)
    print(f"{what} tests skipped: {reason}")
    pytest.skip(reason)


@pytest.fixture(name="docker")
async def docker_fixture() -> AsyncIterator[Docker]:
    """The session's Docker, with the default sandbox image present."""
    try:
        client = await Docker.connect()
    except Unavailable as error:
        unavailable(str(error))
    try:
        try:
            await client.check_image(DEFAULT_IMAGE)
        except Unavailable as error:
            unavailable(f"{error} ({BUILD_HINT} builds it in about a minute, then seconds)")
        yield client
    finally:
        await client.close()


docker = docker_fixture  # the older import name


@pytest.fixture(name="raw_docker")
async def raw_docker_fixture(docker: Docker) -> AsyncIterator[aiodocker.Docker]:
    """A plain aiodocker client, to look at containers as Docker sees them."""
    client = aiodocker.Docker()
    try:
        yield client
    finally:
        await client.close()


@contextlib.asynccontextmanager
async def sandbox(
    docker: Docker,
    limits: Limits | None = None,
    *,
    image: str = DEFAULT_IMAGE,
    overrides: Mapping[str, Any] | None = None,
    start: bool = True,
) -> AsyncIterator[str]:
    """A hardened container (``overrides`` loosen it for control runs); removed afterwards."""
    name = PREFIX + uuid.uuid4().hex[:12]
    container = await docker.create(
        name=name,
        image=image,
        limits=limits or Limits(),
        labels={LABEL_RUN: f"test-{name}", LABEL_SANDBOX: name},
        overrides=overrides,
    )
    try:
        if start:
            await docker.start(container)
        yield container
    finally:
        with anyio.CancelScope(shield=True):
            await docker.remove(container)


@contextlib.asynccontextmanager
async def committed(
    docker: Docker, *, as_root: str = "true", changes: Sequence[str] = ()
) -> AsyncIterator[str]:
    """An image made from the default one by ``as_root`` (a shell command run as root, no
    network) and Dockerfile ``changes``; removed afterwards."""
    tag = PREFIX + uuid.uuid4().hex[:12]
    root = {"User": "0:0", "HostConfig": {"ReadonlyRootfs": False}}
    async with sandbox(docker, overrides=root) as container:
        outcome = await docker.run(
            container, marker="prepare", command=as_root, timeout=60, output_cap=4096
        )
        assert outcome.exit_code == 0, outcome.output
        await docker.forget(container, "prepare")
        client = aiodocker.Docker()
        try:
            await client.containers.container(container).commit(
                repository=tag, tag="latest", changes=list(changes)
            )
        finally:
            await client.close()
    try:
        yield f"{tag}:latest"
    finally:
        with anyio.CancelScope(shield=True):
            client = aiodocker.Docker()
            try:
                await client.images.delete(f"{tag}:latest", force=True)
            finally:
                await client.close()
