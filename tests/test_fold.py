"""A run's fold: linear structures that a snapshot carries exactly.

The property: for any journal (valid or not: the fold is total) and any points in it, the state
written as snapshots at those points (each storing what was added since as a chunk, as a worker
writes them), read back from the last one and folded with the rest equals the fold of the whole
journal, receipt included; so does the state the writing worker goes on with.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import attrs
from hypothesis import given, settings
from hypothesis import strategies as st

from toren._core.actor import ActorFailed
from toren._core.codec import converter
from toren._core.codec import decode as decode_payload
from toren._core.codec import encode as encode_payload
from toren._core.json_text import dumps, loads
from toren._core.snapshots import _state as read_state
from toren._core.snapshots import encode
from toren.runs import (
    ApprovalDecided,
    ApprovalRequested,
    ChildFinished,
    ChildStarted,
    MessageReceived,
    ModelCalled,
    ModelCalling,
    ModelLost,
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
    occurrence_key,
    receipt,
    summary,
    waiting_on,
)

CALL_IDS = st.sampled_from(["c1", "c2", "c3", "c4"])
CHECKED_AS = st.sampled_from(["", "p1", "p2"])
ARGUMENTS = st.sampled_from([{}, {"x": 1}, {"x": "\x00"}])
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
        checked_as=draw(CHECKED_AS),
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
    st.builds(
        ModelCalling,
        step=st.integers(1, 9),
        model=st.just("m"),
        input_tokens=st.integers(0, 99),
        cost_usd=st.one_of(st.none(), st.decimals(0, 1, places=6).map(str)),
    ),
    st.builds(
        ModelLost,
        step=st.integers(1, 9),
        model=st.just("m"),
        count=st.integers(1, 3),
        input_tokens=st.integers(0, 99),
        cost_usd=st.one_of(st.none(), st.decimals(0, 1, places=6).map(str)),
    ),
    st.builds(StepsInvalidated, from_step=st.integers(1, 6), reason=st.just("changed")),
    st.builds(RunRetrying, attempt=st.integers(1, 3), error=TEXT, delay=st.just(1.0)),
    st.builds(RunRetried, who=st.just("ops"), at=AT),
    st.builds(
        ToolIntended,
        call_id=CALL_IDS,
        name=st.sampled_from(["t", "u"]),
        arguments=ARGUMENTS,
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
    st.builds(RunResumed, replayed=st.integers(0, 9), checked_as=CHECKED_AS),
    st.builds(RunCompleted, output=TEXT),
    st.builds(RunFailed, error_class=st.just("tool"), message=TEXT),
    st.builds(ActorFailed, error_class=st.just("crashloop"), error=TEXT),
)


def fold_all(state: RunState, events: list[Any]) -> RunState:
    for event in events:
        state = fold(state, event)
    return state


def through_snapshot(state: RunState) -> RunState:
    """``state`` written as JSON (as the API and tests see it) and read back."""
    back: RunState = converter.structure(loads(dumps(converter.unstructure(state))), RunState)
    return back


def through_snapshots(events: list[Any], cuts: list[int]) -> tuple[RunState, RunState]:
    """The journal folded as a worker hosting the run folds it, writing a snapshot at each cut
    (its chunks kept; it goes on with the state that names them), and as a worker activating it
    later folds it: from the last snapshot, read back from the bytes and JSON text stored, and
    the events after it. ``(the host's state, the activated state)``."""
    chunks: dict[str, bytes] = {}
    state, row, snapshot_at = RunState(), None, 0
    for seq, event in enumerate(events, start=1):
        state = fold(state, event)
        if seq in cuts:
            snap = encode(state, seq)
            chunks.update(snap.chunks)
            assert set(snap.keys) <= set(chunks)  # it names only chunks stored
            state, row, snapshot_at = snap.state, loads(dumps(snap.row)), seq
    activated = RunState() if row is None else read_state(chunks, row, RunState)
    return state, fold_all(activated, events[snapshot_at:])


@settings(max_examples=300, deadline=None, derandomize=True)
@given(events=st.lists(EVENT, max_size=40), cuts=st.lists(st.integers(1, 40), max_size=4))
def test_a_snapshot_and_the_tail_fold_to_the_whole_journals_state(
    events: list[Any], cuts: list[int]
) -> None:
    whole = fold_all(RunState(), events)
    hosted, activated = through_snapshots(events, cuts)
    for resumed in (hosted, activated, through_snapshot(whole)):
        assert resumed == whole
        assert receipt(resumed) == receipt(whole)
        assert summary(resumed) == summary(whole)
        assert waiting_on(resumed) == waiting_on(whole)
        assert resumed.calling == whole.calling
        assert (resumed.occurrences, resumed.checked_calls) == (
            whole.occurrences,
            whole.checked_calls,
        )
    # What the fold keeps as it goes is what a walk over the run would find.
    recount = Counter(occurrence_key(i.name, i.arguments) for i in whole.intents.values())
    assert dict(whole.occurrences) == dict(recount)
    used = {c.id for call in (*whole.voided, *whole.calls) for c in call.response.tool_calls}
    assert used <= set(whole.tool_ids)
    assert whole.checked_calls <= len(whole.calls)


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


def test_a_cancel_ends_the_run_as_cancelled_and_an_earlier_childs_cancel_reads_so() -> None:
    """A cancel records ``run.failed`` of class ``cancelled``: the run's status is
    ``cancelled``, not ``failed``, and it waits for nothing. A child's end recorded before that
    status existed (``failed``, class ``cancelled``) reads as cancelled too."""
    started = fold(RunState(), RunStarted(agent="a", input="go", at=1.0))
    asked = fold(started, ApprovalRequested(call_id="c1", name="t", arguments={}, at=2.0))
    cancelled = fold(asked, RunFailed(error_class="cancelled", message="cancelled by ops"))
    assert (cancelled.status, cancelled.error_class) == ("cancelled", "cancelled")
    assert (summary(cancelled)["status"], summary(cancelled)["waiting_on"]) == ("cancelled", [])
    assert waiting_on(cancelled) == []
    failed = fold(started, RunFailed(error_class="tool", message="broke"))
    assert (failed.status, failed.error_class) == ("failed", "tool")
    child = ChildStarted(call_id="k1", run_id="run/c", agent="b", at=2.0)
    ended = ChildFinished(
        call_id="k1", run_id="run/c", agent="b", status="failed", error_class="cancelled"
    )
    parent = fold_all(started, [child, ended])
    assert parent.finished["run/c"].status == "cancelled"
    broke = fold_all(started, [child, attrs.evolve(ended, error_class="tool")])
    assert broke.finished["run/c"].status == "failed"


# --- Review (issue 13): what the fold counts as checked, and intent counts, against their meaning


@settings(max_examples=500, deadline=None, derandomize=True)
@given(events=st.lists(EVENT, max_size=50))
def test_a_call_counted_as_checked_was_checked_or_made_under_the_same_parameters(
    events: list[Any],
) -> None:
    """``checked_calls`` never exceeds the calls that code with the parameters ``checked_as``
    checked (a ``run.resumed`` naming them: the activation checked every call recorded then)
    or made (a ``model.called`` naming them), call by call, through invalidations."""
    state = RunState()
    under: list[set[str]] = []  # for each call in force: the parameters it was checked under
    for event in events:
        state = fold(state, event)
        if isinstance(event, ModelCalled):
            under.append({event.checked_as} - {""})
        elif isinstance(event, RunResumed) and event.checked_as:
            for seen in under:
                seen.add(event.checked_as)
        del under[len(state.calls) :]  # an invalidation cut them
        assert len(under) == len(state.calls)
        if state.checked_calls:
            assert state.checked_as
            assert all(state.checked_as in seen for seen in under[: state.checked_calls])


JSON_LEAF = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**80), max_value=2**80),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(alphabet=st.sampled_from(["a", "\x00", "\ud800", "\udfff", "\ue000", "s", "\\", "é"])),
)
HOSTILE_ARGUMENTS = st.dictionaries(
    st.sampled_from(["a", "\x00", "\ue000s", "\ud83d"]),
    st.recursive(
        JSON_LEAF,
        lambda inner: (
            st.lists(inner, max_size=3)
            | st.dictionaries(st.sampled_from(["k", "\x00", "\ue000i1"]), inner, max_size=3)
        ),
        max_leaves=6,
    ),
    max_size=3,
)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(
    steps=st.lists(
        st.one_of(
            st.tuples(st.just("intent"), CALL_IDS, st.sampled_from(["t", "u"]), HOSTILE_ARGUMENTS),
            st.tuples(st.just("call"), st.lists(CALL_IDS, max_size=2, unique=True)),
            st.tuples(st.just("void"), st.integers(1, 4)),
        ),
        max_size=25,
    ),
    probe=HOSTILE_ARGUMENTS,
)
def test_intent_counts_equal_a_walk_over_the_recorded_intents(
    steps: list[tuple[Any, ...]], probe: dict[str, Any]
) -> None:
    """The count an idempotency key is made from (``occurrences_of``) is what the run counted
    before the fold kept it: recorded intents with the same tool and canonical arguments,
    after invalidations, for any arguments (NUL, lone surrogates, the tag mark, huge numbers,
    NaN) as the journal gives them back."""
    from toren.runs import canonical, occurrences_of

    def recorded(event: Any) -> Any:
        name, body = encode_payload(event)
        return decode_payload(name, loads(dumps(body)))

    state = RunState()
    for step in steps:
        if step[0] == "intent":
            _, call_id, name, arguments = step
            event: Any = ToolIntended(
                call_id=call_id, name=name, arguments=arguments, idempotency_key="k"
            )
        elif step[0] == "call":
            content = tuple(ToolCall(id=c, name="t", arguments={}) for c in step[1])
            response = ModelResponse(
                content=(Text(text="x"), *content),
                stop_reason="tool_use",
                usage=Usage(input_tokens=1, output_tokens=1),
                model="m",
            )
            event = ModelCalled(
                step=1, digest="d", model="m", response=response, cost_usd=None, latency_ms=1
            )
        else:
            event = StepsInvalidated(from_step=step[1], reason="changed")
        state = fold(state, recorded(event))
        for name in ("t", "u"):
            for arguments in [probe, *(i.arguments for i in state.intents.values())]:
                same = canonical(arguments)
                walked = sum(
                    1
                    for i in state.intents.values()
                    if i.name == name and canonical(i.arguments) == same
                )
                assert occurrences_of(state, name, arguments) == walked
