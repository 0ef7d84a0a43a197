"""The run's side of its sandbox: sending sandboxed tool calls, taking their results, reaping.

A run of an agent with ``sandbox=Sandbox(...)`` sends each call of ``bash``, ``read_file``,
``write_file`` and ``list_files`` to its sandbox actor (``sandbox/<run uuid>``), spawning it with
the first, in the same commit as the call's intent. The run then waits (no lease, no task) for
``run.sandbox_done``, which it records as the call's ``tool.result`` with the workspace's
checkpoint. The sandbox never runs a call twice: a call sent again (after a retry of the run)
is answered from its journal.

No live worker with Docker means no sandbox can ever start: the run fails at once with class
``config`` and says how to get one, instead of waiting for a worker that may never come.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from toren import ChildFailed, Context
from toren.directory import directory_of
from toren.runs import (
    ENDED,
    Agent,
    RunFailed,
    RunState,
    SandboxFailed,
    SandboxNoted,
    SandboxRequested,
    ToolCall,
    ToolIntended,
)
from toren.sandboxes import (
    SANDBOX_KIND,
    SANDBOX_ROUTE,
    Exec,
    Reap,
    SandboxDone,
    SandboxNotice,
    sandbox_address,
)

Result = Callable[[str, str, bool, str | None], None]  # call id, content, is_error, checkpoint

NO_DOCKER = (
    "this agent's tools run in a sandbox, and no live worker has Docker: start a worker on a "
    "machine with a Docker daemon it can reach (`apt-get install docker.io`, then `dockerd`) "
    "and the sandbox image (`scripts/sandbox-image`); the worker's log says at boot whether "
    "sandboxes are available there. See docs/sandboxes.md"
)


async def send(
    ctx: Context[RunState],
    agent: Agent,
    call: ToolCall,
    intent: ToolIntended,
    record: Result,
) -> None:
    """Send a sandboxed call (its intent recorded in this step) to the run's sandbox, spawning
    it with the first call; or fail the run (class ``config``) if no worker has Docker."""
    state = ctx.state
    if call.id in state.sandbox_waiting:
        return  # sent; its result comes as run.sandbox_done
    if state.sandbox_failed is not None:
        record(call.id, state.sandbox_failed, True, None)
        return
    address = sandbox_address(ctx.actor_id)
    if not state.sandbox:
        if not await directory_of(ctx).route_served(SANDBOX_ROUTE):
            ctx.emit(RunFailed(error_class="config", message=NO_DOCKER))
            return
        settings = agent.sandbox
        if settings is None:  # a sandbox tool on an agent without one: not constructible
            ctx.emit(RunFailed(error_class="config", message=f"{agent.name} has no sandbox"))
            return
        args = {"run": ctx.actor_id, "settings": settings.as_args()}
        if state.forked is not None and state.forked.checkpoint:
            # A fork's workspace starts as its source's was at the step it was forked from.
            args["checkpoint"] = state.forked.checkpoint
        ctx.spawn(SANDBOX_KIND, address, args, route=SANDBOX_ROUTE)
    ctx.emit(SandboxRequested(call_id=call.id, sandbox=address, at=time.time()))
    rerunnable = bool(agent.sandbox and agent.sandbox.rerunnable)
    ctx.send(
        address,
        Exec(call_id=call.id, tool=call.name, arguments=intent.arguments, rerunnable=rerunnable),
    )


def done(ctx: Context[RunState], msg: SandboxDone, record: Result) -> None:
    """Record a sandboxed call's result, if the run still waits for it (a result that comes
    after the run ended is kept by the sandbox and sent again if the run is retried)."""
    state = ctx.state
    if msg.call_id not in state.sandbox_waiting or msg.call_id in state.results:
        return
    if state.status in ENDED:
        return
    record(msg.call_id, msg.content, msg.is_error, msg.checkpoint)
    if msg.fatal:
        ctx.emit(RunFailed(error_class="config", message=msg.content[:2000]))


def noted(ctx: Context[RunState], msg: SandboxNotice) -> None:
    if ctx.state.sandbox:
        ctx.emit(SandboxNoted(text=msg.text[:2000], at=time.time()))


def crashed(ctx: Context[RunState], msg: ChildFailed, record: Result) -> bool:
    """The kernel gave up on the run's sandbox: the calls waiting on it get error results.
    Returns whether ``msg`` was about the sandbox."""
    state = ctx.state
    if msg.actor_id != state.sandbox:
        return False
    error = f"the sandbox failed and was given up on: {msg.error[:2000]}"
    ctx.emit(SandboxFailed(error=error, at=time.time()))
    if state.status not in ENDED:
        for call_id in sorted(state.sandbox_waiting):
            if call_id not in ctx.state.results:
                record(call_id, error, True, None)
    return True


def after_step(ctx: Context[RunState], was_live: bool) -> None:
    """A run that ended in this step has its sandbox's container removed (its checkpoints
    stay: a retried or continued run gets its workspace back)."""
    state = ctx.state
    if was_live and state.sandbox and state.status in ENDED:
        ctx.send(state.sandbox, Reap())
