"""The channel's state: its fold over a journal (pairing, the outbox, prompts, watches,
migrations, observers) and its snapshot, read back equal to the fold."""

from __future__ import annotations

import pytest

from toren import Client
from toren._core.snapshots import encode, read, write
from toren.channels import (
    SNAPSHOT_VERSION,
    ChannelFailing,
    ChannelRecovered,
    ChannelState,
    ChatMigrated,
    ChatPaired,
    ChatUnpaired,
    CodeIssued,
    ConversationStarted,
    Failed,
    ObserverChanged,
    PairFailed,
    PromptOpened,
    Queued,
    RunRead,
    Sending,
    Sent,
    UpdateHandled,
    fold,
    telegram_principal,
)
from toren.channels._state import RECENT

pytestmark = pytest.mark.anyio
WHO = telegram_principal(7, "ann")


def journal() -> list[object]:
    events: list[object] = [
        CodeIssued(code_hash="h1", expires_at=10.0, by=WHO, at=1.0),
        PairFailed(chat_id=9, at=1.5),
        ChatPaired(chat_id=5, title="ann", chat_type="private", code_hash="h1", by=WHO, at=2.0),
        ConversationStarted(key="5", chat_id=5, thread=None, run="run/a", at=2.0),
        ObserverChanged(chat_id=5, agent="teller", by=WHO, at=2.0),
        ObserverChanged(chat_id=5, run="run/b", by=WHO, after=3, at=2.0),
        RunRead(run="run/a", seq=4),
    ]
    for n in range(1, RECENT + 20):
        events.append(Queued(n=n, chat_id=5, kind="text", text=f"m{n}", at=3.0))
        events.append(Sent(n=n, message_ids=(n,), at=3.0))
    n = RECENT + 20
    events += [
        Queued(n=n, chat_id=5, kind="prompt", text="p", decision="d1", at=4.0),
        PromptOpened(decision="d1", run="run/a", call_id="c1", name="refund", chat_id=5, at=4.0),
        Sending(n=n, at=4.0),
        Sent(n=n, message_ids=(900,), at=4.0),
        Queued(n=n + 1, chat_id=5, kind="text", text="lost", at=5.0),
        Sending(n=n + 1, at=5.0),
        Failed(n=n + 1, reason="lost", at=5.0),
        Queued(n=n + 2, chat_id=5, kind="text", text="after the upgrade", at=6.0),
        ChatMigrated(chat_id=5, to=-1005, at=6.0),
        ChannelFailing(error="no answer from the Bot API", since=6.0, at=6.0),
        ChannelFailing(error="refused", since=6.0, at=7.0),  # the reason changed
    ]
    return events


def folded() -> ChannelState:
    state = ChannelState()
    for event in journal():
        state = fold(state, event)
    return state


def test_the_fold_keeps_pending_messages_and_the_recent_ones() -> None:
    state = folded()
    assert len(state.recent) == RECENT  # older delivered messages are forgotten
    assert list(state.pending) == [RECENT + 22]
    pending = state.outgoing(RECENT + 22)
    assert pending is not None
    assert pending.chat_id == -1005  # follows the migration
    assert "-1005" in state.chats
    assert state.conversations == {"-1005": "run/a"}
    assert state.prompt_of["5/900"] == "d1"
    lost = state.outgoing(RECENT + 21)
    assert lost is not None
    assert lost.state == "lost"
    assert (state.sent, state.failed) == (RECENT + 20, 1)
    assert state.watches["run/b"].seq == 3
    assert state.codes == {}  # used
    assert list(state.failures["9"]) == [1.5]


def test_failing_keeps_its_first_time_and_last_reason_until_recovered() -> None:
    state = folded()
    assert state.failing is not None
    assert (state.failing.since, state.failing.error, state.failing.at) == (6.0, "refused", 7.0)
    assert fold(state, ChannelRecovered(at=8.0)).failing is None


def test_unpairing_forgets_the_chat_its_conversation_and_its_observations() -> None:
    state = fold(folded(), ChatUnpaired(chat_id=-1005, by=WHO, at=7.0))
    assert state.chats == {}
    assert state.conversations == {}


async def test_the_snapshot_reads_back_as_the_fold(client: Client) -> None:
    state = folded()
    await client.spawn("toren.channel", "channel/telegram/snap", {"bot": "snap"})
    version = SNAPSHOT_VERSION
    assert await write(client.pool, "channel/telegram/snap", version, 99, encode(state, 99))
    async with client.pool.acquire() as conn, conn.transaction(isolation="repeatable_read"):
        found = await read(conn, "channel/telegram/snap", ChannelState, version)
    assert found is not None
    assert found == (state, 99)


def test_a_run_whose_turn_ended_is_read_again_only_once_sent_something() -> None:
    state = fold(ChannelState(), ConversationStarted(key="5", chat_id=5, thread=None, run="run/a"))
    assert state.watches["run/a"].active
    state = fold(state, RunRead(run="run/a", seq=9, done=True))  # its reply read: turn over
    assert not state.watches["run/a"].active
    state = fold(state, RunRead(run="run/a", seq=9))  # read at a sweep: nothing new, no change
    state = fold(state, RunRead(run="run/a", seq=9, done=True))
    handled = UpdateHandled(
        update_id=1, chat_id=5, user_id=7, kind="message", outcome="forwarded", run="run/a"
    )
    state = fold(state, handled)  # the chat wrote again: read at every tick until it answers
    assert state.watches["run/a"].active


def test_a_turn_that_ended_before_the_run_took_the_chats_last_message_is_read_on() -> None:
    state = fold(ChannelState(), ConversationStarted(key="5", chat_id=5, thread=None, run="run/a"))

    def handled(update_id: int, outcome: str) -> UpdateHandled:
        return UpdateHandled(
            update_id=update_id, chat_id=5, user_id=7, kind="message", outcome=outcome, run="run/a"
        )

    state = fold(state, handled(1, "started"))
    state = fold(state, handled(2, "forwarded"))  # written while the first answer was made
    state = fold(state, RunRead(run="run/a", seq=5, done=True, heard=1))  # the first answer
    assert state.watches["run/a"].active  # the second message's answer is still to come
    state = fold(state, RunRead(run="run/a", seq=9, done=True, heard=1))  # it came
    assert not state.watches["run/a"].active
    # A record of an earlier version (no count) is taken at its word.
    state = fold(state, handled(3, "forwarded"))
    state = fold(state, RunRead(run="run/a", seq=12, done=True))
    assert not state.watches["run/a"].active
