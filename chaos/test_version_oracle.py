"""The version cells' oracle against hand-made journals: each check can fail (no worker needed)."""

from __future__ import annotations

from decimal import Decimal
from typing import Any

import attrs

from chaos.app import versioned_system
from chaos.matrix import MUTATION_EVIDENCE
from chaos.oracle import Observed, Row
from chaos.servers import Effect
from chaos.version_oracle import (
    DEPLOY,
    NAME,
    ForkExpected,
    ForkObserved,
    UpgradeObserved,
    judge_fork,
    upgrade_problems,
)
from toren.runs import Receipt, RunState

OLD, NEW = "0123456789ab", "ba9876543210"


def _rows(*events: tuple[str, dict[str, Any]]) -> tuple[Row, ...]:
    return tuple(Row(i + 1, 1, kind, data, float(i)) for i, (kind, data) in enumerate(events))


def _called(step: int) -> tuple[str, dict[str, Any]]:
    return ("model.called", {"step": step})


def _intent(key: str) -> tuple[str, dict[str, Any]]:
    return ("tool.intent", {"idempotency_key": key})


# -- the upgrade ---------------------------------------------------------------------------------

BY = {"kind": "os_user", "id": "chaos", "name": "chaos", "via": "chaos"}
UPGRADED = ("run.upgraded", {"from_version": OLD, "to_version": NEW, "how": "value", "by": BY})


def _upgrade(*events: tuple[str, dict[str, Any]], **changes: Any) -> UpgradeObserved:
    """The upgrade cell's run: two calls on version A, the move, the third on B."""
    journal = _rows(
        ("run.started", {"agent": NAME, "version": OLD}),
        _called(1),
        _called(2),
        ("approval.requested", {"call_id": "t1", "name": "refund"}),
        *(events or (UPGRADED,)),
        ("approval.decided", {"call_id": "t1", "approved": True, "reason": ""}),
        _called(3),
        ("run.completed", {}),
    )
    old, new = versioned_system(""), versioned_system(DEPLOY)
    run = Observed(
        state=RunState(),
        journal=journal,
        arrivals=((0.0, 0), (1.0, 1), (2.0, 2)),
        effects=(),
        deadletters=0,
        allowed_repeats=0,
        takeover=None,
    )
    seen = UpgradeObserved(
        run=run,
        systems=((0.5, 0, old), (1.5, 1, old), (6.5, 2, new)),
        target=NEW,
        route=f"agent:{NAME}@{NEW}",
    )
    return attrs.evolve(seen, **changes)


def test_a_clean_upgrade_passes() -> None:
    assert upgrade_problems(_upgrade()) == []


def test_an_upgrade_recorded_twice_or_never_is_red() -> None:
    assert any("2 times" in p for p in upgrade_problems(_upgrade(UPGRADED, UPGRADED)))
    never = upgrade_problems(_upgrade(("run.resumed", {"replayed": 2})))
    assert "run.upgraded recorded 0 times, expected once" in never


def test_an_upgrade_by_replay_or_to_another_version_is_red() -> None:
    replay = ("run.upgraded", {"from_version": OLD, "to_version": NEW, "how": "replay", "by": BY})
    assert any("by 'replay'" in p for p in upgrade_problems(_upgrade(replay)))
    elsewhere = ("run.upgraded", {"from_version": NEW, "to_version": OLD, "how": "value", "by": BY})
    assert any("expected '0123" in p for p in upgrade_problems(_upgrade(elsewhere)))
    unasked = ("run.upgraded", {"from_version": OLD, "to_version": NEW, "how": "value", "by": None})
    assert any("names None as who asked" in p for p in upgrade_problems(_upgrade(unasked)))


def test_steps_invalidated_by_the_move_are_red_for_the_mutation() -> None:
    invalidated = ("steps.invalidated", {"from_step": 1, "reason": "differs"})
    found = upgrade_problems(_upgrade(UPGRADED, invalidated))
    assert any("steps invalidated from [1]" in p for p in found)
    assert any(MUTATION_EVIDENCE["upgrade-by-replay"] in p for p in found)


def test_a_run_left_unpinned_is_red() -> None:
    found = upgrade_problems(_upgrade(route=f"agent:{NAME}"))
    assert any("not pinned" in p for p in found)


def test_a_call_made_by_the_wrong_version_is_red() -> None:
    old = versioned_system("")
    found = upgrade_problems(_upgrade(systems=((0.5, 0, old), (1.5, 1, old), (6.5, 2, old))))
    assert any("step 3, asked after the move" in p for p in found)


# -- the fork ------------------------------------------------------------------------------------

SOURCE = _rows(
    ("run.started", {"agent": NAME, "input": "case x"}),
    _called(1),
    _intent("src-ticket"),
    ("tool.result", {"call_id": "t0"}),
    _called(2),
    ("approval.requested", {"call_id": "t1", "name": "refund"}),
    ("approval.decided", {"call_id": "t1", "approved": True}),
    _intent("src-refund"),
    ("tool.result", {"call_id": "t1"}),
    _called(3),
    ("run.completed", {}),
)
LIVE: tuple[tuple[str, dict[str, Any]], ...] = (
    _called(2),
    ("approval.requested", {"call_id": "t1", "name": "refund"}),
    ("approval.decided", {"call_id": "t1", "approved": True}),
    _intent("fork-refund"),
    ("tool.result", {"call_id": "t1"}),
    _called(3),
    ("run.completed", {}),
)
FORKED = ("run.forked", {"run": "run/source", "step": 2})
PREFIX = tuple(r.type for r in SOURCE[:4])
EXPECTED = ForkExpected(output="done", steps=3, prefix=PREFIX, effect_kinds=("refund",), asked=1)
SOURCE_EFFECTS = (("src-refund", "refund", 1), ("src-ticket", "ticket", 1))
RAW = tuple((r.seq, r.epoch, r.type, str(r.data), r.at) for r in SOURCE)


def _fork(
    prefix: int = 4,
    live: tuple[tuple[str, dict[str, Any]], ...] = LIVE,
    positions: tuple[int, ...] = (1, 2),
    **changes: Any,
) -> ForkObserved:
    """A fork at step 2 as observed: the source's first ``prefix`` events, run.forked, its own
    events; the model requests since it was made, by position."""
    copied = tuple((r.type, r.data) for r in SOURCE[:prefix])
    journal = _rows(*copied, FORKED, *live)
    refund = Effect(
        key="fork-refund", run="run/fork", kind="refund", detail="120", applied_at=100.0
    )
    lost = sum(data["count"] for kind, data in live if kind == "model.lost")
    seen = ForkObserved(
        state=attrs.evolve(RunState(), status="completed", output="done"),
        receipt=Receipt(
            calls_made=len(positions) - lost,
            calls_replayed=1,
            input_tokens=0,
            output_tokens=0,
            usd_paid=Decimal(0),
            usd_not_repaid=Decimal(0),
            unpriced_calls=0,
            calls_lost=lost,
            calls_inherited=1,
        ),
        journal=journal,
        source=SOURCE,
        source_raw=RAW,
        source_raw_after=RAW,
        arrivals=tuple((i / 100, pos) for i, pos in enumerate(positions)),
        effects=(refund,),
        source_effects=SOURCE_EFFECTS,
        source_effects_after=SOURCE_EFFECTS,
        deadletters=0,
        allowed_repeats=0,
        unsent=frozenset(),
        at=2,
    )
    return attrs.evolve(seen, **changes)


def problems(seen: ForkObserved) -> tuple[str, ...]:
    return judge_fork(seen, EXPECTED).problems


def test_a_clean_fork_passes() -> None:
    assert problems(_fork()) == ()


def test_a_prefix_copied_one_event_short_is_red() -> None:
    found = problems(_fork(prefix=3))
    assert any("the fork copied 3 events" in p and "the clean fork copied 4" in p for p in found)


def test_a_fork_that_asks_its_sources_effect_again_is_red_for_the_mutation() -> None:
    # One event short, the fork runs the ticket's call again under its source's key: the
    # tracker counts a second request for the source's effect.
    again = (("src-refund", "refund", 1), ("src-ticket", "ticket", 2))
    found = problems(_fork(prefix=3, source_effects_after=again))
    assert any(MUTATION_EVIDENCE["fork-prefix-short"] in p for p in found)


def test_a_prefix_event_not_its_sources_by_value_is_red() -> None:
    seen = _fork()
    changed = attrs.evolve(seen.journal[2], data={"idempotency_key": "other"})
    journal = (*seen.journal[:2], changed, *seen.journal[3:])
    found = problems(attrs.evolve(seen, journal=journal))
    assert any("is not its source's" in p for p in found)


def test_a_call_before_the_step_paid_again_is_red() -> None:
    found = problems(_fork(positions=(0, 1, 2)))
    assert any("step 1, before the fork's step 2, paid again" in p for p in found)


def test_the_first_live_call_paid_twice_only_if_it_was_in_flight() -> None:
    lost = (("model.lost", {"step": 2, "count": 1}), *LIVE)  # received twice, one lost in flight
    twice = (1, 1, 2)
    assert any("paid again, 0 allowed" in p for p in problems(_fork(live=lost, positions=twice)))
    assert problems(_fork(live=lost, positions=twice, allowed_repeats=1)) == ()
    # Received twice, and the journal counts one: a call lost without a trace.
    found = problems(_fork(positions=twice, allowed_repeats=1))
    assert any("received 2 requests, the journal counts 1 made and 0 lost" in p for p in found)


def test_an_effect_under_its_sources_key_or_asked_twice_is_red() -> None:
    seen = _fork()
    inherited = attrs.evolve(seen.effects[0], key="src-refund")
    assert any("under its source's key" in p for p in problems(_fork(effects=(inherited,))))
    twice = attrs.evolve(seen.effects[0], requests=2)
    assert any("asked for 2 times" in p for p in problems(_fork(effects=(twice,))))
    assert any("applied {}" in p for p in problems(_fork(effects=())))


def test_a_fork_that_does_not_ask_its_approval_again_is_red() -> None:
    live = tuple(e for e in LIVE if e[0] != "approval.requested")
    assert any("asked 0 approvals" in p for p in problems(_fork(live=live)))


def test_a_source_whose_journal_changed_is_red() -> None:
    after = (*RAW[:-1], (11, 1, "run.completed", "{'x': 1}", 10.0))
    assert any("rewritten: seq [11]" in p for p in problems(_fork(source_raw_after=after)))
    longer = (*RAW, (12, 1, "message.received", "{}", 11.0))
    assert any(
        "11 events before the fork, 12 after" in p for p in problems(_fork(source_raw_after=longer))
    )


def test_a_receipt_that_counts_the_inherited_calls_as_made_is_red() -> None:
    seen = _fork()
    paid = attrs.evolve(seen.receipt, calls_made=3, calls_inherited=0)
    found = problems(attrs.evolve(seen, receipt=paid))
    assert "fork receipt: 0 calls inherited, forked at 2" in found
    assert any("3 calls made and 0 lost in flight, the server received 2" in p for p in found)


def test_a_fork_unfinished_or_dead_lettered_is_red() -> None:
    running = attrs.evolve(RunState(), status="running")
    assert any(p.startswith("fork running") for p in problems(_fork(state=running)))
    assert "1 messages dead-lettered" in problems(_fork(deadletters=1))
