"""A tool call's first records, made ahead: in the commit of the step before the call's own.

A run records a tool call's intent (``tool.intent``, with its idempotency key) in a commit before
the call's effect can happen, and the effect happens in a step of its own. Nothing happens
outside the run between the step that makes a call pending (the model's answer, the result of
the call before it, a human's approval) and the step that records its intent: so the intent can
be recorded in the first of them, and one commit is saved for every call of a tool with effects
(``write`` or ``external``). The effect still runs in a step after that commit, under the same
key: the key depends on the run, the call and how many identical intents the run recorded
before, all of which are what they would be a step later.

A call that needs a human's decision is asked for in the commit of the model's answer (the run
parks there, not a step later); that is decided in the model step alone, the last thing it does.

Not made ahead, and made by the call's own step as before: a ``read`` tool's intent (the step
that records it runs the tool and records its result with it: ahead, that would widen the
window in which a crash makes the model call again), the built-in durable sleep, a sandboxed call
(its intent is sent to the sandbox with it; the first spawns the sandbox after a read of the
directory, which must not stand between a paid model call and its commit), a cross-agent call,
a call whose arguments do not validate or that was denied (its error result is the next step),
and anything in a step whose activation has not checked its recorded calls against this code
(a step in which those calls may yet be invalidated). Whatever fails in working a call out
ahead (an approval predicate that raises, arguments that cannot be recorded) leaves it to the
call's own step, where it fails as it always did: a model call already paid for is never made
again because its next call could not be worked out.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from toren import Context, durable_sleep
from toren.actors.runs import steps
from toren.runs import (
    Agent,
    ApprovalRequested,
    RunState,
    Tool,
    ToolCall,
    ToolIntended,
    occurrences_of,
)
from toren.sandboxes import WORKSPACE, is_sandbox_tool

log = logging.getLogger("toren.run")


def intent_for(ctx: Context[RunState], call: ToolCall, arguments: dict[str, Any]) -> ToolIntended:
    """The intent of ``call`` with its validated ``arguments``, keyed by the run, the call's
    content and how many identical intents the run recorded before it."""
    occurrence = occurrences_of(ctx.state, call.name, arguments)
    key = steps.idempotency_key(ctx.actor_id, call.name, arguments, occurrence)
    return ToolIntended(call_id=call.id, name=call.name, arguments=arguments, idempotency_key=key)


def approval_request(call: ToolCall, tool: Tool, arguments: dict[str, Any]) -> ApprovalRequested:
    """What a run records when ``call`` waits for a human's decision."""
    return ApprovalRequested(
        call_id=call.id,
        name=call.name,
        arguments=arguments,
        at=time.time(),
        cwd=WORKSPACE if is_sandbox_tool(tool) else None,
    )


def intend(ctx: Context[RunState], agent: Agent | None) -> None:
    """At the end of a step that sends the run on to its next tool call: record that call's
    intent now if it is a call of a tool with effects, needing no decision or approved."""
    found = _next_call(ctx, agent)
    if found is None:
        return
    call, tool, arguments = found
    state = ctx.state
    if is_sandbox_tool(tool) or tool.effects == "read" or tool.fn is durable_sleep.fn:
        return
    try:
        decision = state.decisions.get(call.id)
        if call.id in state.asked or decision is not None:
            # Once asked, the recorded decision governs, whatever the predicate says now.
            if decision is None or not decision.approved:
                return
        elif tool.needs_approval(tool.bind(arguments)):
            return
        intent = intent_for(ctx, call, arguments)
    except Exception:  # the call's own step works it out, and fails, as before
        log.debug("%s: call %s left to its own step", ctx.actor_id, call.id, exc_info=True)
        return
    _emit(ctx, intent)


def ask(ctx: Context[RunState], agent: Agent) -> bool:
    """At the end of a model step that left tool calls pending: if the first needs a human's
    decision, ask for it now (the run parks in this commit). Returns whether it asked."""
    found = _next_call(ctx, agent)
    if found is None:
        return False
    call, tool, arguments = found
    state = ctx.state
    if call.id in state.asked or call.id in state.decisions:
        return False
    if state.working_seconds(time.time()) > agent.wall_clock:
        return False  # the next step fails the run (class timeout) before it would ask
    try:
        if not tool.needs_approval(tool.bind(arguments)):
            return False
        request = approval_request(call, tool, arguments)
    except Exception:  # the call's own step works it out, and fails, as before
        log.debug("%s: call %s left to its own step", ctx.actor_id, call.id, exc_info=True)
        return False
    return _emit(ctx, request)


def _next_call(
    ctx: Context[RunState], agent: Agent | None
) -> tuple[ToolCall, Tool, dict[str, Any]] | None:
    """The run's next tool call, its tool and its validated arguments, if it is a call of one
    of the agent's tools that has no intent yet, in a running run."""
    state = ctx.state
    if agent is None or state.status != "running":
        return None
    pending = state.pending_calls
    if not pending or pending[0].id in state.intents:
        return None
    call = pending[0]
    tool = agent.tool_named(call.name)
    if tool is None:  # a cross-agent call, or an unknown tool
        return None
    try:
        arguments, _ = steps.validated(tool, call)
    except Exception:  # a validator's own error: the call's step meets it again
        log.debug("%s: call %s left to its own step", ctx.actor_id, call.id, exc_info=True)
        return None
    if arguments is None:
        return None
    return call, tool, arguments


def _emit(ctx: Context[RunState], event: ToolIntended | ApprovalRequested) -> bool:
    try:
        ctx.emit(event)
    except (TypeError, ValueError):
        # Not recordable as it is: nothing was recorded (emit encodes before it applies); the
        # call's own step meets it again and fails as before.
        log.debug("%s: %s not recorded ahead", ctx.actor_id, type(event).__name__, exc_info=True)
        return False
    return True
