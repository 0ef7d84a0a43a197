"""The call cells' oracle: a ``caller`` run that calls the ``callee`` agent once, faulted at one
phase of the call, against the clean run's result.

- the caller completed with the clean run's output (which quotes the callee's answer: the
  child's result reached the caller's model);
- exactly one child run for the call (``toren.actors`` rows of kind ``toren.run`` whose parent is
  the caller), the one its ``child.started`` names, completed with the clean child's output;
- in the caller's journal one ``child.started``, one ``child.finished`` and one ``tool.result``
  for the call, that result the child's output;
- every model call of caller and child made, each once, plus at most the repeats the cell allows
  (the calls of either run the server had seen and the journals had not recorded at the fault;
  one for a worker that lives on); none sent again after its ``model.called`` was recorded; each
  run's receipt replayed what its journal says, the caller's counts its child once;
- each run's calls made and lost in flight are what the server received of it (see
  :func:`chaos.oracle.lost_problems`), the child's lost calls counted in the caller's receipt;
- the child's ticket applied once, under a key its ``tool.intent`` recorded first;
- both journals contiguous, their epochs never going back (after a takeover of the caller, no
  write to its journal from the zombie's epoch); nothing dead-lettered.
"""

from __future__ import annotations

from collections import Counter
from decimal import Decimal
from typing import Any

import asyncpg
import attrs

from chaos.oracle import (
    Row,
    Takeover,
    Verdict,
    effect_problems,
    journal_problems,
    lost_note,
    lost_problems,
    replay_problems,
    sent_again,
)
from chaos.servers import Effect, case, position
from toren import Client
from toren.runs import RUN_KIND, RunState, read_run, receipt


@attrs.frozen
class CallExpected:
    """What the clean call run did."""

    output: str  # the caller's
    steps: int  # the caller's model calls
    child_output: str
    child_steps: int
    effect_kinds: tuple[str, ...]  # the child's


@attrs.frozen
class RunSeen:
    """One run of the call, gathered once the caller has finished (or not)."""

    run_id: str
    state: RunState
    journal: tuple[Row, ...]
    arrivals: tuple[tuple[float, int], ...]  # (when, step) of each model request for this run


@attrs.frozen
class CallObserved:
    caller: RunSeen
    children: tuple[RunSeen, ...]  # every run whose parent is the caller
    effects: tuple[Effect, ...]  # applied for the caller or any of its children
    deadletters: int
    allowed_repeats: int
    takeover: Takeover | None = None  # of the caller (a sigstop cell faults the caller)
    # (run, step) of a call announced and not yet sent at the fault (see lost_problems)
    unsent: frozenset[tuple[str, int]] = frozenset()

    @property
    def state(self) -> RunState:
        return self.caller.state


async def _seen(
    client: Client, run_id: str, arrivals: list[tuple[float, dict[str, Any]]]
) -> RunSeen:
    state = await read_run(client, run_id)
    rows = await client.pool.fetch(
        "SELECT seq, epoch, type, data, extract(epoch FROM created_at)::float8 AS at "
        "FROM toren.journal WHERE actor_id = $1 ORDER BY seq",
        run_id,
    )
    return RunSeen(
        run_id=run_id,
        state=state,
        journal=tuple(Row(r["seq"], r["epoch"], r["type"], r["data"], r["at"]) for r in rows),
        arrivals=tuple((t, position(r)) for t, r in arrivals if case(r) == state.input),
    )


async def child_runs(pool: asyncpg.Pool, parent: str) -> list[str]:
    """The runs whose parent is ``parent``, as ``toren.actors`` has them."""
    rows = await pool.fetch(
        "SELECT actor_id FROM toren.actors WHERE parent = $1 AND kind = $2 ORDER BY actor_id",
        parent,
        RUN_KIND,
    )
    return [r["actor_id"] for r in rows]


async def observe_call(
    client: Client,
    run_id: str,
    arrivals: list[tuple[float, dict[str, Any]]],
    effects: list[Effect],
    *,
    allowed_repeats: int,
    takeover: Takeover | None = None,
    unsent: frozenset[tuple[str, int]] = frozenset(),
) -> CallObserved:
    caller = await _seen(client, run_id, arrivals)
    children = [await _seen(client, c, arrivals) for c in await child_runs(client.pool, run_id)]
    runs = {run_id, *(c.run_id for c in children)}
    return CallObserved(
        caller=caller,
        children=tuple(children),
        effects=tuple(e for e in effects if e.run in runs),
        deadletters=await client.pool.fetchval("SELECT count(*) FROM toren.deadletters"),
        allowed_repeats=allowed_repeats,
        takeover=takeover,
        unsent=unsent,
    )


def call_note(seen: CallObserved) -> str:
    """For the tables: the calls of caller and child counted lost in flight."""
    runs = [("caller", seen.caller), *(("child", c) for c in seen.children)]
    return "; ".join(
        f"{who}: {found}" for who, run in runs if (found := lost_note(run.journal, run.arrivals))
    )


def judge_call(seen: CallObserved, expected: CallExpected) -> Verdict:
    problems: list[str] = []
    caller = seen.caller
    state = caller.state
    if state.status != "completed":
        problems.append(f"caller run {state.status} ({state.error_class}: {state.error})")
    elif state.output != expected.output:
        problems.append(f"output {state.output!r}, expected {expected.output!r}")

    # One child, the one the call started, ended as the clean one did.
    started = [r for r in caller.journal if r.type == "child.started"]
    finished = [r for r in caller.journal if r.type == "child.finished"]
    ids = [c.run_id for c in seen.children]
    if len(started) != 1:
        problems.append(f"{len(started)} child.started in the caller's journal, expected one")
    if len(ids) != 1:
        problems.append(f"{len(ids)} child runs for the call ({ids}), expected one")
    child = seen.children[0] if len(seen.children) == 1 else None
    if started and child is not None and started[0].data["run_id"] != child.run_id:
        problems.append(
            f"child.started names {started[0].data['run_id']}, the child run is {child.run_id}"
        )
    if child is not None:
        if child.state.status != "completed":
            problems.append(f"child run {child.state.status} ({child.state.error_class})")
        elif child.state.output != expected.child_output:
            problems.append(
                f"child output {child.state.output!r}, expected {expected.child_output!r}"
            )
        if child.state.status == "completed" and not finished:
            problems.append("the child run completed, but its caller never recorded its end")

    # Its end recorded once, its output the call's result once.
    if len(finished) != 1:
        problems.append(f"{len(finished)} child.finished in the caller's journal, expected one")
    if started:
        call_id = started[0].data["call_id"]
        results = [
            r for r in caller.journal if r.type == "tool.result" and r.data["call_id"] == call_id
        ]
        if len(results) != 1:
            problems.append(f"{len(results)} tool.result for the call {call_id}, expected one")
        elif child is not None and results[0].data["content"] != child.state.output:
            problems.append(
                f"the call's result {results[0].data['content']!r} is not the child's output"
            )

    # Model calls of both runs: each once, plus the repeats the fault allows (together).
    runs = [(caller, expected.steps), (child, expected.child_steps)]
    repeats = 0
    duplicate_usd = Decimal(0)
    for seen_run, steps in runs:
        if seen_run is None:
            continue
        who = "caller" if seen_run is caller else "child"
        counts = Counter(step for _, step in seen_run.arrivals)
        missing = sorted(set(range(steps)) - set(counts))
        if missing:
            problems.append(f"{who}: model calls for steps {missing} never made")
        repeats += sum(n - 1 for n in counts.values())
        problems.extend(f"{who}: {p}" for p in sent_again(seen_run.arrivals, seen_run.journal))
        problems.extend(f"{who}: {p}" for p in replay_problems(seen_run.state, seen_run.journal))
        unsent = frozenset(step for run, step in seen.unsent if run == seen_run.run_id)
        problems.extend(
            f"{who}: {p}"
            for p in lost_problems(
                seen_run.state, seen_run.journal, seen_run.arrivals, unsent=unsent
            )
        )
        takeover = seen.takeover if seen_run is caller else None
        problems.extend(f"{who}: {p}" for p in journal_problems(seen_run.journal, takeover))
        cost = {c.step: Decimal(c.cost_usd or 0) for c in seen_run.state.calls}
        duplicate_usd += sum(
            (cost.get(step + 1, Decimal(0)) * (n - 1) for step, n in counts.items()), Decimal(0)
        )
    if repeats > seen.allowed_repeats:
        shown = {
            who: dict(sorted(Counter(s for _, s in r.arrivals).items()))
            for who, r in (("caller", caller), ("child", child))
            if r is not None
        }
        problems.append(
            f"{repeats} model calls paid again, {seen.allowed_repeats} allowed: {shown}"
        )
    r = receipt(state)
    if not problems and (r.calls_made, r.child_runs, r.child_calls_made) != (
        expected.steps,
        1,
        expected.child_steps,
    ):
        problems.append(
            f"caller's receipt: {r.calls_made} calls, {r.child_runs} child runs with "
            f"{r.child_calls_made} calls; expected {expected.steps}, 1, {expected.child_steps}"
        )
    if child is not None and (r.child_calls_lost, r.child_usd_lost_estimated) != (
        child.state.lost_calls,
        child.state.lost_usd,
    ):
        problems.append(
            f"caller's receipt: {r.child_calls_lost} child calls lost in flight "
            f"(${r.child_usd_lost_estimated}), the child's says {child.state.lost_calls} "
            f"(${child.state.lost_usd})"
        )

    # The child's effect: once, under its own intent's key, announced first.
    if child is not None:
        problems.extend(effect_problems(seen.effects, child.journal, expected.effect_kinds))
    if seen.deadletters:
        problems.append(f"{seen.deadletters} messages dead-lettered")
    return Verdict(tuple(problems), repeats, duplicate_usd)
