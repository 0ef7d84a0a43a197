"""What the run actor's steps are made of besides the actor's own state: the run's limits
(budget, wall clock), the end of a turn or of a cancelled run, a message that came before the
run's start, and a tool call run under its recorded intent (arguments validated, idempotency key,
what the model is told when an at-most-once call may have run).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from typing import Any

import anyio
import pydantic

from toren import Context, LeaseExpired
from toren.actors.runs import calls
from toren.actors.runs.bounds import as_text, error_text, shown
from toren.runs import (
    Agent,
    Cancel,
    RunCompleted,
    RunFailed,
    RunState,
    Say,
    Tool,
    ToolCall,
    ToolContext,
    ToolIntended,
    author,
    canonical,
    final_text,
    receipt,
)

log = logging.getLogger("toren.run")


def idempotency_key(run_id: str, name: str, arguments: dict[str, Any], occurrence: int) -> str:
    """Same run, same tool, same arguments, same count of identical calls before: same key."""
    h = hashlib.sha256(f"{run_id}\0{name}\0{occurrence}\0".encode("utf-8", "surrogatepass"))
    h.update(canonical(arguments).encode("utf-8", "surrogatepass"))
    return h.hexdigest()[:32]


def validated(tool: Tool, call: ToolCall) -> tuple[dict[str, Any] | None, str]:
    """The call's arguments in their recorded (JSON) form, or ``None`` and what is wrong."""
    if call.arguments is None:
        return None, f"arguments for {call.name} are not a JSON object: {shown(call.raw_arguments)}"
    try:
        arguments = tool.validate(call.arguments)
        tool.bind(arguments)  # what is recorded must validate again, or the call could not run
    except pydantic.ValidationError as exc:
        errors = exc.errors(include_url=False, include_input=False, include_context=False)
        return None, f"invalid arguments for {call.name}: {errors}"
    return arguments, ""


def handled_before(ctx: Context[RunState]) -> bool:
    """Whether the message in hand was claimed (or handled) before and its step never
    committed: whatever that step started may have happened."""
    envelope = ctx.envelope
    return envelope is not None and (envelope.deliveries > 1 or envelope.attempts > 0)


def interrupted(name: str) -> str:
    """What the model is told of an at-most-once call that may have run before a crash."""
    return (
        f"{name} was interrupted: the worker running it stopped (a crash or a lost lease) "
        "before its result was recorded. It may or may not have taken effect; it is not run "
        "again by itself (at-most-once). Check its effect before calling it again."
    )


async def run_tool(tool: Tool, ctx: Context[RunState], intent: ToolIntended) -> tuple[str, bool]:
    """Run a tool under its intent's key, with the arguments validated again from their recorded
    form; its failures go back to the model as error results."""
    tctx = ToolContext(
        run_id=ctx.actor_id,
        tool_call_id=intent.call_id,
        idempotency_key=intent.idempotency_key,
        fencing_token=ctx.epoch,
        ensure_lease=ctx.ensure_lease,
    )
    try:
        arguments = tool.bind(intent.arguments)
    except pydantic.ValidationError as exc:
        errors = exc.errors(include_url=False, include_input=False, include_context=False)
        return f"the recorded arguments no longer fit {tool.name}: {errors}", True
    try:
        with anyio.fail_after(tool.timeout):
            result = await tool.fn(tctx, **arguments)
        return as_text(result), False
    except TimeoutError:
        return f"{tool.name} timed out after {tool.timeout:g}s", True
    except Exception as exc:  # noqa: BLE001  (a tool's failure is the model's to handle)
        return f"{tool.name} failed: {error_text(exc)}", True
    except asyncio.CancelledError as exc:
        task = asyncio.current_task()
        if task is None or task.cancelling():
            raise  # the worker stops the run: not the tool's failure
        return f"{tool.name} failed: {error_text(exc)} (a cancellation it did not own)", True
    except BaseExceptionGroup as group:
        lease = group.subgroup(LeaseExpired)
        if lease is not None:
            raise lease.exceptions[0] from group
        task = asyncio.current_task()
        if group.subgroup(asyncio.CancelledError) is not None and task and task.cancelling():
            raise
        return f"{tool.name} failed: {error_text(group)}", True


def over_budget(ctx: Context[RunState], agent: Agent) -> bool:
    """Fail the run (class ``budget``) if it and its child runs spent more than it may."""
    left = calls.budget_left(ctx.state, agent)
    if left is None or left >= 0:
        return False
    spent = receipt(ctx.state).usd_total
    ctx.emit(
        RunFailed(
            error_class="budget",
            message=f"spent ${spent:.4f} (child runs included), over the budget of "
            f"${spent + left:.4f}",
        )
    )
    return True


def over_time(ctx: Context[RunState], agent: Agent) -> bool:
    """Fail the run (class ``timeout``) if it worked longer than its wall-clock budget."""
    worked = ctx.state.working_seconds(time.time())
    if worked <= agent.wall_clock:
        return False
    ctx.emit(
        RunFailed(
            error_class="timeout",
            message=f"worked {worked:.0f}s, over the wall-clock budget of "
            f"{agent.wall_clock:g}s (time parked on approvals not counted)",
        )
    )
    return True


def end_turn(ctx: Context[RunState], agent: Agent) -> None:
    """The model's answer asks for nothing: it ends the turn in the commit that records it, so
    that a message arriving next starts a new turn after this one, whose answer is out."""
    if not over_time(ctx, agent):
        ctx.emit(RunCompleted(output=final_text(ctx.state.calls[-1].response), at=time.time()))


def after_the_start(ctx: Context[RunState], msg: Say) -> None:
    """A message handled before the run's start (a say() right after start_run: the system lane
    is taken first) is sent again, behind the start, so that it is heard after the input. Sent
    again once only: one that comes back before the start has no start ahead of it (a run made
    without one) and is dropped, logged, rather than sent round for ever."""
    if ctx.sender == ctx.actor_id:
        log.warning("%s: a message waited for a start that never came; dropped", ctx.actor_id)
        return
    ctx.send(ctx.actor_id, msg)


def cancelled(msg: Cancel, *, also: str = "") -> RunFailed:
    """How a run ends on ``msg``: class ``cancelled``, by whom and why."""
    reason = f": {msg.reason}" if msg.reason else ""
    return RunFailed(
        error_class="cancelled", message=f"cancelled by {author(msg)[0]}{reason}{also}", by=msg.by
    )
