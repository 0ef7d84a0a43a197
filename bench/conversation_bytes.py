"""What a never-ending conversation stores: journal bytes and snapshot bytes as it grows.

Not a timed benchmark: a measurement (``python -m bench.conversation_bytes``). A Telegram-style
chat run: each turn a human message, the model call announced and answered (a few hundred
characters), the turn completed; every third turn a tool call (intent and a 1 KB result); every
fifty turns a hard compaction with a 2 KB summary. The state is snapshotted every 1,000 events as
a worker does (each snapshot from the state the previous one left), and what the database then
holds for it is summed: the snapshot's row and every chunk it names. Measured twice: as any run
records it, and as a run of an agent with ``Retention(conversation_keep_for=...)`` does (with
``history.released`` after each hard compaction but the first: see
:mod:`toren.runs.release_events`).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from toren._core.codec import encode as encode_payload
from toren._core.json_text import dumps
from toren._core.snapshots import encode as encode_snapshot
from toren.runs import (
    ContextCompacted,
    HistoryReleased,
    Message,
    MessageReceived,
    ModelCalled,
    ModelCalling,
    ModelResponse,
    RunCompleted,
    RunStarted,
    RunState,
    Text,
    ToolCall,
    ToolIntended,
    ToolResulted,
    Usage,
    fold,
)


def turn_events(turn: int, *, release: bool = False) -> list[Any]:
    """The events of turn ``turn`` (from 1) of the chat (each turn's alone: the counts of calls
    and messages before it follow from its number). With ``release``, as a run of an agent
    with ``Retention(conversation_keep_for=...)`` records them: each hard compaction but the
    first followed by ``history.released`` naming the calls before the one before it (what
    ``release_due`` gives; the calls made by the end of turn ``t`` are ``t + t // 3``)."""
    tools_before = (turn - 1) // 3
    calls = turn - 1 + tools_before  # calls made before this turn
    messages = 1 + 2 * (turn - 1) + 2 * tools_before  # a tool turn adds two
    step: list[Any] = [
        MessageReceived(text=f"turn {turn}: " + "h" * 200, who="u", channel="t", at=float(turn))
    ]
    content: tuple[Any, ...] = (Text(text=f"answer {turn} " + "a" * 400),)
    tool = turn % 3 == 0
    if tool:
        content += (ToolCall(id=f"c{turn}", name="lookup", arguments={"q": turn}),)
    calls += 1
    response = ModelResponse(
        content=content,
        stop_reason="tool_use" if tool else "end",
        usage=Usage(input_tokens=1000, output_tokens=100),
        model="m",
    )
    step += [
        ModelCalling(step=calls, model="m", input_tokens=1000, cost_usd="0.003"),
        ModelCalled(
            step=calls,
            digest=f"{calls:064x}",
            model="m",
            response=response,
            cost_usd="0.0045",
            latency_ms=300,
            messages_len=messages,
        ),
    ]
    messages += 2
    if tool:
        step += [
            ToolIntended(
                call_id=f"c{turn}", name="lookup", arguments={"q": turn}, idempotency_key=f"k{turn}"
            ),
            ToolResulted(call_id=f"c{turn}", content="r" * 1024),
        ]
        calls += 1
        after = ModelResponse(
            content=(Text(text="done " + "b" * 300),),
            stop_reason="end",
            usage=Usage(input_tokens=1200, output_tokens=80),
            model="m",
        )
        step.append(
            ModelCalled(
                step=calls,
                digest=f"{calls:064x}",
                model="m",
                response=after,
                cost_usd="0.005",
                latency_ms=300,
                messages_len=messages,
            )
        )
        messages += 1
    if turn % 50 == 0:
        summary = ModelResponse(
            content=(Text(text="s" * 2048),),
            stop_reason="end",
            usage=Usage(input_tokens=8000, output_tokens=500),
            model="m",
        )
        step.append(
            ContextCompacted(
                tier="hard",
                reason="threshold",
                after_calls=calls,
                base=messages - 1,
                prefix=(Message(role="user", content=(Text(text="s" * 2048),)),),
                tokens_before=9000,
                tokens_after=900,
                summarised=messages - 2,
                model="m",
                summary=summary,
                cost_usd="0.02",
                latency_ms=900,
            )
        )
        if release and turn >= 100:
            earlier = turn - 50
            step.append(HistoryReleased(before_calls=earlier + earlier // 3))
    step.append(RunCompleted(output="a" * 100, at=float(turn)))
    return step  # fmt: skip


def conversation(events: int, *, release: bool = False) -> Iterator[Any]:
    """The first ``events`` events of a never-ending chat (see :func:`turn_events`)."""
    yield RunStarted(agent="chat", input="hello", at=1.0)
    made, turn = 1, 0
    while True:
        turn += 1
        for event in turn_events(turn, release=release):
            if made >= events:
                return
            yield event
            made += 1


def measure(events: int, every: int = 1000, *, release: bool = False) -> dict[str, Any]:
    """Journal bytes (each event's data as stored) and snapshot bytes (row and chunks named,
    and the chunk bytes of each field) after ``events`` events of :func:`conversation`."""
    state, journal, chunks, seq = RunState(), 0, {}, 0
    row = 0
    for event in conversation(events, release=release):
        seq += 1
        state = fold(state, event)
        journal += len(dumps(encode_payload(event)[1]))
        if seq % every == 0 or seq == events:
            snap = encode_snapshot(state, seq)
            chunks.update(snap.chunks)
            chunks = {k: v for k, v in chunks.items() if k in set(snap.keys)}
            row = len(dumps(snap.row))
            state = snap.state
    fields: dict[str, int] = {}
    for key, data in chunks.items():
        name = key.split(".", 1)[0]
        fields[name] = fields.get(name, 0) + len(data)
    return {
        "events": seq,
        "release": release,
        "journal": journal,
        "row": row,
        "chunks": sum(len(v) for v in chunks.values()),
        "by_field": dict(sorted(fields.items(), key=lambda kv: -kv[1])),
        "messages": (len(state.messages), state.messages.released),
        "calls": (len(state.calls), state.calls.released),
    }


def main() -> None:
    for release in (False, True):
        for n in (5000, 10000, 20000, 40000):
            print(measure(n, release=release))


if __name__ == "__main__":
    main()
