"""The oracle's decision checks and the call cells' checks against hand-made journals: each can
fail (no worker needed)."""

from __future__ import annotations

from typing import Any

import attrs

from chaos.calls import CallExpected, CallObserved, RunSeen, judge_call
from chaos.oracle import Observed, Row, Sent, decision_problems, lost_problems, meant_for
from chaos.servers import Effect
from toren.runs import ModelCalled, ModelLost, ModelResponse, RunState, Text, Usage, fold


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


# The call cells' oracle (chaos/calls.py): one child, its end and result recorded once, no model
# call paid twice beyond the allowance.

CALL = CallExpected(
    output="said: done", steps=0, child_output="done", child_steps=0, effect_kinds=()
)


def _run(run_id: str, *rows: Row, output: str, **fields: Any) -> RunSeen:
    state = RunState(status="completed", input=f"in {run_id}", output=output, **fields)
    return RunSeen(run_id=run_id, state=state, journal=rows, arrivals=())


def _call(
    *extra: Row,
    children: tuple[str, ...] = ("run/child",),
    finished: bool = True,
    child_arrivals: tuple[tuple[float, int], ...] = (),
) -> CallObserved:
    rows = [_row(1, "child.started", call_id="c0", run_id="run/child")]
    if finished:
        rows.append(_row(2, "child.finished", call_id="c0", run_id="run/child"))
        rows.append(_row(3, "tool.result", call_id="c0", content="done"))
    rows.extend(attrs.evolve(r, seq=len(rows) + i + 1) for i, r in enumerate(extra))
    caller = _run("run/caller", *rows, output="said: done", child_runs=int(finished))
    kids = tuple(attrs.evolve(_run(c, output="done"), arrivals=child_arrivals) for c in children)
    return CallObserved(caller=caller, children=kids, effects=(), deadletters=0, allowed_repeats=0)


def test_a_call_with_one_child_and_its_result_once_passes() -> None:
    assert judge_call(_call(), CALL).problems == ()


def test_a_second_child_run_for_the_call_is_caught() -> None:
    problems = judge_call(_call(children=("run/child", "run/other")), CALL).problems
    assert any("2 child runs for the call" in p for p in problems)


def test_the_result_recorded_twice_is_caught() -> None:
    again = _row(0, "tool.result", call_id="c0", content="done")
    problems = judge_call(_call(again), CALL).problems
    assert any("2 tool.result for the call c0" in p for p in problems)


def test_a_child_end_the_caller_never_recorded_is_caught() -> None:
    problems = judge_call(_call(finished=False), CALL).problems
    assert any("its caller never recorded its end" in p for p in problems)
    assert any("0 child.finished" in p for p in problems)


def test_a_child_model_call_paid_twice_is_caught() -> None:
    seen = _call(child_arrivals=((1.0, 0), (2.0, 0)))
    problems = judge_call(seen, attrs.evolve(CALL, child_steps=1)).problems
    assert any("1 model calls paid again, 0 allowed" in p for p in problems)


# Calls made and lost in flight against what the server received (chaos/oracle.py).


def _called(seq: int, step: int) -> Row:
    return _row(seq, "model.called", step=step)


def _lost(seq: int, step: int, count: int = 1) -> Row:
    return _row(seq, "model.lost", step=step, count=count)


def _state(*rows: Row) -> RunState:
    """The state those rows give (the receipt's figures the oracle compares)."""
    answer = ModelResponse(
        content=(Text(text="ok"),),
        stop_reason="end",
        usage=Usage(input_tokens=1, output_tokens=1),
        model="m",
    )
    state = RunState()
    for row in rows:
        step = row.data["step"]
        if row.type == "model.lost":
            count = row.data["count"]
            event: Any = ModelLost(step=step, model="m", count=count, input_tokens=1, cost_usd=None)
        else:
            event = ModelCalled(
                step=step, digest="d", model="m", response=answer, cost_usd=None, latency_ms=1
            )
        state = fold(state, event)
    return state


def test_a_call_lost_in_flight_and_counted_passes() -> None:
    rows = (_called(1, 1), _lost(2, 2), _called(3, 2))
    arrivals = ((1.0, 0), (2.0, 1), (3.0, 1))  # step 2 received twice: once lost, once made
    assert lost_problems(_state(*rows), rows, arrivals, unsent=frozenset()) == []


def test_a_receipt_that_disagrees_with_its_journal_is_caught() -> None:
    rows = (_called(1, 1), _lost(2, 2), _called(3, 2))
    arrivals = ((1.0, 0), (2.0, 1), (3.0, 1))
    problems = lost_problems(_state(*rows[:1]), rows, arrivals, unsent=frozenset())
    assert problems == ["receipt: 0 lost in flight, the journal says {2: 1}"]


def test_a_request_received_and_counted_nowhere_is_caught() -> None:
    rows = (_called(1, 1), _called(2, 2))
    arrivals = ((1.0, 0), (2.0, 1), (3.0, 1))  # step 2 received twice, counted once
    problems = lost_problems(_state(*rows), rows, arrivals, unsent=frozenset())
    assert (
        "step 2: the server received 2 requests, the journal counts 1 made and 0 lost"
        in (problems[0])
    )


def test_a_lost_call_never_received_passes_only_where_the_fault_left_it_unsent() -> None:
    rows = (_called(1, 1), _lost(2, 2), _called(3, 2))
    arrivals = ((1.0, 0), (2.0, 1))  # the lost call never reached the server
    exact = lost_problems(_state(*rows), rows, arrivals, unsent=frozenset())
    assert any("step 2: the server received 1 requests" in p for p in exact)
    allowed = lost_problems(_state(*rows), rows, arrivals, unsent=frozenset({2}))
    assert not any(p.startswith("step") for p in allowed)
    elsewhere = lost_problems(_state(*rows), rows, arrivals, unsent=frozenset({1}))
    assert any("step 2" in p for p in elsewhere)


def test_an_early_message_dropped_heard_twice_or_before_the_start_is_caught() -> None:
    from chaos.harness import EARLY
    from chaos.oracle import early_problems
    from toren.runs import MessageReceived, RunStarted

    def run(*events: Any) -> Observed:
        state = RunState()
        rows = []
        for seq, event in enumerate(events, 1):
            state = fold(state, event)
            rows.append(_row(seq, type(event).__name__, **attrs.asdict(event)))
        kinds = {"RunStarted": "run.started", "MessageReceived": "message.received"}
        rows = [attrs.evolve(r, type=kinds[r.type]) for r in rows]
        return attrs.evolve(_seen(), state=state, journal=tuple(rows))

    started = RunStarted(agent="chaos", input="case x", at=1.0)
    early = MessageReceived(text=EARLY, who="chaos", channel="chaos")
    assert early_problems(run(started, early), EARLY) == []
    assert "heard []" in early_problems(run(started), EARLY)[0]
    assert "heard out of place" in early_problems(run(early, started), EARLY)[0]
    twice = early_problems(run(started, early, early), EARLY)
    assert "expected the early message once" in twice[0]


def test_an_effect_is_judged_against_the_first_intent_of_its_key() -> None:
    from chaos.oracle import effect_problems

    ticket = Effect(key="k", run="r", kind="ticket", detail="x", applied_at=2.0)
    first = _row(1, "tool.intent", 1.0, idempotency_key="k")
    again = _row(5, "tool.intent", 4.0, idempotency_key="k")  # made again after an invalidation
    assert effect_problems((ticket,), (first, again), ("ticket",)) == []
    late = _row(1, "tool.intent", 3.0, idempotency_key="k")  # the effect before any intent
    assert effect_problems((ticket,), (late, again), ("ticket",)) == [
        "ticket applied before its tool.intent was recorded"
    ]


def test_at_unknown_faults_each_stop_of_a_worker_may_leave_one_claim_unsent() -> None:
    # Two workers in turn stopped with step 2's message claimed and its request not yet sent.
    rows = (_called(1, 1), _lost(2, 2, count=2), _called(3, 2))
    arrivals = ((1.0, 0), (2.0, 1))
    twice = lost_problems(_state(*rows), rows, arrivals, unsent=None, stops=2)
    assert not any(p.startswith("step") for p in twice)
    once = lost_problems(_state(*rows), rows, arrivals, unsent=None, stops=1)
    assert any("step 2: the server received 1 requests" in p for p in once)
