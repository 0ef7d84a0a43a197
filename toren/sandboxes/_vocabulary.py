"""A sandbox actor's vocabulary: the messages it takes and sends, the events it records, and its
state (the fold of those events).

One sandbox per run (kind ``toren.sandbox``, address ``sandbox/<run uuid>``), spawned by the
run as its child, routed only to workers that have Docker. Its journal says what happened to the
container and to each command:

- ``sandbox.created``: a container was made for the run (or an existing one adopted by label);
- ``command.intended``: a command is about to run; recorded before it can start;
- ``command.finished``: what is known of it (finished, or interrupted by a crash), with the
  checkpoint of the workspace it left;
- ``workspace.checkpointed``: the workspace's content, content-addressed in the store;
- ``sandbox.stopped`` (idle), ``sandbox.restored`` (a new container from a checkpoint),
  ``sandbox.reaped`` (container removed; the checkpoints stay).
"""

from __future__ import annotations

from typing import Any, Literal

import attrs
from pyrsistent import PMap, PSet, pmap, pset

from toren._core.codec import message

SANDBOX_KIND = "toren.sandbox"
SANDBOX_ROUTE = "sandbox"
"""The route sandbox actors are claimed on: served only by workers that have Docker."""
WORKSPACE = "/workspace"
"""The workspace in every sandbox, and every command's working directory."""


def sandbox_address(run_id: str) -> str:
    """The sandbox actor of run ``run_id`` (``run/<uuid>`` -> ``sandbox/<uuid>``)."""
    return "sandbox/" + run_id.removeprefix("run/")


def run_of(sandbox_id: str) -> str:
    """The run a sandbox actor belongs to."""
    return "run/" + sandbox_id.removeprefix("sandbox/")


Tool = Literal["bash", "read_file", "write_file", "list_files", "send_file"]
TOOLS: tuple[str, ...] = ("bash", "read_file", "write_file", "list_files", "send_file")
CHANGES_WORKSPACE = frozenset({"bash", "write_file"})

# --- messages -------------------------------------------------------------------------------


@message("sandbox.exec")
@attrs.frozen(kw_only=True)
class Exec:
    """Run one tool call of the run in its sandbox; answered with :class:`SandboxDone`."""

    call_id: str
    tool: str
    arguments: dict[str, Any]
    rerunnable: bool = False


@message("sandbox.go")
@attrs.frozen(kw_only=True)
class Go:
    """Sent by the sandbox to itself once a command's intent is recorded: run it now."""

    call_id: str


@message("sandbox.idle")
@attrs.frozen(kw_only=True)
class Idle:
    """A timer: the sandbox has had no command since ``commands`` of them; stop it if so."""

    commands: int


@message("sandbox.reap")
@attrs.frozen
class Reap:
    """The run ended: remove the container (the checkpoints stay)."""


@message("sandbox.write_files")
@attrs.frozen(kw_only=True)
class WriteFiles:
    """Write files into the workspace from outside the run (a channel's inbound file), then
    checkpoint. ``files`` maps workspace paths to base64 content."""

    files: dict[str, str]
    request_id: str


@message("run.sandbox_done")
@attrs.frozen(kw_only=True)
class SandboxDone:
    """A sandboxed tool call's result, told to its run."""

    call_id: str
    content: str
    is_error: bool = False
    checkpoint: str | None = None
    fatal: bool = False  # no sandbox can run here (no image, no Docker): the run fails (config)


@message("run.sandbox_notice")
@attrs.frozen(kw_only=True)
class SandboxNotice:
    """Something the run should show about its sandbox (recreated from a checkpoint)."""

    text: str


# --- events ---------------------------------------------------------------------------------


@message("sandbox.created")
@attrs.frozen(kw_only=True)
class SandboxCreated:
    container_id: str
    name: str
    image: str
    worker: str = ""
    adopted: bool = False  # it existed already (made by a step that did not commit)
    at: float = 0.0


@message("sandbox.restored")
@attrs.frozen(kw_only=True)
class SandboxRestored:
    """The workspace was put back from a checkpoint (a new container, or one started again)."""

    container_id: str
    checkpoint: str
    files: int
    at: float = 0.0


@message("command.intended")
@attrs.frozen(kw_only=True)
class CommandIntended:
    call_id: str
    tool: str
    arguments: dict[str, Any]
    marker: str
    rerunnable: bool = False
    at: float = 0.0


@message("command.finished")
@attrs.frozen(kw_only=True)
class CommandFinished:
    call_id: str
    state: str  # finished, interrupted, refused
    exit_code: int | None
    content: str  # what the run's model is told
    is_error: bool
    output_bytes: int = 0
    timed_out: bool = False
    oom_killed: bool = False
    checkpoint: str | None = None
    seconds: float = 0.0
    marker: str = ""  # the marker it ran under (a rerunnable command run again has its own)
    at: float = 0.0


@message("workspace.checkpointed")
@attrs.frozen(kw_only=True)
class Checkpointed:
    checkpoint: str
    files: int
    bytes: int
    uploaded_bytes: int
    blobs_uploaded: int
    at: float = 0.0


@message("sandbox.stopped")
@attrs.frozen(kw_only=True)
class SandboxStopped:
    reason: str
    at: float = 0.0


@message("sandbox.reaped")
@attrs.frozen(kw_only=True)
class SandboxReaped:
    at: float = 0.0


# --- state ----------------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class Command:
    intent: CommandIntended
    finished: CommandFinished | None = None


@attrs.frozen(kw_only=True)
class SandboxState:
    """The fold of a sandbox's journal."""

    container_id: str | None = None
    name: str = ""
    status: str = "new"  # new, running, stopped, reaped
    commands: PMap[str, Command] = attrs.field(factory=pmap)
    open: PSet[str] = attrs.field(factory=pset)  # intended, not finished
    checkpoint: str | None = None
    checkpoints: int = 0
    uploaded_bytes: int = 0
    finished: int = 0


def fold(state: SandboxState, event: Any) -> SandboxState:
    """The state after ``event`` (pure: replay calls it for every journaled event)."""
    if isinstance(event, SandboxCreated):
        return attrs.evolve(
            state, container_id=event.container_id, name=event.name, status="running"
        )
    if isinstance(event, SandboxRestored):
        return attrs.evolve(state, container_id=event.container_id, status="running")
    if isinstance(event, CommandIntended):
        if event.call_id in state.commands:
            return state
        return attrs.evolve(
            state,
            commands=state.commands.set(event.call_id, Command(intent=event)),
            open=state.open.add(event.call_id),
        )
    if isinstance(event, CommandFinished):
        known = state.commands.get(event.call_id)
        if known is None or known.finished is not None:
            return state
        return attrs.evolve(
            state,
            commands=state.commands.set(event.call_id, attrs.evolve(known, finished=event)),
            open=state.open.discard(event.call_id),
            finished=state.finished + 1,
        )
    if isinstance(event, Checkpointed):
        return attrs.evolve(
            state,
            checkpoint=event.checkpoint,
            checkpoints=state.checkpoints + 1,
            uploaded_bytes=state.uploaded_bytes + event.uploaded_bytes,
        )
    if isinstance(event, SandboxStopped):
        return attrs.evolve(state, status="stopped")
    if isinstance(event, SandboxReaped):
        return attrs.evolve(state, status="reaped", container_id=None)
    return state


def summary(state: SandboxState) -> dict[str, Any]:
    """The sandbox's row summary (``toren sandboxes list``, the workspace-file API)."""
    return {
        "status": state.status,
        "container_id": state.container_id,
        "name": state.name,
        "commands": len(state.commands),
        "finished": state.finished,
        "checkpoint": state.checkpoint,
        "checkpoints": state.checkpoints,
        "uploaded_bytes": state.uploaded_bytes,
    }
