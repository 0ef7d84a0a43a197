"""The demo's offline model (``toren.demo.demo_model``) as a newcomer drives it from the
quickstart: it says what became of the refund, a denial included, and answers what is written
to it afterwards instead of repeating itself."""

from __future__ import annotations

import pytest

from tests.conftest import wait_for
from toren.demo import DEMO_INPUT, LABEL, demo_model
from toren.runs import RunState, waiting_on
from toren.testing import Harness, ToolCall, harness

pytestmark = pytest.mark.anyio


async def answered_again(h: Harness, run_id: str, before: RunState) -> RunState:
    """The run once it has answered the message sent after ``before`` (a completed run's
    status reads completed until the message is taken)."""

    async def answered() -> RunState | None:
        state = await h.state(run_id)
        moved = len(state.calls) > len(before.calls)
        return state if moved and state.status == "completed" else None

    found: RunState = await wait_for(answered, timeout=30, what="the answer to the message")
    return found


async def test_a_denied_refund_is_answered_with_the_reason_and_a_reply_asks_again() -> None:
    async with harness("toren.demo", demo_model) as h:
        run_id = await h.start("concierge", DEMO_INPUT)
        [call] = await h.waiting(run_id)
        assert call.name == "issue_refund"
        await h.deny(run_id, reason="needs a photo first")
        denied = await h.wait(run_id, "completed")
        assert denied.output is not None
        assert denied.output.startswith(LABEL)
        assert "needs a photo first" in denied.output
        assert "on its way" not in denied.output

        await h.say(run_id, "Here is a photo of the broken machine.")

        async def parked() -> list[ToolCall]:  # completed reads until the message is taken
            return waiting_on(await h.state(run_id))

        # The refund asked for anew, not claimed done.
        [again] = await wait_for(parked, timeout=30, what="the refund asked for again")
        assert again.name == "issue_refund"
        assert again.id != call.id
        assert again.arguments == call.arguments
        await h.approve(run_id)
        done = await answered_again(h, run_id, denied)
        assert done.output == f"{LABEL} Done: your $80 refund for order A-17 is on its way."


async def test_a_message_after_the_refund_is_answered_about_it_not_with_the_same_sentence() -> None:
    async with harness("toren.demo", demo_model) as h:
        run_id = await h.start("concierge", DEMO_INPUT)
        await h.waiting(run_id)
        await h.approve(run_id)
        done = await h.wait(run_id, "completed")
        assert done.output == f"{LABEL} Done: your $80 refund for order A-17 is on its way."

        await h.say(run_id, "Thanks! When will it arrive?")
        later = await answered_again(h, run_id, done)
        assert later.output is not None
        assert later.output != done.output
        assert "was issued already" in later.output
        assert len(later.calls) == len(done.calls) + 1  # answered, no tool asked for again
