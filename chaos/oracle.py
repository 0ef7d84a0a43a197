"""The oracle: what must hold after every faulted run, against the clean run's result.

- the same final output;
- every distinct model call paid once, plus at most the repeats the cell allows (a call that
  was in flight at the fault); no call is sent again once its ``model.called`` is recorded, and
  the receipt's replayed count is the calls the server saw only once, before they were recorded;
- the calls made and lost in flight are what the server received, step by step and on the
  receipt (:func:`lost_problems`): a request the server received and the journal does not count
  is a call lost without a trace;
- each keyed effect applied exactly once (one key per effect, the tracker applies a key once),
  and its ``tool.intent`` recorded before the tracker saw it;
- the journal's sequence contiguous, epochs never going back, no write from a stale epoch after
  a takeover;
- exactly one ``approval.decided``: for the refund's call, approved, and sent for that call (the
  harness writes the call it meant into each decision's ``reason``); the refund applied only
  after that decision was recorded;
- every stale decision the harness sent (for a call that does not wait) refused, once per send,
  and never applied; no repeat of the right decision refused or recorded again;
- nothing dead-lettered; the run finished (the harness bounds the wait).
"""

from __future__ import annotations

from collections import Counter
from decimal import Decimal
from typing import Any, Protocol

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
class Sent:
    """A decision the harness sent: the call it named, and approve or deny."""

    call_id: str
    approved: bool


MEANT = "chaos: meant for call "


def meant_for(call_id: str) -> str:
    """The ``reason`` the harness gives a decision: it names the call the sender meant."""
    return f"{MEANT}{call_id}"


def meant(reason: str) -> str | None:
    """The call a decision's sender meant (from its ``reason``), if the harness sent it."""
    return reason[len(MEANT) :] if reason.startswith(MEANT) else None


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
    sent: tuple[Sent, ...] = ()  # the decisions the harness sent, in order
    # the step whose call was announced and not yet sent at the fault (see lost_problems);
    # None: not known (the scenarios, whose faults land anywhere)
    unsent: frozenset[int] | None = None


def early_problems(seen: Observed, early: str) -> list[str]:
    """A message sent before the run's start was handled is heard once, after the start and
    before the first model call, in the first request's user turn (after the input)."""
    kinds = [r.type for r in seen.journal]
    heard = [r.data.get("text") for r in seen.journal if r.type == "message.received"]
    if heard != [early]:
        return [f"the run heard {heard} after its start, expected the early message once"]
    first_call = kinds.index("model.called") if "model.called" in kinds else len(kinds)
    if not kinds.index("run.started") < kinds.index("message.received") < first_call:
        return [f"the early message was heard out of place: {kinds[:8]}"]
    first = seen.state.messages[0] if seen.state.messages else None
    texts = [getattr(b, "text", None) for b in first.content] if first is not None else []
    if texts != [seen.state.input, early]:
        return [f"the first turn holds {texts}, expected the input and then the early message"]
    return []


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
    sent: tuple[Sent, ...] = (),
    unsent: frozenset[int] | None = None,
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
        sent=sent,
        unsent=unsent,
    )


def judge(seen: Observed, expected: Expected) -> Verdict:
    problems, counts = run_problems(seen, output=expected.output, steps=expected.steps)
    problems.extend(effect_problems(seen.effects, seen.journal, expected.effect_kinds))
    problems.extend(journal_problems(seen.journal, seen.takeover))
    if seen.deadletters:
        problems.append(f"{seen.deadletters} messages dead-lettered")
    problems.extend(decision_problems(seen))
    repeats = sum(n - 1 for n in counts.values())
    return Verdict(tuple(problems), repeats, duplicate_usd(seen.state, counts))


class RunSeen(Protocol):
    """What :func:`run_problems` reads of an observed run."""

    @property
    def state(self) -> RunState: ...
    @property
    def arrivals(self) -> tuple[tuple[float, int], ...]: ...
    @property
    def journal(self) -> tuple[Row, ...]: ...
    @property
    def allowed_repeats(self) -> int: ...
    @property
    def unsent(self) -> frozenset[int] | None: ...


def run_problems(seen: RunSeen, *, output: str, steps: int) -> tuple[list[str], Counter[int]]:
    """The run completed with the clean run's output; each model call made once, plus the
    allowed repeats of a call in flight at the fault, none sent again once recorded; its
    receipt says so. Returns the problems, and how often each step's request arrived."""
    state, arrivals, journal, allowed_repeats = (
        seen.state,
        seen.arrivals,
        seen.journal,
        seen.allowed_repeats,
    )
    problems: list[str] = []
    if state.status != "completed":
        problems.append(f"run {state.status} ({state.error_class}: {state.error})")
    elif state.output != output:
        problems.append(f"output {state.output!r}, expected {output!r}")

    counts = Counter(step for _, step in arrivals)
    missing = sorted(set(range(steps)) - set(counts))
    if missing:
        problems.append(f"model calls for steps {missing} never made")
    repeats = sum(n - 1 for n in counts.values())
    if repeats > allowed_repeats:
        problems.append(
            f"{repeats} model calls paid again, {allowed_repeats} allowed: "
            f"{dict(sorted(counts.items()))}"
        )
    problems.extend(sent_again(arrivals, journal))
    r = receipt(state)
    if r.calls_made != steps and not problems:
        problems.append(f"receipt: {r.calls_made} calls made, expected {steps}")
    problems.extend(replay_problems(state, journal))
    problems.extend(
        lost_problems(state, journal, arrivals, unsent=seen.unsent, stops=allowed_repeats)
    )
    return problems, counts


def lost_problems(
    state: RunState,
    journal: tuple[Row, ...],
    arrivals: tuple[tuple[float, int], ...],
    *,
    unsent: frozenset[int] | None,
    stops: int = 1,
) -> list[str]:
    """Calls made and lost in flight are what the server received: for every step, the requests
    that arrived are the calls the journal records (``model.called``, ``model.unreadable``) and
    those it counts lost in flight (``model.lost``); the receipt's totals are the journal's.

    One exception, documented: a worker that stopped after the commit that announced a call
    (``model.calling``) and before it sent it is counted as having lost it (nothing can tell a
    request about to leave from one that left). ``unsent`` names the step whose call was
    announced and not received at the fault: there, one call more than received is counted.
    ``None``: faults at unknown points (the scenarios), where each of the ``stops`` of a worker
    that held the run (at least one) may have left a claim cut before its send, at any step: a
    soak can stop two workers in turn while the same step's message is claimed and its request
    not yet built (a worker just started takes over, then waits for its SDK's import). Never
    fewer than received."""
    received, made, lost = _tally(journal, arrivals)
    problems = []
    over = 0
    for step in sorted(set(received) | set(made) | set(lost)):
        n, m, k = received[step], made[step], lost[step]
        if m + k == n:
            continue
        extra = m + k - n
        if extra == 1 and unsent is not None and step in unsent:
            over += 1  # announced, claimed, never sent: counted lost
            continue
        if 0 < extra <= max(1, stops) and unsent is None:
            over += extra  # each a claim cut before its send, by a stop of its own
            continue
        problems.append(
            f"step {step}: the server received {n} requests, the journal counts {m} made and "
            f"{k} lost in flight"
        )
    r = receipt(state)
    if r.calls_lost != sum(lost.values()):
        problems.append(f"receipt: {r.calls_lost} lost in flight, the journal says {dict(lost)}")
    if not problems and r.calls_made + r.calls_lost != len(arrivals) + over:
        problems.append(
            f"receipt: {r.calls_made} calls made and {r.calls_lost} lost in flight, the server "
            f"received {len(arrivals)}"
        )
    return problems


def duplicate_usd(state: RunState, counts: Counter[int]) -> Decimal:
    """What the repeated model requests cost, at the prices of the calls recorded."""
    cost = {c.step: Decimal(c.cost_usd or 0) for c in state.calls}
    return sum((cost.get(step + 1, Decimal(0)) * (n - 1) for step, n in counts.items()), Decimal(0))


def sent_again(arrivals: tuple[tuple[float, int], ...], journal: tuple[Row, ...]) -> list[str]:
    """Model requests of one run that reached the server after their step was recorded."""
    problems = []
    recorded = {r.data["step"]: r for r in journal if r.type == "model.called"}
    for when, step in arrivals:
        record = recorded.get(step + 1)
        if record is not None and when > record.at:
            problems.append(f"step {step + 1} was sent again after it was recorded")
    return problems


def _tally(
    journal: tuple[Row, ...], arrivals: tuple[tuple[float, int], ...]
) -> tuple[Counter[int], Counter[int], Counter[int]]:
    """By step: the requests the server received, the calls the journal records made, and those
    it counts lost in flight."""
    received = Counter(step + 1 for _, step in arrivals)
    made: Counter[int] = Counter()
    lost: Counter[int] = Counter()
    for row in journal:
        if row.type in ("model.called", "model.unreadable"):
            made[row.data["step"]] += 1
        elif row.type == "model.lost":
            lost[row.data["step"]] += row.data["count"]
    return received, made, lost


def lost_note(journal: tuple[Row, ...], arrivals: tuple[tuple[float, int], ...]) -> str:
    """For the tables: the calls counted lost in flight, and how many of them the server never
    received (their worker stopped after the commit that announced them, before the send)."""
    received, made, lost = _tally(journal, arrivals)
    if not lost:
        return ""
    never = sum(max(0, made[s] + lost[s] - received[s]) for s in lost)
    return f"{sum(lost.values())} lost in flight" + (f", {never} never received" if never else "")


def replay_problems(state: RunState, journal: tuple[Row, ...]) -> list[str]:
    """The receipt's replayed count is the one the journal's ``run.resumed`` events give."""
    resumed = [row.data["replayed"] for row in journal if row.type == "run.resumed"]
    replayed = receipt(state).calls_replayed
    if replayed != max(resumed, default=0):
        return [f"receipt: {replayed} replayed, the journal says {resumed}"]
    return []


def effect_problems(
    effects: tuple[Effect, ...], journal: tuple[Row, ...], kinds_expected: tuple[str, ...]
) -> list[str]:
    """Keyed effects: one key per effect, applied once, announced by an intent first."""
    problems = []
    kinds = Counter(e.kind for e in effects)
    if sorted(kinds) != sorted(kinds_expected) or any(n != 1 for n in kinds.values()):
        problems.append(f"effects applied {dict(kinds)}, expected each of {kinds_expected}")
    # A key's first intent: a call made again after an invalidation records its intent again,
    # under the same key, after the effect its first intent announced.
    intents: dict[str, Row] = {}
    for r in journal:
        if r.type == "tool.intent":
            intents.setdefault(r.data["idempotency_key"], r)
    for effect in effects:
        intent = intents.get(effect.key)
        if intent is None:
            problems.append(f"{effect.kind} applied under a key no intent recorded")
        elif intent.at > effect.applied_at:
            problems.append(f"{effect.kind} applied before its tool.intent was recorded")
    return problems


def journal_problems(journal: tuple[Row, ...], takeover: Takeover | None) -> list[str]:
    """A journal's sequence contiguous, its epochs never going back, nothing stale after a
    takeover."""
    problems = []
    seqs = [row.seq for row in journal]
    if seqs != list(range(1, len(seqs) + 1)):
        problems.append(f"journal sequence not contiguous: {seqs}")
    epochs = [row.epoch for row in journal]
    if epochs != sorted(epochs):
        problems.append(f"journal epochs go back: {epochs}")
    if takeover is not None:
        stale = [
            row.seq for row in journal if row.seq > takeover.seq and row.epoch < takeover.epoch
        ]
        if stale:
            problems.append(
                f"stale write: seq {stale} written at an epoch below {takeover.epoch} "
                "after the takeover"
            )
    return problems


def decision_problems(seen: Observed) -> list[str]:
    """Decisions are addressed: the refund's call is approved once, by a decision meant for it,
    before the refund is applied; a decision for a call that does not wait is refused, never
    applied; a repeat of the decision made records nothing."""
    problems: list[str] = []
    asked = [r.data["call_id"] for r in seen.journal if r.type == "approval.requested"]
    refunds = [
        r.data["call_id"]
        for r in seen.journal
        if r.type == "approval.requested" and r.data["name"] == "refund"
    ]
    if len(refunds) != 1 or len(asked) != 1:
        return [f"approval requested for {asked}, expected once, for the refund"]
    refund = refunds[0]
    decided = [r for r in seen.journal if r.type == "approval.decided"]
    shown = [(r.data["call_id"], r.data["approved"], r.data["reason"]) for r in decided]
    if len(decided) != 1:
        problems.append(f"{len(decided)} approval.decided {shown}, expected one, for {refund}")
    for row in decided:
        call_id, reason = row.data["call_id"], row.data["reason"]
        if call_id != refund or not row.data["approved"]:
            verdict = "approved" if row.data["approved"] else "denied"
            problems.append(f"approval.decided {verdict} call {call_id}, not the refund's {refund}")
        intended = meant(reason)
        if intended is not None and intended != call_id:
            problems.append(
                f"a decision sent for call {intended!r} was applied to call {call_id} "
                f"(approval.decided at seq {row.seq})"
            )
    if decided and any(e.kind == "refund" and e.applied_at < decided[0].at for e in seen.effects):
        problems.append("the refund was applied before its decision was recorded")

    # What the harness sent: stale decisions refused once per send, never applied; repeats of
    # the right decision answered as repeats (nothing recorded).
    if not seen.sent:
        return problems
    refused = Counter(
        (r.data["call_id"], r.data["approved"])
        for r in seen.journal
        if r.type == "decision.refused"
    )
    stale = Counter((s.call_id, s.approved) for s in seen.sent if s.call_id != refund)
    for (call_id, approved), n in sorted(stale.items()):
        got = refused.get((call_id, approved), 0)
        verdict = "approval" if approved else "denial"
        if got != n:
            problems.append(
                f"stale {verdict} for call {call_id!r}: sent {n}, refused {got} "
                "(each must be refused exactly once)"
            )
    for (call_id, approved), n in sorted(refused.items()):
        if (call_id, approved) not in stale:
            problems.append(
                f"{n} decision.refused for call {call_id!r} ({'approve' if approved else 'deny'}), "
                "which the harness did not send as a stale decision (a repeat records nothing)"
            )
    return problems
