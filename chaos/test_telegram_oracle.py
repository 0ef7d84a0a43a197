"""The Telegram cells' oracle against hand-made journals and chats: each check can fail (no
worker, no Bot API server needed)."""

from __future__ import annotations

from typing import Any

import attrs

from chaos.oracle import Row
from chaos.telegram import TelegramExpected, TelegramObserved, judge_telegram, note
from toren.runs import RunState

NOTICE = "Paired with chatty. Write to talk to it."
QUEUED = (NOTICE, "answer 1", "answer 2, piece 1", "answer 2, piece 2", "answer 2, piece 3", "ok")
SAID = ("case c0ffee: my parcel never came", "tell me everything", "thanks")
PUSHED = {11: "/pair CODE", 12: SAID[0], 13: SAID[1], 14: SAID[2]}
OUTCOMES = ("paired", "started", "forwarded", "forwarded")
EXPECTED = TelegramExpected(
    output="ok",
    steps=0,
    queued={"at_least_once": QUEUED, "at_most_once": QUEUED},
    outcomes=OUTCOMES,
)
SECRET_TOKEN_SPOT = "the log of worker 0-victim"


def _rows(*events: tuple[str, dict[str, Any]]) -> tuple[Row, ...]:
    return tuple(Row(i + 1, 1, kind, data, 0.0) for i, (kind, data) in enumerate(events))


def _seen(
    delivery: str = "at_least_once",
    *,
    delivered: tuple[int, ...] = (1, 2, 3, 4, 5, 6),
    lost: tuple[int, ...] = (),
    handled: tuple[int, ...] = (11, 12, 13, 14),
    heard: tuple[str, ...] = SAID,
    queued: tuple[str, ...] = QUEUED,
    crashes: int = 0,
) -> TelegramObserved:
    """A chat as the cells observe it: ``delivered`` the pieces (by n) the chat received, in
    order; ``lost`` those recorded ``outbox.failed`` lost (the others ``outbox.sent``)."""
    events: list[tuple[str, dict[str, Any]]] = []
    for update_id in handled:
        outcome = OUTCOMES[min(update_id - 11, len(OUTCOMES) - 1)]
        events.append(
            (
                "update.handled",
                {
                    "update_id": update_id,
                    "chat_id": 7001,
                    "user_id": 7001,
                    "kind": "message",
                    "outcome": outcome,
                },
            )
        )
    for n, text in enumerate(queued, 1):
        events.append(("outbox.queued", {"n": n, "chat_id": 7001, "kind": "text", "text": text}))
        if delivery == "at_most_once":
            events.append(("outbox.sending", {"n": n}))
        if n in lost:
            events.append(("outbox.failed", {"n": n, "reason": "lost"}))
        else:
            events.append(("outbox.sent", {"n": n, "message_ids": [100 + n]}))
    journal = _rows(
        ("run.started", {"agent": "chatty", "input": heard[0]}),
        *(("message.received", {"text": text}) for text in heard[1:]),
    )
    return TelegramObserved(
        delivery=delivery,
        state=RunState(status="completed", output="ok"),
        journal=journal,
        channel_journal=_rows(*events),
        arrivals=(),
        allowed_repeats=0,
        pushed=PUSHED,
        said=SAID,
        delivered=tuple(queued[n - 1] for n in delivered),
        deadletters=0,
        crashes=crashes,
    )


def _problems(seen: TelegramObserved) -> tuple[str, ...]:
    return judge_telegram(seen, EXPECTED).problems


def test_a_clean_chat_and_one_duplicate_or_one_loss_per_crash_as_the_delivery_allows_pass() -> None:
    assert _problems(_seen()) == ()
    assert _problems(_seen("at_most_once")) == ()
    twice = _seen(delivered=(1, 2, 3, 4, 4, 5, 6), crashes=1)
    assert _problems(twice) == ()
    assert note(twice) == "n4 twice"
    dropped = _seen("at_most_once", delivered=(1, 2, 4, 5, 6), lost=(3,), crashes=1)
    assert _problems(dropped) == ()
    assert note(dropped) == "n3 lost"
    recorded_lost = _seen("at_most_once", lost=(3,), crashes=1)
    assert _problems(recorded_lost) == ()
    assert note(recorded_lost) == "n3 recorded lost, received"


def test_a_duplicate_at_most_once_or_a_loss_at_least_once_is_caught() -> None:
    twice = _problems(_seen("at_most_once", delivered=(1, 2, 3, 3, 4, 5, 6), crashes=1))
    assert "messages {3: 2} delivered twice, in an at-most-once cell" in twice
    lost = _problems(_seen(delivered=(1, 2, 4, 5, 6), lost=(3,), crashes=1))
    assert "messages [3] never reached the chat, in an at-least-once cell" in lost
    assert "message 3 failed (lost)" not in lost  # lost is the one reason at most once gives


def test_more_than_one_duplicate_or_loss_per_crash_is_caught() -> None:
    no_crash = _problems(_seen(delivered=(1, 2, 3, 4, 4, 5, 6)))
    assert any("at most one duplicate per crash (0)" in p for p in no_crash)
    two = _problems(_seen(delivered=(1, 2, 3, 3, 4, 4, 5, 6), crashes=1))
    assert any("messages received too often {3: 1, 4: 1}" in p for p in two)
    losses = _seen("at_most_once", delivered=(1, 2, 5, 6), lost=(3, 4), crashes=1)
    assert "messages [3, 4] lost: at most one per crash (1)" in _problems(losses)


def test_messages_received_out_of_queue_order_are_caught() -> None:
    swapped = _problems(_seen(delivered=(1, 2, 4, 3, 5, 6)))
    assert "the chat received messages out of queue order: [1, 2, 4, 3, 5, 6]" in swapped
    # A piece sent again after a later one is out of order, not a duplicate in a row.
    late = _problems(_seen(delivered=(1, 2, 3, 4, 3, 5, 6), crashes=1))
    assert any("out of queue order: [1, 2, 3, 4, 3, 5, 6]" in p for p in late)


def test_an_update_handled_twice_or_never_or_otherwise_is_caught() -> None:
    twice = _problems(_seen(handled=(11, 12, 13, 13, 14)))
    assert any(
        "update 13 ('tell me everything') handled 2 times, expected once" in p for p in twice
    )
    never = _problems(_seen(handled=(11, 12, 14)))
    assert any(
        "update 13 ('tell me everything') handled 0 times, expected once (lost)" in p for p in never
    )
    otherwise = _problems(_seen(handled=(11, 12, 13, 14, 15)))
    assert "update 15 handled 1 times, never pushed" in otherwise


def test_a_message_the_run_heard_twice_never_or_out_of_order_is_caught() -> None:
    twice = _problems(_seen(heard=(SAID[0], SAID[1], SAID[1], SAID[2])))
    assert any("'tell me everything' 2x" in p for p in twice)
    never = _problems(_seen(heard=(SAID[0], SAID[2])))
    assert any("'tell me everything' 0x" in p for p in never)
    swapped = _problems(_seen(heard=(SAID[0], SAID[2], SAID[1])))
    assert any("each message once, in order" in p for p in swapped)


def test_an_outbox_that_differs_or_whose_records_do_not_match_the_chat_is_caught() -> None:
    again = (*QUEUED[:2], QUEUED[1], *QUEUED[2:])  # answer 1 queued twice (a cursor read again)
    queued_twice = _problems(_seen(queued=again, delivered=(1, 2, 3, 4, 5, 6, 7)))
    assert any(
        p.startswith("queued ['Paired with chatty. Writ', 'answer 1', 'answer 1'")
        for p in queued_twice
    )
    never_received = _problems(_seen(delivered=(1, 2, 3, 5, 6), crashes=1))
    assert "message 4 ('answer 2, piece 2') recorded sent, never received" in never_received
    stranger = attrs.evolve(_seen(), delivered=(*QUEUED, "hello from nowhere"))
    assert "the chat received 'hello from nowhere', never queued" in _problems(stranger)


def test_a_piece_left_pending_or_recorded_twice_or_refused_is_caught() -> None:
    seen = _seen()
    unsent = tuple(
        r for r in seen.channel_journal if not (r.type == "outbox.sent" and r.data["n"] == 6)
    )
    pending = _problems(attrs.evolve(seen, channel_journal=_renumbered(unsent)))
    assert "messages [6] left pending (neither sent nor failed)" in pending
    assert any("message 6 ('ok'): 0 outbox.sent and 0 outbox.failed" in p for p in pending)
    extra = (*seen.channel_journal, Row(0, 1, "outbox.sent", {"n": 6, "message_ids": [9]}, 0.0))
    twice = _problems(attrs.evolve(seen, channel_journal=_renumbered(extra)))
    assert any("message 6 ('ok'): 2 outbox.sent and 0 outbox.failed" in p for p in twice)
    refused = (*unsent, Row(0, 1, "outbox.failed", {"n": 6, "reason": "refused"}, 0.0))
    assert "message 6 failed (refused)" in _problems(
        attrs.evolve(seen, channel_journal=_renumbered(refused))
    )


def test_a_journal_that_does_not_fold_a_dead_letter_or_a_leaked_token_is_caught() -> None:
    seen = _seen()
    broken = (*seen.channel_journal, Row(0, 1, "outbox.sent", {"n": "six"}, 0.0))
    folded = _problems(attrs.evolve(seen, channel_journal=_renumbered(broken)))
    assert any("the channel's journal does not fold at seq" in p for p in folded)
    assert "1 messages dead-lettered" in _problems(attrs.evolve(seen, deadletters=1))
    leaked = attrs.evolve(seen, leaks=(SECRET_TOKEN_SPOT,))
    assert f"the bot token appears in {SECRET_TOKEN_SPOT}" in _problems(leaked)
    never = _problems(attrs.evolve(seen, journal=(), state=RunState()))
    assert never[0] == "the chat's conversation run was never started"
    gap = attrs.evolve(seen, channel_journal=seen.channel_journal[1:])
    assert any(p.startswith("channel: journal sequence not contiguous") for p in _problems(gap))


def _renumbered(rows: tuple[Row, ...]) -> tuple[Row, ...]:
    return tuple(attrs.evolve(r, seq=i + 1) for i, r in enumerate(rows))


def _called(step: int, *blocks: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    response = {"content": list(blocks), "model": "m", "response_id": "r", "stop_reason": "end"}
    usage = {"input_tokens": 1, "output_tokens": 1}
    data = {
        "step": step,
        "digest": "d",
        "model": "anthropic/m",
        "response": response | {"usage": usage},
        "cost_usd": None,
        "latency_ms": 1,
    }
    return ("model.called", data)


def test_an_answer_whose_turn_a_message_overtook_is_caught() -> None:
    answer = {"text": "answer 1"}
    ended = _rows(
        ("run.started", {"agent": "chatty", "input": SAID[0]}),
        _called(1, answer),
        ("run.completed", {"output": "answer 1"}),
        ("message.received", {"text": SAID[1]}),
    )
    overtaken = _rows(
        ("run.started", {"agent": "chatty", "input": SAID[0]}),
        _called(1, answer),
        ("message.received", {"text": SAID[1]}),
    )
    assert not any(
        "never ended its turn" in p for p in _problems(attrs.evolve(_seen(), journal=ended))
    )
    found = _problems(attrs.evolve(_seen(), journal=overtaken))
    assert any("model call 1 never ended its turn" in p for p in found)
