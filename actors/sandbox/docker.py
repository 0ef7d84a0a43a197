"""The Docker layer of sandboxes: hardened containers, commands that can be found and killed,
the workspace in and out as tar. The only module that talks to Docker (through ``aiodocker``).

INTERFACE STUB: the signatures below are the contract the sandbox actor is written against;
the bodies are being written.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

import attrs

WORKSPACE = "/workspace"
"""Where the workspace is mounted in every sandbox, and every command's working directory."""

LABEL_RUN = "toren.run"
LABEL_SANDBOX = "toren.sandbox"


@attrs.frozen(kw_only=True)
class Limits:
    """What one sandbox may use. Defaults are the hardened ones."""

    memory_bytes: int = 512 * 1024 * 1024
    cpus: float = 1.0
    pids: int = 256
    workspace_bytes: int = 256 * 1024 * 1024
    tmp_bytes: int = 64 * 1024 * 1024
    network: str = "none"  # Docker NetworkMode; anything else lets commands reach networks


@attrs.frozen(kw_only=True)
class Outcome:
    """What is known about one command."""

    state: Literal["finished", "interrupted", "not_started"]
    exit_code: int | None  # None: unknown
    output: str  # stdout and stderr merged, at most the cap (UTF-8, invalid bytes replaced)
    output_bytes: int  # everything the command wrote, counted
    timed_out: bool = False
    oom_killed: bool = False

    @property
    def truncated(self) -> bool:
        return self.output_bytes > len(self.output.encode())


@attrs.frozen(kw_only=True)
class Info:
    """A sandbox container as Docker lists it."""

    container_id: str
    name: str
    run_id: str
    sandbox_id: str
    state: str  # Docker's: created, running, exited, ...
    created: float


class Unavailable(Exception):
    """No Docker daemon answers (or the image is missing): what to do about it is the message."""


class Docker:
    """One aiodocker client per worker process."""

    @classmethod
    async def connect(cls) -> Docker:
        raise NotImplementedError

    async def close(self) -> None:
        raise NotImplementedError

    async def check_image(self, image: str) -> None:
        """Raises Unavailable if ``image`` is not present locally (nothing is ever pulled)."""
        raise NotImplementedError

    async def find(self, run_id: str) -> Info | None:
        raise NotImplementedError

    async def create(
        self, *, name: str, image: str, limits: Limits, labels: Mapping[str, str]
    ) -> str:
        """Create (not start) a hardened container; returns its id."""
        raise NotImplementedError

    async def start(self, container_id: str) -> None:
        """Start it if it is not running (idempotent)."""
        raise NotImplementedError

    async def run(
        self, container_id: str, *, marker: str, command: str, timeout: float, output_cap: int
    ) -> Outcome:
        raise NotImplementedError

    async def recover(self, container_id: str, marker: str) -> Outcome:
        raise NotImplementedError

    async def kill_all(self, container_id: str) -> int:
        raise NotImplementedError

    async def export(self, container_id: str) -> bytes:
        raise NotImplementedError

    async def import_(self, container_id: str, tar: bytes) -> None:
        raise NotImplementedError

    async def read_file(self, container_id: str, path: str, cap: int) -> tuple[bytes, int]:
        raise NotImplementedError

    async def write_file(self, container_id: str, path: str, data: bytes) -> None:
        raise NotImplementedError

    async def list_files(self, container_id: str, path: str) -> list[tuple[str, str, int]]:
        raise NotImplementedError

    async def stop(self, container_id: str) -> None:
        raise NotImplementedError

    async def remove(self, container_id: str) -> None:
        raise NotImplementedError

    async def list(self) -> list[Info]:
        raise NotImplementedError
