"""Cross-agent calls: a run of agent A asks agent B, as a tool call that starts a child run.

Consent is mutual: A lists B in ``calls`` and B lists A in ``accepts``. A's model sees one tool
per callee, ``call_<B>(input)``, described by B's ``description`` (never B's system prompt). A
call is checked when it is made, against the cards live workers publish for B (B may run in
another worker's app): no live worker runs B, one of them does not accept A, B is already in the
chain of runs above (a cycle), or the chain is as deep as it may go: the model gets an error
result saying so, and no child is started. A chain of calls (counted from the run that started
it, 0 deep) never goes deeper than the smallest ``max_call_depth`` of the agents in it: each
child's start carries that limit down (``depth_limit``), so a run decides from its own journal,
and a run below never calls deeper than a run above it allows.

Otherwise, in one commit, the run records ``child.started``, creates the child run and sends it
its start (so a crash never starts two: a parent that recorded ``child.started`` only waits, one
that did not has created nothing); the child's id is derived from the parent, the call and the
parent's attempt, so a step repeated before its commit names the same child and a retried parent
whose child failed starts a new one. Then the parent parks: no lease, no task, no memory, until
the child tells it that it ended. The child's output, or its failure with its class, is the
call's result; what the child cost (its own calls and its
children's) counts in the parent's receipt and budget. The child's dollar budget is the smaller
of its own and what the parent has left. When a parent fails (cancelled, out of budget, out of
time), the children it waits on are cancelled. A child asking a human for a decision tells its
parent, whose timeline shows it.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from decimal import Decimal
from typing import Any

import attrs

from toren import Agent, Context, Principal
from toren.actors.runs.bounds import cut_result, shown
from toren.directory import Directory, directory_of
from toren.kernel import kill_point
from toren.runs import (
    ENDED,
    MESSAGE_CAP,
    RUN_KIND,
    TOOL_RESULT_CAP,
    Agents,
    ApprovalRequested,
    CalleesDescribed,
    Cancel,
    ChildApprovalRequested,
    ChildAsked,
    ChildEnded,
    ChildFinished,
    ChildStarted,
    RunCompleted,
    RunFailed,
    RunState,
    StartRun,
    ToolCall,
    ToolSpec,
    agent_route,
    agents_of,
    call_tool_name,
    receipt,
)
from toren.runs.limits import child_limits

_NAMESPACE = uuid.UUID("0b8e2f5c-51d4-4c57-8f0e-6d3a2b9c7e11")

INPUT_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "input": {"type": "string", "description": "What to ask the agent, in full."},
    },
    "required": ["input"],
    "additionalProperties": False,
}

Result = Callable[[str, str, bool], None]
"""Records a call's result: ``(call_id, content, is_error)``."""


def callee_for(agent: Agent, tool_name: str) -> str | None:
    """The agent a ``call_<name>`` tool of ``agent`` stands for, if it is one."""
    return next((n for n in agent.calls if call_tool_name(n) == tool_name), None)


def callee_tools(agent: Agent, callees: dict[str, str] | Any) -> tuple[ToolSpec, ...]:
    """The tools ``agent``'s model sees for the agents it may call, described as recorded."""
    return tuple(
        ToolSpec(
            name=call_tool_name(name),
            description=callees.get(name) or _undescribed(name),
            input_schema=INPUT_SCHEMA,
        )
        for name in agent.calls
    )


def _undescribed(name: str) -> str:
    return f"Ask the agent {name!r} (it has published no description)."


async def describe(ctx: Context[RunState], agent: Agent) -> None:
    """Record how the agents ``agent`` may call are described, for those not described yet
    (one read of the cards live workers publish)."""
    missing = [n for n in agent.calls if n not in ctx.state.callees]
    if not missing:
        return
    found: dict[str, str] = {}
    for name in missing:
        cards = await directory_of(ctx).published(name)
        found[name] = next((c.description for c in cards if c.description), "") or (
            _undescribed(name)
        )
    ctx.emit(CalleesDescribed(descriptions=found))


def result_cap(agent: Agent | None) -> int:
    """The bytes a tool result may hold: the agent's cap, or the default for a run whose agent
    this worker does not load."""
    return agent.max_tool_result_bytes if agent is not None else TOOL_RESULT_CAP


def child_run_id(parent: str, call_id: str, attempt: int) -> str:
    """The child run a call starts: the same for the same parent, call and attempt."""
    key = "\0".join((parent, call_id, str(attempt)))
    return f"run/{uuid.uuid5(_NAMESPACE, key)}"


def budget_left(state: RunState, agent: Agent) -> Decimal | None:
    """What the run may still spend (its own budget, or the one its parent gave it, whichever
    is smaller, less what it and its children spent); ``None``: unlimited."""
    limits = [Decimal(str(agent.budget_usd))] if agent.budget_usd is not None else []
    if state.budget_cap is not None:
        limits.append(state.budget_cap)
    if not limits:
        return None
    return min(limits) - receipt(state).usd_total


def principal(ctx: Context[RunState]) -> Principal:
    """The run as the principal of what it causes in other runs."""
    return Principal(kind="run", id=ctx.actor_id, name=ctx.state.agent, via="agent-call")


def depth_limit(state: RunState, agent: Agent) -> int:
    """How deep the chain this run is in may go: the smallest ``max_call_depth`` of its agent
    and of the agents above it (as its start recorded them; a start recorded by an earlier
    version carries none, and only the run's own agent's limit counts)."""
    if state.depth_limit is None:
        return agent.max_call_depth
    return min(agent.max_call_depth, state.depth_limit)


def depth_refusal(state: RunState, agent: Agent) -> str | None:
    """Why a run of ``agent`` may call no further down the chain (counted from the run that
    started it, 0 deep), or ``None``: a call would go past :func:`depth_limit`."""
    deep = len(state.chain)
    limit = depth_limit(state, agent)
    if deep < limit:
        return None
    if limit == agent.max_call_depth:
        return (
            f"refused: this run is {deep} call(s) deep and {agent.name!r} may call "
            f"at most {limit} deep (max_call_depth)"
        )
    path = " -> ".join((*state.chain, agent.name))
    return (
        f"refused: this run is {deep} call(s) deep and the chain above it ({path}) may go at "
        f"most {limit} deep (the smallest max_call_depth in it)"
    )


async def refusal(directory: Directory, state: RunState, agent: Agent, callee: str) -> str | None:
    """Why ``agent`` may not call ``callee`` now, or ``None``."""
    chain = (*state.chain, agent.name)
    if callee in chain:
        path = " -> ".join((*chain, callee))
        return f"refused: calling {callee!r} would make a cycle ({path})"
    too_deep = depth_refusal(state, agent)
    if too_deep is not None:
        return too_deep
    cards = await directory.published(callee)
    if not cards:
        return f"refused: no live worker runs an agent named {callee!r}"
    for card in cards:
        if agent.name not in card.accepts:
            return (
                f"refused: {callee!r} does not accept calls from {agent.name!r} "
                "(its accepts list must name the caller; consent is mutual)"
            )
    return None


async def call_step(
    ctx: Context[RunState], agent: Agent, call: ToolCall, callee: str, result: Result
) -> None:
    """The next unit of work of a call to ``callee``: start its child run, or (started) wait."""
    state = ctx.state
    attempt_id = child_run_id(ctx.actor_id, call.id, state.retries)
    started = state.children.get(call.id)
    if started is not None:
        ended = state.finished.get(started.run_id)
        if ended is None:
            return  # parked: the child's end resumes the run
        if ended.status == "completed" or started.run_id == attempt_id:
            # It ended while this run could not take the result (it had failed): take it now.
            result(call.id, _result_text(ended.status, callee, ended), ended.status != "completed")
            return
        # Its child failed and this run was retried since: a new attempt gets a new child.
    text = call.arguments.get("input") if isinstance(call.arguments, dict) else None
    if not isinstance(text, str) or not text.strip() or set(call.arguments or {}) != {"input"}:
        result(call.id, f"{call.name} takes one argument, input: a non-empty text", True)
        return
    if len(text.encode("utf-8", "surrogatepass")) > MESSAGE_CAP:
        result(call.id, f"{call.name}: the input is over {MESSAGE_CAP} bytes", True)
        return
    why = await refusal(directory_of(ctx), state, agent, callee)
    if why is not None:
        result(call.id, why, True)
        return
    left = budget_left(state, agent)
    if left is not None and left <= 0:
        result(call.id, f"refused: no budget left for a call to {callee!r}", True)
        return
    kill_point("child.starting")
    ctx.spawn(
        RUN_KIND,
        attempt_id,
        {"agent": callee, "parent": ctx.actor_id},
        route=agent_route(callee),
        limits=child_limits(agents_of(ctx).named(callee), callee),
    )
    ctx.send(
        attempt_id,
        StartRun(
            agent=callee,
            input=text,
            by=principal(ctx),
            parent=ctx.actor_id,
            parent_call=call.id,
            chain=(*state.chain, agent.name),
            budget_usd=str(left) if left is not None else None,
            depth_limit=depth_limit(state, agent),
        ),
        dedupe_key="start",
    )
    ctx.emit(ChildStarted(call_id=call.id, run_id=attempt_id, agent=callee, at=time.time()))


def refused_start(agents: Agents, msg: StartRun) -> str | None:
    """Why the callee refuses a start from a caller it does not accept (consent is checked at
    call time against published cards; the callee checks again with its own definition), or
    ``None`` (not a child run, or accepted; an agent not loaded here fails the run later)."""
    if not msg.parent:
        return None
    agent = agents.named(msg.agent)
    caller = msg.chain[-1] if msg.chain else ""
    if agent is None or caller in agent.accepts:
        return None
    return (
        f"{agent.name!r} does not accept calls from {caller!r} (its accepts list must name the "
        "caller; consent is mutual)"
    )


def _result_text(status: str, callee: str, ended: ChildEnded | ChildFinished) -> str:
    if status == "completed":
        return ended.output
    return f"the agent {callee!r} failed (class {ended.error_class}): {shown(ended.error or '')}"


def child_ended(
    ctx: Context[RunState], agent: Agent | None, msg: ChildEnded, result: Result
) -> None:
    """A child run ended: count what it cost, and (if this run waits for it) its output or
    failure is the call's result."""
    state = ctx.state
    started = state.children.get(msg.call_id)
    if started is None or started.run_id != msg.run_id or msg.run_id in state.finished:
        return  # not a child this run waits for, or its end was already taken
    output, _ = cut_result(msg.output, result_cap(agent))
    ctx.emit(
        ChildFinished(
            call_id=msg.call_id,
            run_id=msg.run_id,
            agent=msg.agent,
            status=msg.status,
            output=output if msg.status == "completed" else "",
            error_class=msg.error_class,
            error=(msg.error or "")[:2000] if msg.status != "completed" else None,
            usd_paid=msg.usd_paid,
            calls_made=msg.calls_made,
            input_tokens=msg.input_tokens,
            output_tokens=msg.output_tokens,
            unpriced_calls=msg.unpriced_calls,
            lost_calls=msg.lost_calls,
            lost_usd=msg.lost_usd,
            at=time.time(),
        )
    )
    kill_point("child.finished")
    if ctx.state.status not in ENDED and msg.call_id not in ctx.state.results:
        result(msg.call_id, _result_text(msg.status, msg.agent, msg), msg.status != "completed")


def child_asked(ctx: Context[RunState], msg: ChildAsked) -> None:
    """A run below this one waits for a human: show it on this run's timeline, and tell this
    run's own parent (only while this run waits on the child it came through)."""
    state = ctx.state
    started = state.children.get(msg.call_id)
    if state.status in ENDED or started is None or started.run_id not in state.running:
        return  # a child whose end this run took (retried by hand since): not its business
    ctx.emit(
        ChildApprovalRequested(
            call_id=msg.call_id,
            run_id=msg.run_id,
            agent=msg.agent,
            child_call_id=msg.child_call_id,
            name=msg.name,
            arguments=msg.arguments,
            at=time.time(),
        )
    )
    if state.parent:
        ctx.send(state.parent, attrs.evolve(msg, call_id=state.parent_call))


def after_step(ctx: Context[RunState], was_running: list[ChildStarted]) -> None:
    """What a step that ended the run, or asked a human, tells the runs around it: the parent
    learns of the child's end (and of its approvals); children still running when the run
    failed or was cancelled are cancelled."""
    state = ctx.state
    recorded = [e[3] for e in ctx.events]
    ended = any(isinstance(e, RunCompleted | RunFailed) for e in recorded)
    if state.parent:
        for event in recorded:
            if isinstance(event, ApprovalRequested):
                ctx.send(
                    state.parent,
                    ChildAsked(
                        call_id=state.parent_call,
                        run_id=ctx.actor_id,
                        agent=state.agent,
                        child_call_id=event.call_id,
                        name=event.name,
                        arguments=event.arguments,
                    ),
                )
        if ended and state.status in ENDED:
            ctx.send(state.parent, _end_notice(ctx, state, state.parent_call))
    if state.watcher and ended and state.status in ENDED:
        # what it ended with, not what it said: a watcher keeps no output
        ctx.send(state.watcher, attrs.evolve(_end_notice(ctx, state, ""), output=""))
    if ended and state.status in ("failed", "cancelled"):
        for child in was_running:
            if child.run_id in state.finished:
                continue
            ctx.send(
                child.run_id,
                Cancel(
                    by=principal(ctx),
                    who=state.agent,
                    reason=f"its parent run {ctx.actor_id} ended ({state.error_class})",
                ),
                system=True,
            )


def _end_notice(ctx: Context[RunState], state: RunState, call_id: str) -> ChildEnded:
    """The run's end as its parent (or its watcher, with no ``call_id``) is told of it."""
    r = receipt(state)
    return ChildEnded(
        call_id=call_id,
        run_id=ctx.actor_id,
        agent=state.agent,
        status=state.status,
        output=state.output or "",
        error_class=state.error_class,
        error=state.error,
        usd_paid=str(r.usd_total),
        calls_made=r.calls_made + r.child_calls_made,
        input_tokens=r.input_tokens + r.child_input_tokens,
        output_tokens=r.output_tokens + r.child_output_tokens,
        unpriced_calls=r.unpriced_calls + r.child_unpriced_calls,
        lost_calls=r.calls_lost + r.child_calls_lost,
        lost_usd=str(r.usd_lost_estimated + r.child_usd_lost_estimated),
    )


def child_crashed(
    ctx: Context[RunState], agent: Agent | None, run_id: str, error: str, result: Result
) -> None:
    """A child run the kernel gave up on (it could not be restarted): it sent no end of its
    own, so take it as failed with class ``crashloop``; what it spent is in its own receipt."""
    for call_id, started in ctx.state.children.items():
        if started.run_id == run_id:
            msg = ChildEnded(
                call_id=call_id,
                run_id=run_id,
                agent=started.agent,
                status="failed",
                error_class="crashloop",
                error=error,
            )
            child_ended(ctx, agent, msg, result)
            return
