"""The workspace-file API: read and write files of a run's workspace from outside the run.

Reads come from the workspace's last checkpoint in the store, so they work while the sandbox's
container is stopped, or on a machine without Docker. Writes go through the run's sandbox actor
(``sandbox.write_files``), which writes them into its container and checkpoints: a file written
here is in the next command's workspace, and survives the host like any other.

From inside another actor's handler, send :class:`~toren.sandboxes.WriteFiles` to
:func:`~toren.sandboxes.sandbox_address` instead of asking (a handler does not wait on others).
"""

from __future__ import annotations

import base64
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from toren._core.client import Client
from toren._core.errors import ConfigError, TorenError
from toren._core.rows import actor_row
from toren.sandboxes._vocabulary import WriteFiles, sandbox_address
from toren.sandboxes.checkpoints import list_files, read_file
from toren.sandboxes.store import WorkspaceStore, store_from_url

if TYPE_CHECKING:
    from toren._settings import Settings  # composed above the kinds; only its fields are read

WRITE_MAX = 32 * 1024 * 1024
"""The most bytes one :func:`write_files` call may carry (they travel in one message)."""


class NoWorkspace(TorenError):
    """The run has no sandbox, or its workspace has no checkpoint yet."""


def store_url(settings: Settings) -> str:
    """Where workspaces are checkpointed: ``workspace_store`` (``TOREN_WORKSPACE_STORE``), by
    default a directory under Toren's home (readable on this machine only: use S3 across
    machines)."""
    return settings.workspace_store or str(Path(settings.home) / "workspaces")


def open_store(settings: Settings) -> WorkspaceStore:
    """The workspace store the settings name (close it when done)."""
    return store_from_url(store_url(settings))


async def checkpoint_of(client: Client, run_id: str) -> str:
    """The id of the last checkpoint of ``run_id``'s workspace.

    Raises:
        NoWorkspace: the run has no sandbox, or nothing was checkpointed yet.
    """
    row = await actor_row(client.pool, sandbox_address(run_id), fields=("summary.checkpoint",))
    checkpoint = row.summary_dict.get("checkpoint") if row is not None else None
    if not checkpoint:
        raise NoWorkspace(f"{run_id} has no workspace checkpoint (no sandbox, or nothing written)")
    return str(checkpoint)


async def read_workspace_file(
    client: Client, store: WorkspaceStore, run_id: str, path: str, *, cap: int = 1 << 20
) -> tuple[bytes, int]:
    """The first ``cap`` bytes of a file of the run's workspace (as last checkpointed), and its
    size.

    Raises:
        NoWorkspace: no checkpoint yet.
        toren.sandboxes.checkpoints.WorkspacePathError: the path is outside the workspace, or not
            a file of it.
    """
    return await read_file(store, await checkpoint_of(client, run_id), path, cap)


async def list_workspace(
    client: Client, store: WorkspaceStore, run_id: str, path: str = ""
) -> list[tuple[str, str, int]]:
    """The entries under ``path`` of the run's workspace (as last checkpointed)."""
    return await list_files(store, await checkpoint_of(client, run_id), path, recursive=True)


async def write_files(
    client: Client,
    run_id: str,
    files: Mapping[str, bytes],
    *,
    timeout: float = 60.0,  # noqa: ASYNC109  (the ask's, as Client.ask)
) -> str:
    """Write ``files`` (workspace path -> content) into the run's workspace, through its
    sandbox, and wait for the checkpoint that holds them; returns its id.

    Raises:
        NoWorkspace: the run has no sandbox yet (its first sandboxed call makes one).
        ConfigError: more than :data:`WRITE_MAX` bytes, or a path the sandbox refuses.
        AskTimeout: no worker with Docker answered in time (the write may still happen).
    """
    total = sum(len(v) for v in files.values())
    if total > WRITE_MAX:
        raise ConfigError(f"{total} bytes in one write; at most {WRITE_MAX}")
    address = sandbox_address(run_id)
    if await actor_row(client.pool, address) is None:
        raise NoWorkspace(f"{run_id} has no sandbox yet: its first sandboxed call makes one")
    message = WriteFiles(
        files={p: base64.b64encode(v).decode() for p, v in files.items()},
        request_id=uuid.uuid4().hex,
    )
    answer = await client.ask(address, message, timeout=timeout)
    if not isinstance(answer, dict) or not answer.get("ok"):
        error = answer.get("error") if isinstance(answer, dict) else answer
        raise ConfigError(f"the sandbox refused the write: {error}")
    return str(answer["checkpoint"])
