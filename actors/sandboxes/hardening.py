"""What a sandbox container may do: the hardened configuration every sandbox is created with.

Every container runs the image's numeric non-root user with no capabilities, no new privileges,
Docker's default seccomp profile, a read-only root, no network (``Limits.network``), a PID limit,
a memory limit without swap, a CPU quota and two size-limited tmpfs: ``/tmp`` (noexec) and
``/workspace``. The workspace is a tmpfs because its size cap must work on any Docker storage
driver (Debian's docker.io runs overlay2 without quotas); it lives only as long as the container,
and the sandbox actor makes it durable with checkpoints (``export``/``import_``). tmpfs pages are
charged to the container's memory cgroup: files in /workspace and /tmp count against
``memory_bytes``. Nothing of the worker's is inside: no environment but ``HOME=/tmp``, no host
path, no Docker socket.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

WORKSPACE = "/workspace"
"""Where the workspace is mounted in every sandbox, and every command's working directory."""
RECORDS = "/run/toren"
"""Where commands' records live: a tmpfs of its own, so a full /tmp costs no command its record."""


@attrs.frozen(kw_only=True)
class Limits:
    """What one sandbox may use. Defaults are the hardened ones."""

    memory_bytes: int = 512 * 1024 * 1024  # no swap; the tmpfs contents count against it
    cpus: float = 1.0
    pids: int = 256
    workspace_bytes: int = 256 * 1024 * 1024
    tmp_bytes: int = 64 * 1024 * 1024
    # the commands' records (their capped output) live apart from /tmp, which commands fill
    records_bytes: int = 16 * 1024 * 1024
    network: str = "none"  # Docker NetworkMode; anything else lets commands reach networks


def hardened_config(
    *,
    image: str,
    uid: int,
    gid: int,
    limits: Limits,
    labels: Mapping[str, str],
    overrides: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The configuration of a sandbox container running ``image`` as ``uid:gid``.

    ``overrides`` is for tests and their control runs only: its keys replace those of the
    container's config, except ``HostConfig``, whose keys replace the hardened ones one by one.
    """
    memory = limits.memory_bytes
    config: dict[str, Any] = {
        "Image": image,
        "User": f"{uid}:{gid}",
        # The image's environment stays (PATH, LANG); none of the worker's is added.
        "Env": ["HOME=/tmp"],
        "Entrypoint": ["sleep"],
        "Cmd": ["infinity"],
        "WorkingDir": WORKSPACE,
        "Labels": dict(labels),
        "HostConfig": {
            "NetworkMode": limits.network,
            "CapDrop": ["ALL"],
            "SecurityOpt": ["no-new-privileges"],  # and Docker's default seccomp profile
            "Privileged": False,
            "ReadonlyRootfs": True,
            "Tmpfs": {  # the container's own /tmp, not the host's
                "/tmp": f"rw,noexec,nosuid,nodev,size={limits.tmp_bytes}",  # noqa: S108
                RECORDS: (
                    f"rw,noexec,nosuid,nodev,size={limits.records_bytes},"
                    f"uid={uid},gid={gid},mode=1777"
                ),
                WORKSPACE: (
                    f"rw,exec,nosuid,nodev,size={limits.workspace_bytes},"
                    f"uid={uid},gid={gid},mode=0755"
                ),
            },
            "Binds": [],
            "Mounts": [],
            "PidsLimit": limits.pids,
            "Memory": memory,
            "MemorySwap": memory,
            "NanoCpus": round(limits.cpus * 1e9),
            "IpcMode": "private",
            "Init": True,
            "AutoRemove": False,
            "RestartPolicy": {"Name": "no"},
            "Ulimits": [{"Name": "core", "Soft": 0, "Hard": 0}],
        },
    }
    for key, value in (overrides or {}).items():
        config[key] = {**config[key], **value} if key == "HostConfig" else value
    return config
