"""A run's fold: linear structures that a snapshot carries exactly.

The property: for any journal (valid or not: the fold is total) and any point in it, the state
written as a snapshot at that point (JSON through Postgres' text form), read back and folded with
the rest equals the fold of the whole journal, receipt included.
"""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from toren._actor import ActorFailed
from toren._codec import converter
from toren._json import dumps, loads
from toren.runs import (
    ApprovalDecided,
    ApprovalRequested,
    MessageReceived,
    ModelCalled,
    ModelResponse,
    ModelUnreadable,
    RunCompleted,
    RunFailed,
    RunResumed,
    RunRetried,
    RunRetrying,
    RunStarted,
    RunState,
    StepsInvalidated,
    Text,
    TimerFired,
    TimerSet,
    ToolCall,
    ToolIntended,
    ToolResulted,
    Usage,
    fold,
    receipt,
    summary,
    waiting_on,
)

CALL_IDS = st.sampled_from(["c1", "c2", "c3", "c4"])
TEXT = st.text(max_size=8)
AT = st.floats(min_value=0, max_value=1e6)


@st.composite
def model_called(draw: st.DrawFn) -> ModelCalled:
    calls = draw(st.lists(CALL_IDS, max_size=2, unique=True))
    content = (Text(text=draw(TEXT)), *(ToolCall(id=c, name="t", arguments={}) for c in calls))
    cost = draw(st.one_of(st.none(), st.decimals(0, 1, places=6).map(str)))
    return ModelCalled(
        step=draw(st.integers(1, 9)),
        digest="d",
        model="m",
        response=ModelResponse(
            content=content,
            stop_reason="tool_use" if calls else "end",
            usage=Usage(input_tokens=draw(st.integers(0, 99)), output_tokens=3),
            model="m",
        ),
        cost_usd=cost,
        latency_ms=1,
        messages_len=draw(st.integers(0, 12)),
    )


EVENT = st.one_of(
    model_called(),
    model_called(),
    st.builds(RunStarted, agent=st.just("a"), input=TEXT, at=AT),
    st.builds(MessageReceived, text=TEXT, who=st.just("p"), channel=st.just("cli")),
    st.builds(
        ModelUnreadable,
        step=st.integers(1, 9),
        digest=st.just("d"),
        model=st.just("m"),
        error=TEXT,
        latency_ms=st.just(1),
    ),
    st.builds(StepsInvalidated, from_step=st.integers(1, 6), reason=st.just("changed")),
    st.builds(RunRetrying, attempt=st.integers(1, 3), error=TEXT, delay=st.just(1.0)),
    st.builds(RunRetried, who=st.just("ops"), at=AT),
    st.builds(
        ToolIntended,
        call_id=CALL_IDS,
        name=st.just("t"),
        arguments=st.just({}),
        idempotency_key=st.just("k"),
    ),
    st.builds(
        ToolResulted, call_id=CALL_IDS, content=TEXT, is_error=st.booleans(), denied=st.booleans()
    ),
    st.builds(TimerSet, call_id=CALL_IDS, seconds=st.just(5.0), at=AT),
    st.builds(TimerFired, call_id=CALL_IDS, at=AT),
    st.builds(ApprovalRequested, call_id=CALL_IDS, name=st.just("t"), arguments=st.just({}), at=AT),
    st.builds(
        ApprovalDecided,
        call_id=CALL_IDS,
        approved=st.booleans(),
        who=st.just("p"),
        reason=TEXT,
        channel=st.just("cli"),
        at=AT,
    ),
    st.builds(RunResumed, replayed=st.integers(0, 9)),
    st.builds(RunCompleted, output=TEXT),
    st.builds(RunFailed, error_class=st.just("tool"), message=TEXT),
    st.builds(ActorFailed, error_class=st.just("crashloop"), error=TEXT),
)


def fold_all(state: RunState, events: list[Any]) -> RunState:
    for event in events:
        state = fold(state, event)
    return state


def through_snapshot(state: RunState) -> RunState:
    """``state`` written as a snapshot is (JSON text, as Postgres keeps it) and read back."""
    back: RunState = converter.structure(loads(dumps(converter.unstructure(state))), RunState)
    return back


@settings(max_examples=300, deadline=None, derandomize=True)
@given(events=st.lists(EVENT, max_size=40), cut=st.integers(0, 40))
def test_a_snapshot_and_the_tail_fold_to_the_whole_journals_state(
    events: list[Any], cut: int
) -> None:
    cut = min(cut, len(events))
    whole = fold_all(RunState(), events)
    resumed = fold_all(through_snapshot(fold_all(RunState(), events[:cut])), events[cut:])
    assert resumed == whole
    assert receipt(resumed) == receipt(whole)
    assert summary(resumed) == summary(whole)
    assert waiting_on(resumed) == waiting_on(whole)


def test_an_earlier_state_is_untouched_by_the_events_after_it() -> None:
    """Persistent structures: a state kept aside (the live actor keeps ``ctx.state``) does not
    change when later states are made from it."""
    started = fold(RunState(), RunStarted(agent="a", input="go", at=1.0))
    response = ModelResponse(
        content=(ToolCall(id="c1", name="t", arguments={}),),
        stop_reason="tool_use",
        usage=Usage(input_tokens=1, output_tokens=1),
        model="m",
    )
    called = ModelCalled(
        step=1, digest="d", model="m", response=response, cost_usd="0.5", latency_ms=1
    )
    later = fold_all(
        started,
        [
            called,
            ToolIntended(call_id="c1", name="t", arguments={}, idempotency_key="k"),
            ToolResulted(call_id="c1", content="ok"),
        ],
    )
    assert (len(started.calls), len(started.messages), dict(started.intents)) == (0, 1, {})
    assert (len(later.calls), len(later.messages), set(later.intents)) == (1, 3, {"c1"})
    assert str(receipt(later).usd_paid) == "0.5"
