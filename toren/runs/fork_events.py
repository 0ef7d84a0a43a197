"""A fork's record of where it came from (``run.forked``), and what it does to the run's state.

A fork (:func:`toren.runs.fork_run`) is a new run whose journal starts with a copy of another
run's events up to a step, followed by ``run.forked``. Folding that event turns the copied state
into the fork's own: the calls copied are taken by value (never checked or paid again), the
totals start from nothing (what the source paid is not the fork's spend), the run stands alone
(no parent, watcher or chain: its end goes nowhere but its own record), its clock starts now,
its sandbox is its own (started from the workspace as it was at the step), and the edited human
message or the new input replaces the text the model sees from the step on.
"""

from __future__ import annotations

from decimal import Decimal
from typing import TYPE_CHECKING

import attrs
from pyrsistent import pmap, pset, pvector

from toren._agent.model import Message, Text
from toren._agent.principal import Principal
from toren._core.codec import message
from toren._core.history import History
from toren.runs.events import FORMAT

if TYPE_CHECKING:
    from toren.runs.state import RunState


@message("run.forked")
@attrs.frozen(kw_only=True)
class RunForked:
    """This run is a fork of ``source`` from its model call ``step`` (as ``toren jobs show``
    numbers them): the events before are a copy of the source's, and its ``calls`` model calls
    are taken by value. ``message`` replaces the last human message before the step, ``input``
    the run's input (at most one of them). ``checkpoint`` is the source's sandbox workspace as it
    was at the step (``None``: no sandboxed call before it). ``upgrade``: the fork runs on the
    agent's current version rather than the source's."""

    source: str
    step: int
    calls: int
    message: str | None = None
    input: str | None = None
    checkpoint: str | None = None
    upgrade: bool = False
    by: Principal | None = None
    at: float = 0.0
    v: int = FORMAT


def human_text(messages: History[Message], *, last: bool) -> tuple[int, int] | None:
    """Where a human's text is in the conversation: the input (``last`` false: the first user
    message's first text) or the last human message (the last text block of a user turn: tool
    results are the other blocks users' turns hold), as (message index, block index)."""
    # (never into turns a long conversation released: see toren.runs.release_events)
    first = messages.released
    if first and not last:
        return None  # the input was released
    indexes = range(len(messages) - 1, first - 1, -1) if last else range(first, len(messages))
    for i in indexes:
        turn = messages[i]
        if turn.role != "user":
            continue
        blocks = range(len(turn.content) - 1, -1, -1) if last else range(len(turn.content))
        for j in blocks:
            if isinstance(turn.content[j], Text):
                return i, j
    return None


def _replaced(messages: History[Message], where: tuple[int, int], text: str) -> History[Message]:
    i, j = where
    turn = messages[i]
    content = (*turn.content[:j], Text(text=text), *turn.content[j + 1 :])
    return messages.set(i, Message(role=turn.role, content=content))


def forked(state: RunState, event: RunForked) -> RunState:
    """The fork's state from the copied one (see the module's doc)."""
    messages, heard, given = state.messages, state.heard, state.input
    if event.input is not None:
        where = human_text(messages, last=False)
        if where is not None:
            messages = _replaced(messages, where, event.input)
        given = event.input
    if event.message is not None and len(heard) > heard.released:
        where = human_text(messages, last=True)
        if where is not None:
            messages = _replaced(messages, where, event.message)
        heard = heard.set(-1, (heard[-1][0], event.message))
    kept = len(state.calls)
    return attrs.evolve(
        state,
        input=given,
        messages=messages,
        heard=heard,
        forked=event,
        # The copied calls (and compactions) are served from the journal, never checked again.
        settled_calls=kept,
        replayed=kept,
        compactions_replayed=len(state.compactions),
        # What the source paid is on its receipt, not the fork's (the fork's counts from here).
        voided=History(),
        usd_paid=Decimal(0),
        unpriced=0,
        unreadable=0,
        input_tokens=0,
        output_tokens=0,
        summary_calls=0,
        compactions_soft=0,
        compactions_hard=0,
        tokens_saved=0,
        lost_calls=0,
        lost_usd=Decimal(0),
        child_runs=0,
        child_calls=0,
        child_usd=Decimal(0),
        child_input_tokens=0,
        child_output_tokens=0,
        child_unpriced=0,
        child_lost_calls=0,
        child_lost_usd=Decimal(0),
        running=pmap(),
        # A run of its own: no parent to answer, no schedule watching, no chain above it.
        parent="",
        parent_call="",
        watcher="",
        chain=(),
        depth_limit=None,
        status="running",
        output=None,
        error_class=None,
        error=None,
        calling=None,
        rate_wait=None,
        inbox=pvector(),
        started_at=event.at,
        parked_since=None,
        parked_seconds=0.0,
        failed_attempts=0,
        tool_failures=0,
        retries=0,
        refusals=0,
        refusals_since=0.0,
        # Its sandbox is its own, spawned with its first sandboxed call.
        sandbox="",
        sandbox_waiting=pset(),
        sandbox_failed=None,
    )
