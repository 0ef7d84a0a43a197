"""Sandboxes: a container per run, with the workspace its ``bash`` and file tools work in.

Give an agent ``sandbox=Sandbox()`` and its model gets ``bash``, ``read_file``, ``write_file``
and ``list_files``, run by the run's sandbox actor in a hardened container (see
``docs/sandboxes.md``). This package is the vocabulary: the settings, the tools' declarations,
the sandbox actor's messages, events and state, and the workspace-file API; the actor itself and
the Docker layer are in :mod:`toren.actors.sandboxes`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from toren._core.exports import lazy_exports

if TYPE_CHECKING:  # what the names below are, for type checkers (imported lazily at run time)
    from toren.sandboxes._settings import (
        DEFAULT_IMAGE,
        SETTABLE,
        Sandbox,
        allowed,
        configured,
        parse_size,
    )
    from toren.sandboxes._tools import SEND_MAX, is_sandbox_tool, sandbox_tools
    from toren.sandboxes._vocabulary import (
        CHANGES_WORKSPACE,
        SANDBOX_KIND,
        SANDBOX_ROUTE,
        TOOLS,
        WORKSPACE,
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

# Each public name's module, imported on first use by ``__getattr__``: the settings and the
# tools' declarations bring pydantic, which listing sandboxes (``toren jobs show``) does without.
_HOMES: dict[str, tuple[str, ...]] = {
    "toren.sandboxes._settings": (
        "DEFAULT_IMAGE",
        "SETTABLE",
        "Sandbox",
        "allowed",
        "configured",
        "parse_size",
    ),
    "toren.sandboxes._tools": (
        "SEND_MAX",
        "is_sandbox_tool",
        "sandbox_tools",
    ),
    "toren.sandboxes._vocabulary": (
        "CHANGES_WORKSPACE",
        "SANDBOX_KIND",
        "SANDBOX_ROUTE",
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
        "SandboxCreated",
        "SandboxDone",
        "SandboxNotice",
        "SandboxReaped",
        "SandboxRestored",
        "SandboxState",
        "SandboxStopped",
        "WriteFiles",
        "fold",
        "run_of",
        "sandbox_address",
        "summary",
    ),
}


__getattr__, __dir__ = lazy_exports(__name__, _HOMES)
