"""What must hold after a version cell (:mod:`chaos.versions`), against its clean cell.

After an **upgrade** cell (:func:`judge_upgrade`): every check of the plain cells
(:func:`chaos.oracle.judge`: the clean cell's output, no model call paid twice but the one in
flight, each effect once, the journal contiguous, one approval, nothing dead-lettered), and one
``run.upgraded``, from the version the run started on to the one ``upgrade_run`` named, by value
(the policy is ``next_turn``), naming the harness as who asked; no step invalidated; the run's
row routed to the new version (pinned); the requests made before the move carry the old
version's system prompt, those after the new one's.

After a **fork** cell (:func:`judge_fork`): the fork completed with the clean fork's output; its
journal starts with the events the clean fork copied, each equal by value to its source's (seq,
type, data), then one ``run.forked`` naming the step, the whole contiguous, its epochs never
going back; no call before the step paid by anybody (the model server's count since the fork
was made), from the step on each call's requests what its journal counts (made, or lost in
flight), paid twice only for the call in flight at the fault; each effect of the fork applied
once, after its intent, under a key of the fork's own intents (never its source's), and its
approvals asked again as the clean fork's; the source's effects not asked for again and its
journal unchanged byte for byte (every column, the data as Postgres' text); nothing
dead-lettered.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

import attrs

from chaos.app import versioned_system
from chaos.oracle import Expected, Observed, Row, Verdict, duplicate_usd, journal_problems, judge
from chaos.servers import Effect
from toren._agent.routes import version_route
from toren.runs import Receipt, RunState

NAME = "versioned"  # the agent (chaos.app)
DEPLOY = "2"  # the CHAOS_VERSION of the workers of the version a run is moved to
ASKED_BY = "chaos"  # the id of the principal the harness upgrades runs as (chaos.harness.CHAOS)


@attrs.frozen
class ForkExpected:
    """What the clean fork did."""

    output: str
    steps: int  # its model calls, the copied ones included
    prefix: tuple[str, ...]  # the types of the events it copied from its source
    effect_kinds: tuple[str, ...]  # the effects it applied itself
    asked: int  # the approvals it asked again


@attrs.frozen
class UpgradeObserved:
    run: Observed  # as a plain cell's run (chaos.oracle)
    # (when, position, system prompt) of each of its requests
    systems: tuple[tuple[float, int, str], ...]
    target: str  # the version upgrade_run moved it to ("" if never called)
    route: str  # its row's route at the end


@attrs.frozen
class ForkObserved:
    state: RunState  # the fork's
    receipt: Receipt  # ... and its receipt
    journal: tuple[Row, ...]  # the fork's
    source: tuple[Row, ...]  # the source's journal when the fork was made
    source_raw: tuple[tuple[Any, ...], ...]  # ... byte for byte
    source_raw_after: tuple[tuple[Any, ...], ...]  # ... and after the cell
    arrivals: tuple[tuple[float, int], ...]  # (when, position): the requests since the fork
    effects: tuple[Effect, ...]  # applied by the fork
    source_effects: tuple[tuple[str, str, int], ...]  # (key, kind, requests) when it was made
    source_effects_after: tuple[tuple[str, str, int], ...]  # ... and after the cell
    deadletters: int
    allowed_repeats: int  # the fork's calls in flight at the fault
    unsent: frozenset[int]  # the step announced and not sent at the fault
    at: int


def judge_upgrade(seen: UpgradeObserved, expected: Expected) -> Verdict:
    verdict = judge(seen.run, expected)
    problems = [*verdict.problems, *upgrade_problems(seen)]
    return Verdict(tuple(problems), verdict.duplicate_calls, verdict.duplicate_usd)


def upgrade_problems(seen: UpgradeObserved) -> list[str]:
    """One ``run.upgraded``, by value, to the version asked; no step invalidated; the row pinned
    to the new version; each request made by the version the run was on."""
    journal = seen.run.journal
    problems = []
    started = next((r for r in journal if r.type == "run.started"), None)
    version = started.data.get("version", "") if started is not None else ""
    upgrades = [r for r in journal if r.type == "run.upgraded"]
    if len(upgrades) != 1:
        problems.append(f"run.upgraded recorded {len(upgrades)} times, expected once")
    for row in upgrades:
        was, to, how = (row.data.get(k) for k in ("from_version", "to_version", "how"))
        if (was, to, how) != (version, seen.target, "value"):
            problems.append(
                f"run.upgraded at seq {row.seq} moved {was!r} to {to!r} by {how!r}; expected "
                f"{version!r} to {seen.target!r} by 'value'"
            )
        who = (row.data.get("by") or {}).get("id")
        if who != ASKED_BY:
            problems.append(
                f"run.upgraded at seq {row.seq} names {who!r} as who asked, not the harness"
            )
    if not version or version == seen.target:
        problems.append(f"the run started on version {version!r} and moved to {seen.target!r}")
    invalidated = [r.data.get("from_step") for r in journal if r.type == "steps.invalidated"]
    if invalidated:
        problems.append(f"steps invalidated from {invalidated}: calls taken by value were re-asked")
    pinned = version_route(NAME, seen.target)
    if seen.route != pinned:
        problems.append(f"the run's route is {seen.route!r}, not {pinned!r}: not pinned")
    # The requests sent before the move were version A's, those after it B's.
    moved = next((r.at for r in journal if r.type == "run.upgraded"), None)
    if moved is not None:
        old, new = versioned_system(""), versioned_system(DEPLOY)
        for when, step, system in seen.systems:
            want = old if when < moved else new
            if system != want:
                which = "before" if when < moved else "after"
                problems.append(
                    f"step {step + 1}, asked {which} the move, was asked with system prompt "
                    f"{system!r}, expected {want!r}"
                )
    return problems


def judge_fork(seen: ForkObserved, expected: ForkExpected) -> Verdict:
    problems = []
    state = seen.state
    if state.status != "completed":
        problems.append(f"fork {state.status} ({state.error_class}: {state.error})")
    elif state.output != expected.output:
        problems.append(f"fork output {state.output!r}, expected {expected.output!r}")
    problems += prefix_problems(seen, expected)
    calls, counts = fork_call_problems(seen, expected)
    problems += calls
    problems += fork_effect_problems(seen, expected)
    problems += source_problems(seen)
    if seen.deadletters:
        problems.append(f"{seen.deadletters} messages dead-lettered")
    repeats = sum(n - 1 for n in counts.values())
    return Verdict(tuple(problems), repeats, duplicate_usd(state, counts))


def cut_at(journal: Sequence[Row]) -> int | None:
    """Where the fork's own events start: the index of its ``run.forked`` (None: none)."""
    return next((i for i, r in enumerate(journal) if r.type == "run.forked"), None)


def prefix_problems(seen: ForkObserved, expected: ForkExpected) -> list[str]:
    """The fork's journal: the clean fork's prefix, equal by value to the source's first events,
    then one ``run.forked`` naming its source and step."""
    cut = cut_at(seen.journal)
    forked = [r for r in seen.journal if r.type == "run.forked"]
    if cut is None or len(forked) != 1:
        return [f"run.forked recorded {len(forked)} times in the fork, expected once"]
    problems = []
    prefix = seen.journal[:cut]
    types = tuple(r.type for r in prefix)
    if types != expected.prefix:
        problems.append(
            f"the fork copied {len(types)} events of its source before run.forked {list(types)}; "
            f"the clean fork copied {len(expected.prefix)} {list(expected.prefix)}"
        )
    for mine, theirs in zip(prefix, seen.source, strict=False):
        if (mine.seq, mine.type, mine.data) != (theirs.seq, theirs.type, theirs.data):
            problems.append(
                f"the fork's event {mine.seq} ({mine.type}) is not its source's "
                f"({theirs.seq}, {theirs.type}) by value"
            )
    if len(prefix) > len(seen.source):
        problems.append(f"the fork holds {len(prefix)} events before run.forked, its source fewer")
    steps = [r.data["step"] for r in prefix if r.type == "model.called"]
    if steps != list(range(1, seen.at)):
        problems.append(f"the fork copied the calls of steps {steps}, forked at step {seen.at}")
    step = forked[0].data.get("step", forked[0].data.get("at"))
    if step != seen.at:
        problems.append(f"run.forked names step {step}, the fork was made at {seen.at}")
    # Contiguous; the copied events and run.forked at epoch 0 (no claim wrote them), then its
    # own, the epochs never going back.
    problems += [f"fork: {p}" for p in journal_problems(seen.journal, None)]
    return problems


def _live(seen: ForkObserved) -> tuple[Row, ...]:
    cut = cut_at(seen.journal)
    return seen.journal[cut + 1 :] if cut is not None else seen.journal


def fork_call_problems(
    seen: ForkObserved, expected: ForkExpected
) -> tuple[list[str], Counter[int]]:
    """The calls before the fork's step paid by nobody; from the step on, each call's requests
    are what its journal counts (made or lost in flight), paid twice only for the call in flight
    at the fault; every call of the clean fork made. Returns the problems and the requests per
    position."""
    live = _live(seen)
    received = Counter(pos + 1 for _, pos in seen.arrivals)
    made = Counter(r.data["step"] for r in live if r.type in ("model.called", "model.unreadable"))
    lost: Counter[int] = Counter()
    for row in live:
        if row.type == "model.lost":
            lost[row.data["step"]] += row.data["count"]
    problems = [
        f"step {step}, before the fork's step {seen.at}, paid again ({n} requests since the fork)"
        for step, n in sorted(received.items())
        if step < seen.at
    ]
    missing = sorted(set(range(seen.at, expected.steps + 1)) - set(made))
    if missing:
        problems.append(f"the fork never recorded the calls of steps {missing}")
    over = 0  # announced, never sent, counted lost (see chaos.oracle.lost_problems)
    for step in sorted((set(received) | set(made) | set(lost)) - set(range(seen.at))):
        n, m, k = received[step], made[step], lost[step]
        if m + k == n + 1 and step in seen.unsent:
            over += 1
        elif m + k != n:
            problems.append(
                f"fork step {step}: the server received {n} requests, the journal counts {m} "
                f"made and {k} lost in flight"
            )
    counts = Counter(pos for _, pos in seen.arrivals)
    repeats = sum(n - 1 for n in counts.values())
    if repeats > seen.allowed_repeats:
        problems.append(
            f"{repeats} model calls of the fork paid again, {seen.allowed_repeats} allowed: "
            f"{dict(sorted(received.items()))}"
        )
    recorded = {r.data["step"]: r.at for r in live if r.type == "model.called"}
    for when, pos in seen.arrivals:
        if pos + 1 in recorded and when > recorded[pos + 1]:
            problems.append(f"fork step {pos + 1} was sent again after it was recorded")
    # Its receipt: the calls before the step inherited (not made, not paid), the others made or
    # lost in flight as the server received them.
    r = seen.receipt
    if r.calls_inherited != seen.at - 1:
        problems.append(f"fork receipt: {r.calls_inherited} calls inherited, forked at {seen.at}")
    if r.calls_lost != sum(lost.values()):
        problems.append(
            f"fork receipt: {r.calls_lost} lost in flight, the journal says {dict(lost)}"
        )
    elif r.calls_made + r.calls_lost != len(seen.arrivals) + over:
        problems.append(
            f"fork receipt: {r.calls_made} calls made and {r.calls_lost} lost in flight, the "
            f"server received {len(seen.arrivals)} since the fork"
        )
    return problems, counts


def fork_effect_problems(seen: ForkObserved, expected: ForkExpected) -> list[str]:
    """Each effect of the fork applied once, under a key of its own intents (not its source's),
    after its intent; its approvals asked again."""
    live = _live(seen)
    problems = []
    kinds = Counter(e.kind for e in seen.effects)
    if sorted(kinds.elements()) != sorted(expected.effect_kinds):
        problems.append(f"the fork applied {dict(kinds)}, expected each of {expected.effect_kinds}")
    own: dict[str, Row] = {}  # each key's first intent (as in chaos.oracle.effect_problems)
    for r in live:
        if r.type == "tool.intent":
            own.setdefault(r.data["idempotency_key"], r)
    inherited = {r.data["idempotency_key"] for r in seen.source if r.type == "tool.intent"}
    for effect in seen.effects:
        intent = own.get(effect.key)
        if effect.key in inherited:
            problems.append(f"the fork applied {effect.kind} under its source's key {effect.key}")
        elif intent is None:
            problems.append(f"the fork applied {effect.kind} under a key none of its intents holds")
        elif intent.at > effect.applied_at:
            problems.append(f"the fork's {effect.kind} applied before its tool.intent was recorded")
        if effect.requests != 1:
            problems.append(f"the fork's {effect.kind} asked for {effect.requests} times")
    asked = sum(1 for r in live if r.type == "approval.requested")
    if asked != expected.asked:
        problems.append(f"the fork asked {asked} approvals, the clean fork {expected.asked}")
    return problems


def source_problems(seen: ForkObserved) -> list[str]:
    """The source untouched: its journal byte for byte, its effects not asked for again."""
    problems = []
    if seen.source_raw_after != seen.source_raw:
        before, after = len(seen.source_raw), len(seen.source_raw_after)
        changed = [
            b[0] for b, a in zip(seen.source_raw, seen.source_raw_after, strict=False) if a != b
        ]
        problems.append(
            f"the source's journal changed: {before} events before the fork, {after} after; "
            f"rewritten: seq {changed}"
        )
    if seen.source_effects_after != seen.source_effects:
        problems.append(
            f"the source's effects were asked for again: {list(seen.source_effects)} before the "
            f"fork, {list(seen.source_effects_after)} after"
        )
    return problems


def note(seen: UpgradeObserved | ForkObserved) -> str:
    """For the tables: the calls paid twice (the one in flight)."""
    if isinstance(seen, UpgradeObserved):
        counts = Counter(pos for _, pos in seen.run.arrivals)
    else:
        counts = Counter(pos for _, pos in seen.arrivals)
    twice = sorted(pos + 1 for pos, n in counts.items() if n > 1)
    return f"step {twice} paid twice" if twice else ""
