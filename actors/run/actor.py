"""The run actor: an agent's model-call loop as an event-sourced actor (kind ``toren.run``).

Every unit of work is one handled ``Continue`` message and one commit, so that each step's
result is in the journal before the next step starts:

- the next pending tool call without a decision that needs one: ``approval.requested``, and the
  run parks (no ``Continue`` is sent: the actor passivates; a ``Decide`` message resumes it);
- the next pending tool call without an intent: ``tool.intent`` with its idempotency key;
- the next intent without a result: run the tool under that key, ``tool.result``;
- nothing pending: call the model (no transaction is open meanwhile), ``model.called``; an
  answer that asks for no tool ends the turn in the same commit (``run.completed``), so that a
  message arriving meanwhile starts the next turn and never hides this one's answer.

A crash at any point loses only the unit in flight: a model call without its ``model.called`` is
made again (once), a tool intent without its result runs again under the same key. Completed
calls are never sent again: they are in the state, folded from the journal.

Nothing a run receives makes a step run again: model responses and tool results are recorded in
a bounded, recordable form (:mod:`toren.actors.run.bounds`); a decision is applied only to the
call it names; before a model call or a tool run the worker checks that its lease still holds; and a
message the run cannot handle (an exception in Toren's code or in an approval predicate, past
its retries) fails the run with class ``internal`` as it is dead-lettered.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import time
from collections.abc import Iterable, Mapping
from decimal import Decimal
from typing import Any

import anyio
import attrs
import pydantic

from toren import (
    Actor,
    ChildFailed,
    ConfigError,
    Context,
    LeaseExpired,
    __version__,
    durable_sleep,
)
from toren.actors.run import calls, compaction, deciding, inflight, sandboxing
from toren.actors.run.bounds import as_text, bounded_response, cut_result, error_text, shown
from toren.kernel import kill_point
from toren.providers import (
    ModelProvider,
    ProviderError,
    RetryPolicy,
    parse_model,
    price,
    provider_for,
)
from toren.runs import (
    ENDED,
    RUN_KIND,
    SNAPSHOT_VERSION,
    Agent,
    ApprovalRequested,
    Cancel,
    ChildAsked,
    ChildEnded,
    Continue,
    Decide,
    Message,
    MessageReceived,
    ModelCalled,
    ModelRequest,
    ModelResponse,
    ModelUnreadable,
    Retry,
    RunCompleted,
    RunFailed,
    RunResumed,
    RunRetried,
    RunRetrying,
    RunStarted,
    RunState,
    Say,
    StartRun,
    StepsInvalidated,
    Text,
    TimerFired,
    TimerSet,
    Tool,
    ToolCall,
    ToolContext,
    ToolIntended,
    ToolResulted,
    ToolSpec,
    Wake,
    agent_named,
    author,
    canonical,
    chain,
    context_messages,
    final_text,
    fold,
    occurrences_of,
    receipt,
    summary,
)
from toren.sandbox import WORKSPACE, SandboxDone, SandboxNotice, is_sandbox_tool

log = logging.getLogger("toren.run")

_STEP_RETRY_BASE = 1.0
_STEP_RETRY_CAP = 300.0

_providers: dict[str, ModelProvider] = {}


async def _provider(model: str) -> ModelProvider:
    """One provider per model for the life of the worker process (they pool connections).

    Its retry policy reads ``TOREN_MODEL_RETRY_ATTEMPTS`` (default 6) and
    ``TOREN_MODEL_RETRY_BASE_SECONDS`` (default 0.5); past those the run's own step retry
    (a durable timer, up to the agent's ``max_attempts``) takes over.
    """
    found = _providers.get(model)
    if found is None:
        policy = RetryPolicy.from_env(os.environ)
        # In a thread: the first use imports the provider's SDK, which takes seconds and must
        # not stall the worker's event loop (its lease renewals run there).
        created = await anyio.to_thread.run_sync(lambda: provider_for(model, retry=policy))
        # Runs that started together may each have made one meanwhile: keep the first, close
        # the others (an unclosed one would leak its connections).
        found = _providers.setdefault(model, created)
        if found is not created:
            await created.aclose()
    return found


async def close_providers() -> None:
    """Close every provider this process opened (their connection pools)."""
    providers = list(_providers.values())
    _providers.clear()
    for provider in providers:
        await provider.aclose()


def idempotency_key(run_id: str, name: str, arguments: dict[str, Any], occurrence: int) -> str:
    """Same run, same tool, same arguments, same count of identical calls before: same key."""
    h = hashlib.sha256(f"{run_id}\0{name}\0{occurrence}\0".encode("utf-8", "surrogatepass"))
    h.update(canonical(arguments).encode("utf-8", "surrogatepass"))
    return h.hexdigest()[:32]


class RunActor(Actor[RunState]):
    """Runs one agent run."""

    kind = RUN_KIND
    idle_seconds = 0.5  # parked runs leave the worker quickly
    # A long run is activated from its snapshot and the events since (at most this many).
    snapshot_every = 1000
    state_type = RunState
    snapshot_version = SNAPSHOT_VERSION

    def __init__(self, actor_id: str, args: Any) -> None:
        super().__init__(actor_id, args)
        # The journal's seq once this activation checked its recorded calls against the code.
        # A step that did the check and then failed leaves the journal below it: checked again.
        self._verified_seq: int | None = None
        self._last_sent = compaction.LastSent()

    def initial_state(self) -> RunState:
        return RunState()

    def apply(self, state: RunState, event: Any) -> RunState:
        return fold(state, event)

    def summarize(self, state: RunState) -> dict[str, Any]:
        return summary(state)

    def on_dead_letter(self, ctx: Context[RunState], msg: Any, error: str) -> None:
        """Whatever message the run could not handle, it no longer goes on by itself: it fails
        (class ``internal``) in the same statement, visibly, and can be retried. A cancel it could
        not handle ends it as cancelled all the same (a retry would undo the cancel)."""
        if ctx.state.status in ("failed", "cancelled"):
            return
        kind = ctx.envelope.kind if ctx.envelope else "a message"
        if isinstance(msg, Continue) and ctx.state.status == "running" and ctx.envelope:
            # Each claim of a step given up may have sent its model call: counted lost. Past
            # max_deliveries this claim is not handled; past max_attempts it was.
            inflight.note_lost(ctx, handled=ctx.envelope.deliveries <= self.max_deliveries)
        running = ctx.state.children_running
        if isinstance(msg, Cancel):
            # The run ends as its cancel asked, not as a failure a retry would resume.
            ctx.emit(_cancelled(msg, also=f" (its step could not be committed: {error})"))
        else:
            failed = f"{kind} could not be handled: {error}"
            ctx.emit(RunFailed(error_class="internal", message=failed))
        calls.after_step(ctx, running)
        sandboxing.after_step(ctx, was_live=True)

    async def handle(self, ctx: Context[RunState], msg: Any) -> None:
        running = ctx.state.children_running
        was_live = ctx.state.status not in ENDED
        await self._handle(ctx, msg)
        # A child tells its parent that it ended or asks a human; a failed parent cancels the
        # children it waited on; an ended run's sandbox is reaped.
        calls.after_step(ctx, running)
        sandboxing.after_step(ctx, was_live)
        if inflight.calls_next(ctx.state):
            # A run that goes on from its journal (a message to it once completed, a retry, a
            # child's end) records so before it announces the call: the journal reads message,
            # resumed, model call. The Continue that makes the call is already sent.
            self._check_resume(ctx, go_on=False)
        # The model call the next step makes is on record before it is made (with this commit).
        callees = ctx.state.callees
        inflight.announce(
            ctx,
            agent_named(ctx.state.agent),
            lambda agent, messages: build_request(agent, messages, callees),
        )

    def _record_result(self, ctx: Context[RunState]) -> calls.Result:
        agent = agent_named(ctx.state.agent)
        return lambda call_id, content, is_error: self._result(
            ctx, agent, call_id, content, is_error=is_error
        )

    def _record_sandboxed(self, ctx: Context[RunState]) -> sandboxing.Result:
        agent = agent_named(ctx.state.agent)
        return lambda call_id, content, is_error, checkpoint: self._result(
            ctx, agent, call_id, content, is_error=is_error, checkpoint=checkpoint
        )

    async def _handle(self, ctx: Context[RunState], msg: Any) -> None:
        state = ctx.state
        if isinstance(msg, ChildEnded):
            calls.child_ended(ctx, agent_named(state.agent), msg, self._record_result(ctx))
            return
        if isinstance(msg, SandboxDone):
            sandboxing.done(ctx, msg, self._record_sandboxed(ctx))
            return
        if isinstance(msg, SandboxNotice):
            sandboxing.noted(ctx, msg)
            return
        if isinstance(msg, ChildFailed):
            if sandboxing.crashed(ctx, msg, self._record_sandboxed(ctx)):
                return
            record = self._record_result(ctx)
            calls.child_crashed(ctx, agent_named(state.agent), msg.actor_id, msg.error, record)
            return
        if isinstance(msg, ChildAsked):
            calls.child_asked(ctx, msg)
            return
        if isinstance(msg, StartRun):
            if not state.agent:
                refused = calls.refused_start(msg)
                ctx.emit(
                    RunStarted(
                        agent=msg.agent,
                        input=msg.input,
                        at=time.time(),
                        by=msg.by,
                        parent=msg.parent,
                        parent_call=msg.parent_call,
                        chain=msg.chain,
                        budget_usd=msg.budget_usd,
                        depth_limit=msg.depth_limit,
                    )
                )
                if refused:  # its caller is not (or no longer) accepted here
                    ctx.emit(RunFailed(error_class="config", message=refused))
                    return
                ctx.send(ctx.actor_id, Continue())
            return
        if isinstance(msg, Retry):
            if state.parent:
                # Its end went to its parent, which took it: retrying the child would act
                # and spend where no receipt counts it (toren.runs.retry refuses it too).
                log.warning("%s: a child run is not retried; retry %s", ctx.actor_id, state.parent)
                return
            if state.status == "failed":  # not a cancelled run: that one stays so
                ctx.emit(RunRetried(who=author(msg)[0], at=time.time(), by=msg.by))
                ctx.send(ctx.actor_id, Continue())
            return
        if isinstance(msg, Say):
            if not state.agent and state.status not in ("failed", "cancelled"):
                _after_the_start(ctx, msg)
                return
            was_done = state.status == "completed"
            if was_done and state.parent:
                log.warning("%s: an ended child run takes no messages", ctx.actor_id)
                return
            if state.status not in ("failed", "cancelled"):
                who, via = author(msg)
                received = MessageReceived(
                    text=msg.text, who=who, channel=via, by=msg.by, at=time.time()
                )
                ctx.emit(received)
                if was_done:
                    ctx.send(ctx.actor_id, Continue())
            return
        live = state.status not in ENDED
        if live and isinstance(msg, Cancel):
            ctx.emit(_cancelled(msg))
            return
        if live:
            self._check_resume(ctx, go_on=not isinstance(msg, Continue))
        if isinstance(msg, Decide):
            deciding.decide(ctx, msg)  # answered whatever the run's status
            return
        if not live:
            if isinstance(msg, Continue):
                # A cancel handled before the step its dead worker had in flight: that step's
                # call may have been sent (the announcement outlives a cancel for this).
                inflight.note_lost(ctx)
            return
        if isinstance(msg, Wake):
            intent = ctx.state.intents.get(msg.call_id)
            if intent is not None and msg.call_id not in ctx.state.results:
                ctx.emit(TimerFired(call_id=msg.call_id, at=time.time()))
                seconds = intent.arguments.get("seconds", 0)
                ctx.emit(ToolResulted(call_id=msg.call_id, content=f"slept {seconds:g}s"))
                ctx.send(ctx.actor_id, Continue())
            return
        if isinstance(msg, Continue) and ctx.state.status == "running":
            inflight.note_lost(ctx)  # the call announced for this step, sent by a stopped worker
            await self._next(ctx)

    def _check_resume(self, ctx: Context[RunState], *, go_on: bool) -> None:
        """Once per activation: check the recorded calls against this code, and count the
        calls this activation serves from the journal."""
        if self._verified_seq is not None and ctx.seq >= self._verified_seq:
            return
        agent = agent_named(ctx.state.agent)
        checked_as = ""
        if agent is not None:
            checked_as = parameters(agent, ctx.state.callees)
            verify(ctx, agent, go_on=go_on, checked_as=checked_as)
        state = ctx.state
        unchecked = checked_as and (
            state.checked_as != checked_as or state.checked_calls < len(state.calls)
        )
        compacted = len(state.compactions) > state.compactions_replayed
        if len(state.calls) > state.replayed or compacted or (state.calls and unchecked):
            # This activation goes on from the journal: the calls recorded so far are served
            # from it, not sent again (and were checked against this code's parameters).
            ctx.emit(RunResumed(replayed=len(state.calls), checked_as=checked_as))
        self._verified_seq = ctx.seq

    async def _next(self, ctx: Context[RunState]) -> None:
        state = ctx.state
        agent = agent_named(state.agent)
        if agent is None:
            ctx.emit(RunFailed(error_class="config", message=f"no agent named {state.agent!r}"))
            return
        if _over_budget(ctx, agent):  # a child's spend, recorded since, counts too
            return
        if _over_time(ctx, agent):
            return
        if state.tool_failures >= agent.max_attempts:
            last = state.calls[-1].response.tool_calls[-1].id if state.calls else ""
            error = state.results[last].content if last in state.results else ""
            ctx.emit(
                RunFailed(
                    error_class="tool",
                    message=f"{state.tool_failures} model turns in a row asked only for tool "
                    f"calls that failed (max_attempts {agent.max_attempts}); the last: "
                    f"{shown(error)}",
                )
            )
            return
        pending = state.pending_calls
        if pending:
            await self._tool_step(ctx, agent, pending[0])
            return
        if not state.awaiting_model:
            # The model spoke last and asked for nothing, its turn not ended with it (a journal
            # of an earlier version, or a run retried): its answer is the output.
            ctx.emit(RunCompleted(output=final_text(state.calls[-1].response), at=time.time()))
            return
        await self._model_step(ctx, agent)

    def _result(
        self,
        ctx: Context[RunState],
        agent: Agent | None,
        call_id: str,
        content: str,
        *,
        is_error: bool,
        denied: bool = False,
        checkpoint: str | None = None,
    ) -> None:
        """Record a tool call's result (cut to the agent's cap) and go on."""
        text, size = cut_result(content, calls.result_cap(agent))
        ctx.emit(
            ToolResulted(
                call_id=call_id,
                content=text,
                is_error=is_error,
                denied=denied,
                truncated_from=size,
                checkpoint=checkpoint,
            )
        )
        ctx.send(ctx.actor_id, Continue())

    async def _tool_step(self, ctx: Context[RunState], agent: Agent, call: Any) -> None:
        state = ctx.state
        tool = agent.tool_named(call.name)
        callee = calls.callee_for(agent, call.name) if tool is None else None
        if callee is not None:
            await calls.call_step(ctx, agent, call, callee, self._record_result(ctx))
            return
        if tool is None:
            self._result(ctx, agent, call.id, f"unknown tool {shown(call.name)}", is_error=True)
            return
        intent = state.intents.get(call.id)
        if intent is None:
            arguments, problem = _validated(tool, call)
            if arguments is None:
                self._result(ctx, agent, call.id, problem, is_error=True)
                return
            # Once asked, the recorded decision governs, whatever the predicate says now.
            asked = call.id in state.asked or call.id in state.decisions
            if asked or tool.needs_approval(tool.bind(arguments)):
                decision = state.decisions.get(call.id)
                if decision is None:
                    if call.id not in state.asked:
                        ctx.emit(
                            ApprovalRequested(
                                call_id=call.id,
                                name=call.name,
                                arguments=arguments,
                                at=time.time(),
                                cwd=WORKSPACE if is_sandbox_tool(tool) else None,
                            )
                        )
                    return  # parked: a Decide message naming this call resumes the run
                if not decision.approved:
                    reason = f": {decision.reason}" if decision.reason else ""
                    denial = f"denied by {decision.who}{reason}"
                    self._result(ctx, agent, call.id, denial, is_error=True, denied=True)
                    return
            occurrence = occurrences_of(state, call.name, arguments)
            key = idempotency_key(ctx.actor_id, call.name, arguments, occurrence)
            intent = ToolIntended(
                call_id=call.id, name=call.name, arguments=arguments, idempotency_key=key
            )
            ctx.emit(intent)
            intent = ctx.state.intents[call.id]  # as recorded
            if is_sandbox_tool(tool):
                # Sent with its intent: the sandbox records its own before running it.
                await sandboxing.send(ctx, agent, call, intent, self._record_sandboxed(ctx))
                return
            if tool.effects != "read" or tool.fn is durable_sleep.fn:
                # The intent of an effect is on record before the effect can happen: the tool
                # runs in the next step. A read has nothing to protect: it runs now, and its
                # intent and result commit together (a crash before the commit reads again).
                ctx.send(ctx.actor_id, Continue())
                return
        if is_sandbox_tool(tool):
            await sandboxing.send(ctx, agent, call, intent, self._record_sandboxed(ctx))
            return
        if tool.name == "sleep" and tool.fn is durable_sleep.fn:
            # The built-in sleep parks the run on a durable timer: no task waits meanwhile.
            seconds = float(intent.arguments.get("seconds", 0))
            ctx.emit(TimerSet(call_id=call.id, seconds=seconds, at=time.time()))
            ctx.set_timer(f"sleep:{call.id}", seconds, Wake(call_id=call.id))
            return
        if tool.idempotency == "at_most_once" and _handled_before(ctx):
            # This step was claimed before and did not commit: the call may have run, or be
            # running still. It is not run again; the model is told.
            self._result(ctx, agent, call.id, interrupted(tool.name), is_error=True)
            return
        kill_point("tool.running")
        ctx.ensure_lease()  # a worker paused past its lease runs no tool
        content, is_error = await _run_tool(tool, ctx, intent)
        self._result(ctx, agent, call.id, content, is_error=is_error)

    async def _model_step(self, ctx: Context[RunState], agent: Agent) -> None:
        await calls.describe(ctx, agent)  # how its callees are described, recorded once
        hooks = self._compaction_hooks(ctx)
        if await compaction.compact_if_needed(ctx, agent, hooks):
            return  # compacted: the call is the next step
        state = ctx.state
        provider_name, model_id = parse_model(agent.model)
        request = hooks.build(agent, context_messages(state))
        digest = compaction.request_digest(state, request)
        started = time.monotonic()
        try:
            provider = await _provider(agent.model)
            started = time.monotonic()
            kill_point("model.sending")
            # Before every attempt (retries included): a worker paused past its lease pays for
            # no call.
            response = await provider.call(request, before_attempt=ctx.ensure_lease)
            kill_point("model.received")
        except ProviderError as exc:
            if exc.answered:
                # Paid for, and unreadable: counted on the receipt, never asked again by itself.
                ctx.emit(
                    ModelUnreadable(
                        step=len(state.calls) + 1,
                        digest=digest,
                        model=agent.model,
                        error=exc.message,
                        latency_ms=int((time.monotonic() - started) * 1000),
                    )
                )
                ctx.emit(RunFailed(error_class="provider", message=str(exc)))
                return
            if exc.too_large:  # over the window: compact and try once more
                await compaction.after_refusal(ctx, agent, hooks, exc)
                return
            self._failed_attempt(ctx, agent, exc)
            return
        except ConfigError as exc:
            # A missing key or an unknown provider: no retry will help; say what to fix.
            ctx.emit(RunFailed(error_class="config", message=str(exc)))
            return
        latency = int((time.monotonic() - started) * 1000)
        step = len(state.calls) + 1
        response = bounded_response(
            response,
            cap=agent.max_response_bytes,
            step=step,
            # Voided calls' ids too: a decision sent for one must not fit a new call.
            earlier_ids=state.tool_ids,
        )
        cost = _price(provider_name, model_id, response)
        called = ModelCalled(
            step=step,
            digest=digest,
            model=agent.model,
            response=response,
            cost_usd=str(cost) if cost is not None else None,
            latency_ms=latency,
            messages_len=len(state.messages),  # the whole conversation's, compacted or not
            checked_as=parameters(agent, state.callees),
        )
        try:
            ctx.emit(called)
        except (TypeError, ValueError) as exc:
            # Paid for, and not recordable as it is (a bug of ours: bounded_response should
            # have made it so). Record that the call was made and what it cost, and stop:
            # asking again would pay again.
            placeholder = attrs.evolve(
                response,
                content=(Text(text=f"[Toren could not record this response: {exc}]"),),
                stop_reason="end",
                model=agent.model,
                response_id="",
            )
            ctx.emit(attrs.evolve(called, response=placeholder))
            ctx.emit(
                RunFailed(
                    error_class="internal",
                    message=f"the model's response to step {step} could not be recorded: {exc}",
                )
            )
            return
        if _over_budget(ctx, agent):
            return
        if ctx.state.pending_calls:
            ctx.send(ctx.actor_id, Continue())
        else:
            _end_turn(ctx, agent)

    def _compaction_hooks(self, ctx: Context[RunState]) -> compaction.Hooks:
        callees = ctx.state.callees
        return compaction.Hooks(
            build=lambda agent, messages: build_request(agent, messages, callees),
            provider=_provider,
            price=_price,
            failed_attempt=self._failed_attempt,
            last_sent=self._last_sent,
            build_inputs=callees,
        )

    def _failed_attempt(self, ctx: Context[RunState], agent: Agent, exc: ProviderError) -> None:
        """A model call failed after the provider's own retries: fail the run, or try the step
        again later (a durable timer) until the agent's attempts cap."""
        if not exc.retryable:
            ctx.emit(RunFailed(error_class="provider", message=str(exc)))
            return
        attempt = ctx.state.failed_attempts + 1
        if attempt >= agent.max_attempts:
            ctx.emit(
                RunFailed(
                    error_class="attempts",
                    message=f"{attempt} failed attempts at step {len(ctx.state.calls) + 1}: {exc}",
                )
            )
            return
        delay = min(_STEP_RETRY_CAP, _STEP_RETRY_BASE * 2 ** (attempt - 1))
        ctx.emit(RunRetrying(attempt=attempt, error=str(exc), delay=delay))
        ctx.set_timer("retry", delay, Continue())


def _handled_before(ctx: Context[RunState]) -> bool:
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


def _over_budget(ctx: Context[RunState], agent: Agent) -> bool:
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


def _after_the_start(ctx: Context[RunState], msg: Say) -> None:
    """A message handled before the run's start (a say() right after start_run: the system lane
    is taken first) is sent again, behind the start, so that it is heard after the input. Sent
    again once only: one that comes back before the start has no start ahead of it (a run made
    without one) and is dropped, logged, rather than sent round for ever."""
    if ctx.sender == ctx.actor_id:
        log.warning("%s: a message waited for a start that never came; dropped", ctx.actor_id)
        return
    ctx.send(ctx.actor_id, msg)


def _end_turn(ctx: Context[RunState], agent: Agent) -> None:
    """The model's answer asks for nothing: it ends the turn in the commit that records it, so
    that a message arriving next starts a new turn after this one, whose answer is out."""
    if not _over_time(ctx, agent):
        ctx.emit(RunCompleted(output=final_text(ctx.state.calls[-1].response), at=time.time()))


def _over_time(ctx: Context[RunState], agent: Agent) -> bool:
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


def _price(provider: str, model_id: str, response: ModelResponse) -> Decimal | None:
    """The call's price; unpriced (``None``) if the price library cannot tell, whatever the
    usage the provider reported."""
    try:
        return price(provider, model_id, response.usage)
    except Exception:
        log.warning("could not price a call to %s/%s", provider, model_id, exc_info=True)
        return None


def _validated(tool: Tool, call: ToolCall) -> tuple[dict[str, Any] | None, str]:
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


def build_request(
    agent: Agent, messages: Iterable[Message], callees: Mapping[str, str] | None = None
) -> ModelRequest:
    """The request this code makes for ``messages``: what digests are computed from.
    ``callees`` describes the agents it may call (as the run recorded them)."""
    _, model_id = parse_model(agent.model)
    return ModelRequest(
        model=model_id,
        system=agent.system,
        messages=tuple(messages),
        tools=tuple(
            ToolSpec(name=t.name, description=t.description, input_schema=t.input_schema)
            for t in agent.all_tools
        )
        + calls.callee_tools(agent, callees or {}),
        max_tokens=agent.max_tokens,
    )


def parameters(agent: Agent, callees: Mapping[str, str] | None = None) -> str:
    """What a request depends on besides the conversation (Toren's version, the model, the
    system prompt, the tools and callees, the limits), as a digest: calls checked against one
    set of parameters need not be checked again while it stays the same."""
    return chain(f"toren {__version__}", build_request(agent, (), callees))[:32]


def verify(
    ctx: Context[RunState], agent: Agent, *, go_on: bool, checked_as: str | None = None
) -> None:
    """Check each recorded call against the request this code would send now (one pass over the
    journal); at the first difference, void that call and every later one.

    With ``checked_as`` (this code's :func:`parameters`), the calls the state says were already
    checked against the same parameters are skipped: only those recorded since are checked."""
    state = ctx.state
    first = 0
    if checked_as and state.checked_as == checked_as and state.checked_calls:
        first = min(state.checked_calls, len(state.calls))

    def build(agent: Agent, messages: Iterable[Message]) -> ModelRequest:
        return build_request(agent, messages, state.callees)

    # The chain restarts at each compaction (see toren.actors.run.compaction).
    for call, digest in compaction.recomputed(state, agent, build, first=first):
        if digest != call.digest:
            log.warning(
                "%s: step %d would now be asked differently (code or config changed); "
                "invalidating it and the steps after it",
                ctx.actor_id,
                call.step,
            )
            ctx.emit(
                StepsInvalidated(
                    from_step=call.step,
                    reason="the request this code makes differs from the recorded one",
                )
            )
            if go_on:  # unless the message in hand is already a Continue
                ctx.send(ctx.actor_id, Continue())
            return


async def _run_tool(tool: Tool, ctx: Context[RunState], intent: ToolIntended) -> tuple[str, bool]:
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


def _cancelled(msg: Cancel, *, also: str = "") -> RunFailed:
    """How a run ends on ``msg``: class ``cancelled``, by whom and why."""
    reason = f": {msg.reason}" if msg.reason else ""
    return RunFailed(
        error_class="cancelled", message=f"cancelled by {author(msg)[0]}{reason}{also}", by=msg.by
    )
