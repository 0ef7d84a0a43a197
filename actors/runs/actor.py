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

A record that needs no step of its own is made in the commit of the step before: a model call's
announcement (``model.calling``, :mod:`toren.actors.runs.inflight`), and the first records of
the next tool call, its approval request or (a tool with effects) its intent
(:mod:`toren.actors.runs.ahead`). What happens outside the run (a model call, a tool's effect)
still happens only in a step after the commit that announced it.

A crash at any point loses only the unit in flight: a model call without its ``model.called`` is
made again (once), a tool intent without its result runs again under the same key. Completed
calls are never sent again: they are in the state, folded from the journal.

Nothing a run receives makes a step run again: model responses and tool results are recorded in
a bounded, recordable form (:mod:`toren.actors.runs.bounds`); a decision is applied only to the
call it names; before a model call or a tool run the worker checks that its lease still holds;
and a message the run cannot handle (an exception in Toren's code or in an approval predicate,
past its retries) fails the run with class ``internal`` as it is dead-lettered.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import attrs

from toren import Actor, ChildFailed, ConfigError, Context, durable_sleep
from toren.actors.runs import (
    ahead,
    calls,
    compaction,
    deciding,
    inflight,
    models,
    rates,
    request,
    sandboxing,
    steps,
    versions,
)
from toren.actors.runs.bounds import bounded_response, cut_result, shown
from toren.kernel import Resources, kill_point
from toren.providers import ProviderError, parse_model
from toren.runs import (
    ENDED,
    PROCESS_AGENTS,
    RUN_KIND,
    SNAPSHOT_VERSION,
    Agent,
    Agents,
    Cancel,
    ChildAsked,
    ChildEnded,
    Continue,
    Decide,
    MessageReceived,
    ModelCalled,
    ModelUnreadable,
    RateWake,
    Retry,
    RunCompleted,
    RunFailed,
    RunResumed,
    RunRetried,
    RunStarted,
    RunState,
    Say,
    StartRun,
    Text,
    TimerFired,
    TimerSet,
    ToolResulted,
    Wake,
    agents_of,
    author,
    context_messages,
    final_text,
    fold,
    summary,
)
from toren.sandboxes import SandboxDone, SandboxNotice, is_sandbox_tool

log = logging.getLogger("toren.run")


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
        # Whether the step in hand sends the run on to its next step (see _go_on).
        self._goes_on = False

    def initial_state(self) -> RunState:
        return RunState()

    def apply(self, state: RunState, event: Any) -> RunState:
        return fold(state, event)

    def summarize(self, state: RunState) -> dict[str, Any]:
        return summary(state)

    def runs(self, state: RunState) -> bool:
        # In flight while it works: parked (on a human, a timer, a child run) or ended, it
        # holds no slot of its agent's or its key's cap (toren.runs.limits).
        return state.status == "running"

    def journal_keep_for(self, state: RunState, resources: Resources) -> float | None:
        """A run that goes on for ever (a conversation) keeps the events behind its snapshot
        for its agent's ``retention.conversation_keep_for`` seconds; then they are archived and
        deleted (toren._core.truncation). None: kept (no such retention, or the agent is not
        served here)."""
        agent = (resources.find(Agents) or PROCESS_AGENTS).named(state.agent)
        retention = getattr(agent, "retention", None)  # toren.Retention (issue 32)
        keep_for = getattr(retention, "conversation_keep_for", None)
        return None if keep_for is None else float(keep_for)

    def on_dead_letter(self, ctx: Context[RunState], msg: Any, error: str) -> None:
        """Whatever message the run could not handle, it no longer goes on by itself: it fails
        (class ``internal``) in the same statement, visibly, and can be retried. A cancel it could
        not handle ends it as cancelled all the same (a retry would undo the cancel)."""
        if ctx.state.status in ("failed", "cancelled"):
            return
        kind = ctx.envelope.kind if ctx.envelope else "a message"
        steps_on = isinstance(msg, Continue) or (
            isinstance(msg, RateWake) and rates.waiting(ctx.state)
        )
        if steps_on and ctx.state.status == "running" and ctx.envelope:
            # Each claim of a step given up may have sent its model call: counted lost. Past
            # max_deliveries this claim is not handled; past max_attempts it was.
            inflight.note_lost(ctx, handled=ctx.envelope.deliveries <= self.max_deliveries)
        running = ctx.state.children_running
        if isinstance(msg, Cancel):
            # The run ends as its cancel asked, not as a failure a retry would resume.
            ctx.emit(steps.cancelled(msg, also=f" (its step could not be committed: {error})"))
        else:
            failed = f"{kind} could not be handled: {error}"
            ctx.emit(RunFailed(error_class="internal", message=failed))
        calls.after_step(ctx, running)
        sandboxing.after_step(ctx, was_live=True)

    async def handle(self, ctx: Context[RunState], msg: Any) -> None:
        running = ctx.state.children_running
        was_live = ctx.state.status not in ENDED
        was = ctx.state.status
        self._goes_on = False
        if versions.check(ctx, msg, self.args):
            return  # handed to a worker serving the version it moves to
        if ctx.route is not None:  # it moved to this worker's version: check its calls again
            self._verified_seq = None
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
        inflight.announce(
            ctx, agents_of(ctx).named(ctx.state.agent), request.builder(ctx.state.callees)
        )
        await versions.at_boundary(ctx, was)  # next_turn: to the newest version, if another
        if self._goes_on and ctx.route is None and self._checked(ctx):
            # The next tool call's intent, if it can be on record now, commits with this step
            # rather than in a step of its own (actors/runs/ahead.py): last, so that it follows
            # whatever this step recorded, and never in a step that hands the run elsewhere.
            ahead.intend(ctx, agents_of(ctx).named(ctx.state.agent))

    def _record_result(self, ctx: Context[RunState]) -> calls.Result:
        agent = agents_of(ctx).named(ctx.state.agent)
        return lambda call_id, content, is_error: self._result(
            ctx, agent, call_id, content, is_error=is_error
        )

    def _record_sandboxed(self, ctx: Context[RunState]) -> sandboxing.Result:
        agent = agents_of(ctx).named(ctx.state.agent)
        return lambda call_id, content, is_error, checkpoint: self._result(
            ctx, agent, call_id, content, is_error=is_error, checkpoint=checkpoint
        )

    async def _handle(self, ctx: Context[RunState], msg: Any) -> None:
        state = ctx.state
        if isinstance(msg, ChildEnded):
            agent = agents_of(ctx).named(state.agent)
            calls.child_ended(ctx, agent, msg, self._record_result(ctx))
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
            calls.child_crashed(
                ctx, agents_of(ctx).named(state.agent), msg.actor_id, msg.error, record
            )
            return
        if isinstance(msg, ChildAsked):
            calls.child_asked(ctx, msg)
            return
        if isinstance(msg, StartRun):
            if not state.agent and not await versions.handed_over(ctx, msg):
                refused = calls.refused_start(agents_of(ctx), msg)
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
                        watcher=msg.watcher,
                        version=versions.started(ctx, msg.agent),
                    )
                )
                versions.pin(ctx)
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
                steps.after_the_start(ctx, msg)
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
            ctx.emit(steps.cancelled(msg))
            return
        # A wake for a call a rate limit held back makes the step, as a Continue does.
        woken = isinstance(msg, RateWake) and rates.waiting(state)
        if live:
            self._check_resume(ctx, go_on=not (isinstance(msg, Continue) or woken))
        if isinstance(msg, Decide):
            # Answered whatever the run's status; an applied decision sends the run on.
            self._goes_on = deciding.decide(ctx, msg)
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
        if woken:
            ctx.cancel_timer(rates.TIMER)  # woken before its timer: the timer is not needed
        if (isinstance(msg, Continue) or woken) and ctx.state.status == "running":
            inflight.note_lost(ctx)  # the call announced for this step, sent by a stopped worker
            await self._next(ctx)

    def _checked(self, ctx: Context[RunState]) -> bool:
        """Whether this activation checked the run's recorded calls against this code (none of
        them can be invalidated by a check still to come)."""
        return self._verified_seq is not None and ctx.seq >= self._verified_seq

    def _go_on(self, ctx: Context[RunState]) -> None:
        """Send the run on to its next step (with the next tool call's intent, if it can be
        recorded in this step's commit: see :meth:`handle`)."""
        ctx.send(ctx.actor_id, Continue())
        self._goes_on = True

    def _check_resume(self, ctx: Context[RunState], *, go_on: bool) -> None:
        """Once per activation: check the recorded calls against this code, and count the
        calls this activation serves from the journal."""
        if self._verified_seq is not None and ctx.seq >= self._verified_seq:
            return
        agent = agents_of(ctx).named(ctx.state.agent)
        checked_as = ""
        if agent is not None:
            checked_as = request.parameters(agent, ctx.state.callees)
            request.verify(ctx, agent, go_on=go_on, checked_as=checked_as)
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
        agent = agents_of(ctx).named(state.agent)
        if agent is None:
            ctx.emit(RunFailed(error_class="config", message=f"no agent named {state.agent!r}"))
            return
        if steps.over_budget(ctx, agent):  # a child's spend, recorded since, counts too
            return
        if steps.over_time(ctx, agent):
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
        if inflight.calls_next(state):
            # Not announced yet (a fork's first step): announced in this commit, made next.
            ctx.send(ctx.actor_id, Continue())
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
        self._go_on(ctx)

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
            arguments, problem = steps.validated(tool, call)
            if arguments is None:
                self._result(ctx, agent, call.id, problem, is_error=True)
                return
            # Once asked, the recorded decision governs, whatever the predicate says now.
            asked = call.id in state.asked or call.id in state.decisions
            if asked or tool.needs_approval(tool.bind(arguments)):
                decision = state.decisions.get(call.id)
                if decision is None:
                    if call.id not in state.asked:
                        ctx.emit(ahead.approval_request(call, tool, arguments))
                    return  # parked: a Decide message naming this call resumes the run
                if not decision.approved:
                    reason = f": {decision.reason}" if decision.reason else ""
                    denial = f"denied by {decision.who}{reason}"
                    self._result(ctx, agent, call.id, denial, is_error=True, denied=True)
                    return
            ctx.emit(ahead.intent_for(ctx, call, arguments))
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
        if tool.idempotency == "at_most_once" and steps.handled_before(ctx):
            # This step was claimed before and did not commit: the call may have run, or be
            # running still. It is not run again; the model is told.
            self._result(ctx, agent, call.id, steps.interrupted(tool.name), is_error=True)
            return
        kill_point("tool.running")
        ctx.ensure_lease()  # a worker paused past its lease runs no tool
        content, is_error = await steps.run_tool(tool, ctx, intent)
        self._result(ctx, agent, call.id, content, is_error=is_error)

    async def _model_step(self, ctx: Context[RunState], agent: Agent) -> None:
        await calls.describe(ctx, agent)  # how its callees are described, recorded once
        if await compaction.compact_if_needed(ctx, agent, self._last_sent):
            return  # compacted: the call is the next step
        state = ctx.state
        provider_name, model_id = parse_model(agent.model)
        sent = request.build_request(agent, context_messages(state), state.callees)
        digest = request.request_digest(state, sent)
        started = time.monotonic()
        limits = models.rates_of(ctx)
        if await rates.held_back(ctx, limits, agent, sent):
            return  # not sent: the run waits for the limit (rate.waited), holding no lease
        try:
            provider = await models.provider(ctx, agent.model)
            started = time.monotonic()
            kill_point("model.sending")
            # Before every attempt (retries included): a worker paused past its lease pays for
            # no call.
            response = await provider.call(sent, before_attempt=ctx.ensure_lease)
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
            if await rates.refused(ctx, limits, agent, exc):
                return  # a 429 under a shared limit: every worker waits it out
            if exc.too_large:  # over the window: compact and try once more
                await compaction.after_refusal(ctx, agent, self._last_sent, exc)
                return
            models.failed_attempt(ctx, agent, exc)
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
        cost = models.price(provider_name, model_id, response)
        called = ModelCalled(
            step=step,
            digest=digest,
            model=agent.model,
            response=response,
            cost_usd=str(cost) if cost is not None else None,
            latency_ms=latency,
            messages_len=len(state.messages),  # the whole conversation's, compacted or not
            checked_as=request.parameters(agent, state.callees),
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
        if steps.over_budget(ctx, agent):
            return
        if not ctx.state.pending_calls:
            steps.end_turn(ctx, agent)
        elif not ahead.ask(ctx, agent):  # asked: the run parks in this very commit
            self._go_on(ctx)  # with its first call's intent, if that can be recorded now
