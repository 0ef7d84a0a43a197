"""What a never-ending conversation lets go of (issue 32, item 4): the event that releases a run's
old turns from its state, when a run records it (:func:`release_due`), and its fold
(:func:`released`). A module of its own: ``events`` is full.

A run whose agent has ``Retention(conversation_keep_for=...)`` records ``history.released``
after each hard compaction but the first, naming the calls made before the hard compaction
before it (``before_calls``, that compaction's ``after_calls``). From then on those calls are
*settled*, as a fork's prefix is (``RunState.settled_calls``): never checked against the code
again, so no invalidation reaches them; and the state lets go of what only they needed, the
items of its long sequences before them being released at chunk granularity
(:meth:`~toren._core.history.History.release`): the calls but the last of them (the digest
chain goes on from it), the conversation before what the requests after them carry, the human
messages heard before them, the voided calls, the compactions before the one in effect when
they were made, their tool intents, results, decisions and questions, and the cost of each.

What stays exact: every length (calls made, voided, compactions), the running totals, and
the cumulative costs the receipt reads (kept in ``RunState.cost_marks`` when they fall in the
released part). What stays whole, because an invariant needs the past: the tool-call ids
(``tool_ids``: a new call never takes an old call's id, so a late decision for an old call
is never applied to a new one) and the count of each distinct tool call (``occurrences``:
the idempotency key of a call counts the identical calls before it, released or not).
"""

from __future__ import annotations

from decimal import Decimal
from typing import TYPE_CHECKING, TypeVar

import attrs
from pyrsistent import PMap, pmap

from toren._core.codec import message
from toren._core.errors import InternalError
from toren._core.history import History
from toren.runs.events import FORMAT

if TYPE_CHECKING:
    from toren.runs.state import RunState

V = TypeVar("V")


@message("history.released")
@attrs.frozen(kw_only=True)
class HistoryReleased:
    """The calls before ``before_calls`` are settled, and what only they needed is let go of
    from the run's state (see the module's doc). Recorded after a hard compaction; folds the
    same way whoever replays it."""

    before_calls: int
    v: int = FORMAT


def release_due(state: RunState) -> HistoryReleased | None:
    """What a run in ``state``, which just recorded a hard compaction, releases: the calls
    before the hard compaction before it; ``None`` when there is none, or nothing new."""
    compactions = state.compactions
    hard = []
    for i in range(len(compactions) - 1, compactions.released - 1, -1):
        if compactions[i].tier == "hard":
            hard.append(compactions[i])
            if len(hard) == 2:
                break
    if len(hard) < 2:
        return None
    before = hard[1].after_calls
    if before - 1 <= state.calls.released or before > len(state.calls):
        return None
    return HistoryReleased(before_calls=before)


def cumulative(
    costs: History[Decimal], count: int, marks: PMap[str, Decimal], kind: str
) -> Decimal:
    """The running cost of the first ``count`` items (``costs[count - 1]``), read from
    ``marks`` when that item was released (see :func:`released`).

    Raises:
        InternalError: it was released and not marked (a bug: the fold marks what it
            releases that the receipt reads)."""
    if count <= 0:
        return Decimal(0)
    if count - 1 >= costs.released:
        return costs[count - 1]
    mark = marks.get(f"{kind}:{count}")
    if mark is None:
        raise InternalError(f"the {kind} cost of the first {count} was released unmarked")
    return mark


def released(state: RunState, event: HistoryReleased) -> RunState:
    """The state after ``event`` (pure; a value out of range releases what it can, or
    nothing)."""
    calls = state.calls
    before = min(event.before_calls, len(calls))
    upto = before - 1  # the last call before ``before`` stays: the digest chain goes on from it
    if upto <= calls.released:
        return state
    compactions = state.compactions
    # The compaction in effect when call ``before`` was made stays (the chain restarts from it);
    # so does every later one; and the conversation from the first of them on.
    keep_from = compactions.released
    for i in range(compactions.released, len(compactions)):
        if compactions[i].after_calls > before:
            break
        keep_from = i
    first_message = calls[before - 1].messages_len
    for i in range(keep_from, len(compactions)):
        first_message = min(first_message, compactions[i].base)
    heard = state.heard
    heard_before = heard.released
    for when, _ in heard:
        if when >= before:
            break
        heard_before += 1
    ids = {c.id for i in range(calls.released, upto) for c in calls[i].response.tool_calls}
    # The cumulative costs the receipt reads, for counts whose last item goes.
    marks: dict[str, Decimal] = {}
    inherited = state.forked.calls if state.forked else 0
    for kind, costs, counts, cut in (
        ("kept", state.kept_cost, (state.replayed, inherited), upto),
        ("compaction", state.compaction_cost, (state.compactions_replayed,), keep_from),
    ):
        for count in counts:
            if 0 < count <= cut:
                marks[f"{kind}:{count}"] = cumulative(costs, count, state.cost_marks, kind)
    return attrs.evolve(
        state,
        calls=calls.release(upto),
        settled_calls=max(state.settled_calls, before),
        messages=state.messages.release(first_message),
        heard=heard.release(heard_before),
        voided=state.voided.release(len(state.voided)),
        intents=state.intents.release(ids),
        results=state.results.release(ids),
        decisions=_without(state.decisions, ids),
        asked=state.asked.difference(ids),
        kept_cost=state.kept_cost.release(upto),
        compactions=compactions.release(keep_from),
        compaction_cost=state.compaction_cost.release(keep_from),
        cost_marks=pmap(marks),
    )


def _without(items: PMap[str, V], keys: set[str]) -> PMap[str, V]:
    drop = items.evolver()
    for key in keys:
        if key in items:
            del drop[key]
    return drop.persistent()
