"""Sandboxes: a container per run, with the workspace its ``bash`` and file tools work in.

Give an agent ``sandbox=Sandbox()`` and its model gets ``bash``, ``read_file``, ``write_file``
and ``list_files``, run by the run's sandbox actor in a hardened container (see
``docs/sandboxes.md``). This package is the vocabulary: the settings, the tools' declarations,
the sandbox actor's messages, events and state, and the workspace-file API; the actor itself and
the Docker layer are in :mod:`toren.actors.sandbox`.
"""

from toren.sandbox._settings import (
    DEFAULT_IMAGE,
    SETTABLE,
    WORKSPACE,
    Sandbox,
    allowed,
    configured,
    parse_size,
)
from toren.sandbox._tools import SEND_MAX, is_sandbox_tool, sandbox_tools
from toren.sandbox._vocabulary import (
    CHANGES_WORKSPACE,
    SANDBOX_KIND,
    SANDBOX_ROUTE,
    TOOLS,
    Checkpointed,
    Command,
    CommandFinished,
    CommandIntended,
    Exec,
    Go,
    Idle,
    Reap,
    SandboxCreated,
    SandboxDone,
    SandboxNotice,
    SandboxReaped,
    SandboxRestored,
    SandboxState,
    SandboxStopped,
    WriteFiles,
    fold,
    run_of,
    sandbox_address,
    summary,
)

__all__ = [
    "CHANGES_WORKSPACE",
    "DEFAULT_IMAGE",
    "SANDBOX_KIND",
    "SANDBOX_ROUTE",
    "SEND_MAX",
    "SETTABLE",
    "TOOLS",
    "WORKSPACE",
    "Checkpointed",
    "Command",
    "CommandFinished",
    "CommandIntended",
    "Exec",
    "Go",
    "Idle",
    "Reap",
    "Sandbox",
    "SandboxCreated",
    "SandboxDone",
    "SandboxNotice",
    "SandboxReaped",
    "SandboxRestored",
    "SandboxState",
    "SandboxStopped",
    "WriteFiles",
    "allowed",
    "configured",
    "fold",
    "is_sandbox_tool",
    "parse_size",
    "run_of",
    "sandbox_address",
    "sandbox_tools",
    "summary",
]
