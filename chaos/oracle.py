"""The oracle: what must hold after every faulted run, against the clean run's result.

- the same final output;
- every distinct model call paid once, plus at most the repeats the cell allows (a call that
  was in flight at the fault); no call is sent again once its ``model.called`` is recorded, and
  the receipt's replayed count is the calls the server saw only once, before they were recorded;
- each keyed effect applied exactly once (one key per effect, the tracker applies a key once),
  and its ``tool.intent`` recorded before the tracker saw it;
- the journal's sequence contiguous, epochs never going back, no write from a stale epoch after
  a takeover;
- nothing dead-lettered; the run finished (the harness bounds the wait).
"""

from __future__ import annotations

from collections import Counter
from decimal import Decimal
from typing import Any

import asyncpg
import attrs

from chaos.servers import Effect, case, position
from toren.runs import RunState, receipt


@attrs.frozen
class Takeover:
    """Where the journal stood when a survivor held the run at a new epoch."""

    seq: int
    epoch: int


@attrs.frozen
class Expected:
    """What the clean run did."""

    output: str
    steps: int
    effect_kinds: tuple[str, ...]


@attrs.frozen
class Row:
    seq: int
    epoch: int
    type: str
    data: Any
    at: float  # transaction start, seconds since the epoch (Postgres now())


@attrs.frozen
class Observed:
    """Everything the oracle looks at, gathered once the run has finished (or not)."""

    state: RunState
    journal: tuple[Row, ...]
    arrivals: tuple[tuple[float, int], ...]  # (when, step) of each model request for this run
    effects: tuple[Effect, ...]
    deadletters: int
    allowed_repeats: int
    takeover: Takeover | None


@attrs.frozen
class Verdict:
    problems: tuple[str, ...]
    duplicate_calls: int
    duplicate_usd: Decimal


async def observe(
    pool: asyncpg.Pool,
    run_id: str,
    state: RunState,
    arrivals: list[tuple[float, dict[str, Any]]],
    effects: list[Effect],
    *,
    allowed_repeats: int,
    takeover: Takeover | None,
) -> Observed:
    rows = await pool.fetch(
        "SELECT seq, epoch, type, data, extract(epoch FROM created_at)::float8 AS at "
        "FROM toren.journal WHERE actor_id = $1 ORDER BY seq",
        run_id,
    )
    dead = await pool.fetchval("SELECT count(*) FROM toren.deadletters")
    return Observed(
        state=state,
        journal=tuple(Row(r["seq"], r["epoch"], r["type"], r["data"], r["at"]) for r in rows),
        arrivals=tuple((t, position(r)) for t, r in arrivals if case(r) == state.input),
        effects=tuple(e for e in effects if e.run == run_id),
        deadletters=dead,
        allowed_repeats=allowed_repeats,
        takeover=takeover,
    )


def judge(seen: Observed, expected: Expected) -> Verdict:
    problems: list[str] = []
    state = seen.state
    if state.status != "completed":
        problems.append(f"run {state.status} ({state.error_class}: {state.error})")
    elif state.output != expected.output:
        problems.append(f"output {state.output!r}, expected {expected.output!r}")

    # Model calls: each step once, plus the allowed repeats of a call in flight at the fault.
    counts = Counter(step for _, step in seen.arrivals)
    missing = sorted(set(range(expected.steps)) - set(counts))
    if missing:
        problems.append(f"model calls for steps {missing} never made")
    repeats = sum(n - 1 for n in counts.values())
    if repeats > seen.allowed_repeats:
        problems.append(
            f"{repeats} model calls paid again, {seen.allowed_repeats} allowed: "
            f"{dict(sorted(counts.items()))}"
        )
    recorded = {r.data["step"]: r for r in seen.journal if r.type == "model.called"}
    for when, step in seen.arrivals:
        record = recorded.get(step + 1)
        if record is not None and when > record.at:
            problems.append(f"step {step + 1} was sent again after it was recorded")
    r = receipt(state)
    if r.calls_made != expected.steps and not problems:
        problems.append(f"receipt: {r.calls_made} calls made, expected {expected.steps}")
    resumed = [row.data["replayed"] for row in seen.journal if row.type == "run.resumed"]
    if r.calls_replayed != max(resumed, default=0):
        problems.append(f"receipt: {r.calls_replayed} replayed, the journal says {resumed}")

    # Keyed effects: one key per effect, applied once, announced by an intent first.
    kinds = Counter(e.kind for e in seen.effects)
    if sorted(kinds) != sorted(expected.effect_kinds) or any(n != 1 for n in kinds.values()):
        problems.append(f"effects applied {dict(kinds)}, expected each of {expected.effect_kinds}")
    intents = {r.data["idempotency_key"]: r for r in seen.journal if r.type == "tool.intent"}
    for effect in seen.effects:
        intent = intents.get(effect.key)
        if intent is None:
            problems.append(f"{effect.kind} applied under a key no intent recorded")
        elif intent.at > effect.applied_at:
            problems.append(f"{effect.kind} applied before its tool.intent was recorded")

    # The journal: contiguous, epochs never going back, nothing stale after a takeover.
    seqs = [row.seq for row in seen.journal]
    if seqs != list(range(1, len(seqs) + 1)):
        problems.append(f"journal sequence not contiguous: {seqs}")
    epochs = [row.epoch for row in seen.journal]
    if epochs != sorted(epochs):
        problems.append(f"journal epochs go back: {epochs}")
    if seen.takeover is not None:
        stale = [
            row.seq
            for row in seen.journal
            if row.seq > seen.takeover.seq and row.epoch < seen.takeover.epoch
        ]
        if stale:
            problems.append(
                f"stale write: seq {stale} written at an epoch below {seen.takeover.epoch} "
                "after the takeover"
            )
    if seen.deadletters:
        problems.append(f"{seen.deadletters} messages dead-lettered")

    cost = {c.step: Decimal(c.cost_usd or 0) for c in state.calls}
    duplicate_usd = sum(
        (cost.get(step + 1, Decimal(0)) * (n - 1) for step, n in counts.items()), Decimal(0)
    )
    return Verdict(tuple(problems), repeats, duplicate_usd)
