"""The request this code makes for a run's model call, and the digest chain over those requests.

Each recorded call carries the digest of the request it was (:func:`request_digest`); on resume
the run checks its recorded calls against the requests this code would make now
(:func:`verify`), and at the first difference voids that call and every later one. The chain
restarts at the first call after a compaction (from ``GENESIS``, over the compaction's prefix and
the messages after its base), so checking a journal stays linear and an invalidation stays exact
on both sides of it.

Every request is built through :func:`build_request`, looked up here at each call (tests
redeploy a changed build by replacing it on this module).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator, Mapping

from toren import Context, __version__
from toren.actors.runs import calls
from toren.providers import parse_model
from toren.runs import (
    GENESIS,
    Agent,
    Continue,
    Message,
    ModelCalled,
    ModelRequest,
    RunState,
    StepsInvalidated,
    ToolSpec,
    chain,
)

log = logging.getLogger("toren.run")

Build = Callable[[Agent, Iterable[Message]], ModelRequest]


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


def builder(callees: Mapping[str, str]) -> Build:
    """How this code builds the requests of a run that recorded ``callees``."""
    return lambda agent, messages: build_request(agent, messages, callees)


def parameters(agent: Agent, callees: Mapping[str, str] | None = None) -> str:
    """What a request depends on besides the conversation (Toren's version, the model, the
    system prompt, the tools and callees, the limits), as a digest: calls checked against one
    set of parameters need not be checked again while it stays the same."""
    return chain(f"toren {__version__}", build_request(agent, (), callees))[:32]


def request_digest(state: RunState, request: ModelRequest) -> str:
    """The chained digest of ``request``, the next call's (built from
    :func:`~toren.runs.context_messages`): over the whole request for the first call and the
    first after a compaction, else chained from the last call's over the messages added since."""
    previous = state.calls[-1] if state.calls else None
    if previous is None:
        return chain(GENESIS, request)
    latest = state.compactions[-1] if state.compactions else None
    if latest is None:
        return chain(previous.digest, request, since=previous.messages_len)
    if latest.after_calls == len(state.calls):
        return chain(GENESIS, request)
    since = len(latest.prefix) + previous.messages_len - latest.base
    return chain(previous.digest, request, since=since)


def recomputed(
    state: RunState, agent: Agent, build: Build, *, first: int = 0
) -> Iterator[tuple[ModelCalled, str]]:
    """Each recorded call from index ``first`` on, with the digest this code's ``build`` gives
    its request: one pass over calls and compactions together, the chain restarting at each
    compaction (from ``GENESIS``, over the compaction's prefix and the messages after its base)."""
    calls, messages, compactions = state.calls, state.messages, state.compactions
    digest, since = GENESIS, 0
    if first:
        digest, since = calls[first - 1].digest, calls[first - 1].messages_len
    j = len(compactions)
    # (compactions released with a long conversation's old turns were all made before the
    # settled calls it skips: see toren.runs.release_events)
    while j > compactions.released and compactions[j - 1].after_calls >= first:
        j -= 1
    for i in range(first, len(calls)):
        call = calls[i]
        restart = None
        while j < len(compactions) and compactions[j].after_calls <= i:
            restart, j = compactions[j], j + 1
        if restart is not None:
            view = (*restart.prefix, *messages[restart.base : call.messages_len])
            digest = chain(GENESIS, build(agent, view))
        else:
            # Only the messages added since the previous call: the chain covers the rest.
            added = (messages[k] for k in range(since, call.messages_len))
            digest = chain(digest, build(agent, added))
        yield call, digest
        since = call.messages_len


def verify(
    ctx: Context[RunState], agent: Agent, *, go_on: bool, checked_as: str | None = None
) -> None:
    """Check each recorded call against the request this code would send now (one pass over the
    journal); at the first difference, void that call and every later one.

    With ``checked_as`` (this code's :func:`parameters`), the calls the state says were already
    checked against the same parameters are skipped: only those recorded since are checked.
    The state's ``settled_calls`` are never checked."""
    state = ctx.state
    first = 0
    if checked_as and state.checked_as == checked_as and state.checked_calls:
        first = min(state.checked_calls, len(state.calls))
    # Calls taken by value (a fork's prefix, the calls of a version the run moved on from) are
    # never checked again: the chain goes on from the last of them.
    first = max(first, min(state.settled_calls, len(state.calls)))
    # The chain restarts at each compaction (see recomputed).
    for call, digest in recomputed(state, agent, builder(state.callees), first=first):
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
