"""The run actor: an agent's model-call loop as an event-sourced actor (kind ``toren.run``).

Every unit of work is one handled ``Continue`` message and one commit, so that each step's
result is in the journal before the next step starts:

- the next pending tool call without a decision that needs one: ``approval.requested``, and the
  run parks (no ``Continue`` is sent: the actor passivates; a ``Decide`` message resumes it);
- the next pending tool call without an intent: ``tool.intent`` with its idempotency key;
- the next intent without a result: run the tool under that key, ``tool.result``;
- nothing pending: call the model (no transaction is open meanwhile), ``model.called``; or, if
  the last answer was final, ``run.completed``.

A crash at any point loses only the unit in flight: a model call without its ``model.called`` is
made again (once), a tool intent without its result runs again under the same key. Completed
calls are never sent again: they are in the state, folded from the journal.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from decimal import Decimal
from typing import Any

import anyio
import orjson
import pydantic

from toren import Actor, ConfigError, Context, durable_sleep
from toren.kernel import kill_point
from toren.providers import (
    ModelProvider,
    ProviderError,
    RetryPolicy,
    parse_model,
    price,
    provider_for,
)
from toren.runs import GENESIS as DIGEST_GENESIS
from toren.runs import (
    RUN_KIND,
    Agent,
    ApprovalDecided,
    ApprovalRequested,
    Cancel,
    Continue,
    Decide,
    Message,
    MessageReceived,
    ModelCalled,
    ModelRequest,
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
    TimerFired,
    TimerSet,
    Tool,
    ToolContext,
    ToolIntended,
    ToolResulted,
    ToolSpec,
    Wake,
    agent_named,
    chain,
    final_text,
    fold,
    receipt,
    summary,
)

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
        policy = RetryPolicy(
            attempts=int(os.environ.get("TOREN_MODEL_RETRY_ATTEMPTS", "6")),
            base=float(os.environ.get("TOREN_MODEL_RETRY_BASE_SECONDS", "0.5")),
        )
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
    canonical = orjson.dumps(arguments, option=orjson.OPT_SORT_KEYS)
    h = hashlib.sha256(f"{run_id}\0{name}\0{occurrence}\0".encode())
    h.update(canonical)
    return h.hexdigest()[:32]


class RunActor(Actor[RunState]):
    """Runs one agent run."""

    kind = RUN_KIND
    idle_seconds = 0.5  # parked runs leave the worker quickly

    def __init__(self, actor_id: str, args: Any) -> None:
        super().__init__(actor_id, args)
        self._resume_counted = False

    def initial_state(self) -> RunState:
        return RunState()

    def apply(self, state: RunState, event: Any) -> RunState:
        return fold(state, event)

    def summarize(self, state: RunState) -> dict[str, Any]:
        return summary(state)

    async def handle(self, ctx: Context[RunState], msg: Any) -> None:
        state = ctx.state
        if isinstance(msg, StartRun):
            if not state.agent:
                ctx.emit(RunStarted(agent=msg.agent, input=msg.input, at=time.time()))
                ctx.send(ctx.actor_id, Continue())
            return
        if isinstance(msg, Retry):
            if state.status == "failed" and state.error_class != "cancelled":
                ctx.emit(RunRetried(who=msg.who))
                ctx.send(ctx.actor_id, Continue())
            return
        if isinstance(msg, Say):
            was_done = state.status == "completed"
            if state.status != "failed":
                ctx.emit(MessageReceived(text=msg.text, who=msg.who, channel=msg.channel))
                if was_done:
                    ctx.send(ctx.actor_id, Continue())
            return
        if state.status in ("completed", "failed"):
            return
        if isinstance(msg, Cancel):
            reason = f": {msg.reason}" if msg.reason else ""
            ctx.emit(RunFailed(error_class="cancelled", message=f"cancelled by {msg.who}{reason}"))
            return
        if not self._resume_counted:
            self._resume_counted = True
            agent = agent_named(state.agent)
            if agent is not None:
                verify(ctx, agent, go_on=not isinstance(msg, Continue))
                state = ctx.state
            if len(state.calls) > state.replayed:
                # This activation goes on from the journal: the calls recorded so far are
                # served from it, not sent again.
                ctx.emit(RunResumed(replayed=len(state.calls)))
        if isinstance(msg, Decide):
            self._decide(ctx, msg)
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
            await self._next(ctx)

    def _decide(self, ctx: Context[RunState], msg: Decide) -> None:
        state = ctx.state
        waiting = [c for c in state.asked if c not in state.decisions]
        if not waiting:
            log.warning("%s: a decision arrived but nothing waits for one", ctx.actor_id)
            return
        call_id = sorted(waiting)[0]
        kill_point("decision.received")
        ctx.emit(
            ApprovalDecided(
                call_id=call_id,
                approved=msg.approved,
                who=msg.who,
                reason=msg.reason,
                channel=msg.channel,
                at=time.time(),
            )
        )
        ctx.send(ctx.actor_id, Continue())

    async def _next(self, ctx: Context[RunState]) -> None:
        state = ctx.state
        agent = agent_named(state.agent)
        if agent is None:
            ctx.emit(RunFailed(error_class="config", message=f"no agent named {state.agent!r}"))
            return
        worked = state.working_seconds(time.time())
        if worked > agent.wall_clock:
            ctx.emit(
                RunFailed(
                    error_class="timeout",
                    message=f"worked {worked:.0f}s, over the wall-clock budget of "
                    f"{agent.wall_clock:g}s (time parked on approvals not counted)",
                )
            )
            return
        pending = state.pending_calls
        if pending:
            await self._tool_step(ctx, agent, pending[0])
            return
        if not state.awaiting_model:
            # The model spoke last and asked for nothing: its answer is the output.
            ctx.emit(RunCompleted(output=final_text(state.calls[-1].response)))
            return
        await self._model_step(ctx, agent)

    async def _tool_step(self, ctx: Context[RunState], agent: Agent, call: Any) -> None:
        state = ctx.state
        tool = agent.tool_named(call.name)
        if tool is None:
            ctx.emit(
                ToolResulted(call_id=call.id, content=f"unknown tool {call.name!r}", is_error=True)
            )
            ctx.send(ctx.actor_id, Continue())
            return
        intent = state.intents.get(call.id)
        if intent is None:
            try:
                arguments = tool.validate(call.arguments) if call.arguments is not None else None
            except pydantic.ValidationError as exc:
                arguments = None
                problem = f"invalid arguments for {call.name}: {exc.errors(include_url=False)}"
            else:
                problem = f"arguments for {call.name} are not a JSON object: {call.raw_arguments!r}"
            if arguments is None:
                ctx.emit(ToolResulted(call_id=call.id, content=problem, is_error=True))
                ctx.send(ctx.actor_id, Continue())
                return
            if tool.needs_approval(arguments):
                decision = state.decisions.get(call.id)
                if decision is None:
                    if call.id not in state.asked:
                        ctx.emit(
                            ApprovalRequested(
                                call_id=call.id, name=call.name, arguments=arguments, at=time.time()
                            )
                        )
                    return  # parked: a Decide message resumes the run
                if not decision.approved:
                    reason = f": {decision.reason}" if decision.reason else ""
                    ctx.emit(
                        ToolResulted(
                            call_id=call.id,
                            content=f"denied by {decision.who}{reason}",
                            is_error=True,
                        )
                    )
                    ctx.send(ctx.actor_id, Continue())
                    return
            occurrence = sum(
                1
                for i in state.intents.values()
                if i.name == call.name and i.arguments == arguments
            )
            key = idempotency_key(ctx.actor_id, call.name, arguments, occurrence)
            intent = ToolIntended(
                call_id=call.id, name=call.name, arguments=arguments, idempotency_key=key
            )
            ctx.emit(intent)
            if tool.effects != "read" or tool.fn is durable_sleep.fn:
                # The intent of an effect is on record before the effect can happen: the tool
                # runs in the next step. A read has nothing to protect: it runs now, and its
                # intent and result commit together (a crash before the commit reads again).
                ctx.send(ctx.actor_id, Continue())
                return
        if tool.name == "sleep" and tool.fn is durable_sleep.fn:
            # The built-in sleep parks the run on a durable timer: no task waits meanwhile.
            seconds = float(intent.arguments.get("seconds", 0))
            ctx.emit(TimerSet(call_id=call.id, seconds=seconds, at=time.time()))
            ctx.set_timer(f"sleep:{call.id}", seconds, Wake(call_id=call.id))
            return
        kill_point("tool.running")
        content, is_error = await _run_tool(tool, ctx.actor_id, intent)
        ctx.emit(ToolResulted(call_id=call.id, content=content, is_error=is_error))
        ctx.send(ctx.actor_id, Continue())

    async def _model_step(self, ctx: Context[RunState], agent: Agent) -> None:
        state = ctx.state
        provider_name, model_id = parse_model(agent.model)
        request = build_request(agent, state.messages)
        previous = state.calls[-1] if state.calls else None
        digest = chain(
            previous.digest if previous else DIGEST_GENESIS,
            request,
            since=previous.messages_len if previous else 0,
        )
        started = time.monotonic()
        try:
            provider = await _provider(agent.model)
            started = time.monotonic()
            kill_point("model.sending")
            response = await provider.call(request)
            kill_point("model.received")
        except ProviderError as exc:
            self._failed_attempt(ctx, agent, exc)
            return
        except ConfigError as exc:
            # A missing key or an unknown provider: no retry will help; say what to fix.
            ctx.emit(RunFailed(error_class="config", message=str(exc)))
            return
        cost = price(provider_name, model_id, response.usage)
        ctx.emit(
            ModelCalled(
                step=len(state.calls) + 1,
                digest=digest,
                model=agent.model,
                response=response,
                cost_usd=str(cost) if cost is not None else None,
                latency_ms=int((time.monotonic() - started) * 1000),
                messages_len=len(request.messages),
            )
        )
        spent = receipt(ctx.state).usd_paid
        if agent.budget_usd is not None and spent > Decimal(str(agent.budget_usd)):
            ctx.emit(
                RunFailed(
                    error_class="budget",
                    message=f"spent ${spent:.4f}, over the budget of ${agent.budget_usd:g}",
                )
            )
            return
        ctx.send(ctx.actor_id, Continue())

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


def build_request(agent: Agent, messages: tuple[Message, ...]) -> ModelRequest:
    """The request this code makes for ``messages``: what digests are computed from."""
    _, model_id = parse_model(agent.model)
    return ModelRequest(
        model=model_id,
        system=agent.system,
        messages=messages,
        tools=tuple(
            ToolSpec(name=t.name, description=t.description, input_schema=t.input_schema)
            for t in agent.tools
        ),
        max_tokens=agent.max_tokens,
    )


def verify(ctx: Context[RunState], agent: Agent, *, go_on: bool) -> None:
    """Check each recorded call against the request this code would send now (one pass over the
    journal); at the first difference, void that call and every later one."""
    digest, since = DIGEST_GENESIS, 0
    for call in ctx.state.calls:
        request = build_request(agent, ctx.state.messages[: call.messages_len])
        digest = chain(digest, request, since=since)
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
        since = call.messages_len


async def _run_tool(tool: Tool, run_id: str, intent: ToolIntended) -> tuple[str, bool]:
    """Run a tool under its intent's key; its failures go back to the model as error results."""
    tctx = ToolContext(
        run_id=run_id, tool_call_id=intent.call_id, idempotency_key=intent.idempotency_key
    )
    try:
        with anyio.fail_after(tool.timeout):
            result = await tool.fn(tctx, **intent.arguments)
    except TimeoutError:
        return f"{tool.name} timed out after {tool.timeout:g}s", True
    except Exception as exc:  # noqa: BLE001  (a tool's failure is the model's to handle)
        return f"{tool.name} failed: {type(exc).__name__}: {exc}", True
    if isinstance(result, str):
        return result, False
    return orjson.dumps(result, default=str).decode(), False
