"""The oracle's decision checks against hand-made journals: each can fail (no worker needed)."""

from __future__ import annotations

from typing import Any

from chaos.oracle import Observed, Row, Sent, decision_problems, meant_for
from chaos.servers import Effect
from toren.runs import RunState


def _row(seq: int, type: str, at: float = 0.0, **data: Any) -> Row:
    return Row(seq=seq, epoch=1, type=type, data=data, at=at)


def _decided(seq: int, call_id: str, meant: str, *, approved: bool = True, at: float = 2.0) -> Row:
    return _row(
        seq, "approval.decided", at, call_id=call_id, approved=approved, reason=meant_for(meant)
    )


def _refused(seq: int, call_id: str, *, approved: bool = True) -> Row:
    return _row(seq, "decision.refused", call_id=call_id, approved=approved)


def _seen(*rows: Row, sent: tuple[Sent, ...] = (), refund_at: float = 3.0) -> Observed:
    journal = (_row(1, "approval.requested", call_id="t1", name="refund"), *rows)
    effect = Effect(key="k", run="r", kind="refund", detail="120", applied_at=refund_at)
    return Observed(
        state=RunState(),
        journal=journal,
        arrivals=(),
        effects=(effect,),
        deadletters=0,
        allowed_repeats=0,
        takeover=None,
        sent=sent,
    )


STALE_THEN_PAIR = (Sent("t0", True), Sent("t1", True), Sent("t1", True))


def test_a_stale_decision_refused_and_the_right_one_applied_once_pass() -> None:
    seen = _seen(_refused(2, "t0"), _decided(3, "t1", "t1"), sent=STALE_THEN_PAIR)
    assert decision_problems(seen) == []


def test_a_stale_decision_applied_to_the_waiting_call_is_caught() -> None:
    seen = _seen(_decided(2, "t1", "t0"), sent=STALE_THEN_PAIR)
    problems = decision_problems(seen)
    assert any("sent for call 't0' was applied to call t1" in p for p in problems)
    assert any("stale approval for call 't0': sent 1, refused 0" in p for p in problems)


def test_a_second_decision_a_denial_or_the_wrong_call_is_caught() -> None:
    twice = decision_problems(_seen(_decided(2, "t1", "t1"), _decided(3, "t1", "t1")))
    assert any("2 approval.decided" in p for p in twice)
    denied = decision_problems(_seen(_decided(2, "t1", "t1", approved=False)))
    assert any("denied call t1" in p for p in denied)
    wrong = decision_problems(_seen(_decided(2, "t0", "t0")))
    assert any("approved call t0, not the refund's t1" in p for p in wrong)


def test_a_refund_applied_before_its_decision_is_caught() -> None:
    seen = _seen(_decided(2, "t1", "t1", at=5.0), refund_at=4.0)
    assert decision_problems(seen) == ["the refund was applied before its decision was recorded"]


def test_a_repeat_refused_or_a_stale_decision_refused_twice_is_caught() -> None:
    repeat = _seen(_decided(2, "t1", "t1"), _refused(3, "t1"), sent=(Sent("t1", True),) * 2)
    assert any("did not send as a stale decision" in p for p in decision_problems(repeat))
    twice = _seen(
        _refused(2, "t0"), _refused(3, "t0"), _decided(4, "t1", "t1"), sent=STALE_THEN_PAIR
    )
    assert any("sent 1, refused 2" in p for p in decision_problems(twice))
