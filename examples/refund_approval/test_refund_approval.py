"""The refund desk, run offline on a real worker and Postgres: what a user would see."""

from __future__ import annotations

from decimal import Decimal

import anyio
import pytest

from examples.refund_approval import app
from examples.refund_approval.model import USAGE, script
from toren.providers.pricing import price
from toren.testing import harness

pytestmark = pytest.mark.anyio

APP = "examples.refund_approval.app"


async def test_a_refund_over_the_threshold_waits_for_approval_then_is_issued() -> None:
    async with harness(APP, script) as h:
        run_id = await h.start("refund_desk", "Order A-17 arrived broken. Refund me, please.")
        [call] = await h.waiting(run_id)
        assert call.name == "issue_refund"
        assert call.arguments == {"order_id": "A-17", "amount": 120.0}
        issued_before = len(app.ISSUED)

        await h.approve(run_id)
        state = await h.wait(run_id, "completed")
        assert state.output == "Done: refund of $120.00 issued for A-17."
        assert len(app.ISSUED) == issued_before + 1

        receipt = await h.receipt(run_id)
        assert receipt.calls_made == 3
        assert receipt.calls_replayed == 0
        assert receipt.input_tokens == 3 * USAGE.input_tokens
        assert receipt.output_tokens == 3 * USAGE.output_tokens
        one_call = price("anthropic", "claude-sonnet-4-6", USAGE)
        assert one_call is not None
        assert one_call > Decimal(0)
        assert receipt.usd_paid == 3 * one_call
        assert len(h.model.requests) == 3  # what the model was sent: each call once


async def test_a_small_refund_is_issued_without_asking() -> None:
    async with harness(APP, script) as h:
        run_id = await h.start("refund_desk", "My milk jug, order B-2, arrived dented.")
        state = await h.wait(run_id, "completed")
        assert state.output == "Done: refund of $30.00 issued for B-2."
        assert (await h.receipt(run_id)).calls_made == 3


async def test_a_denied_refund_is_not_issued_and_the_customer_is_told() -> None:
    async with harness(APP, script) as h:
        run_id = await h.start("refund_desk", "Refund order A-17.")
        issued_before = len(app.ISSUED)
        await h.deny(run_id, reason="the item must come back first")
        state = await h.wait(run_id, "completed")
        assert state.output is not None
        assert state.output.startswith("No refund was made: denied by")
        assert "the item must come back first" in state.output
        assert len(app.ISSUED) == issued_before


async def test_a_message_after_the_answer_is_answered_too() -> None:
    async with harness(APP, script) as h:
        run_id = await h.start("refund_desk", "My milk jug, order B-2, arrived dented.")
        await h.wait(run_id, "completed")
        await h.say(run_id, "Thanks! And order A-17?")  # the run goes on (status running)
        with anyio.fail_after(30):
            await h.model.arrived(4).wait()  # the model is asked about the message
        state = await h.wait(run_id, "completed")
        assert state.output == "This desk handles one refund per run: start a new run for another."
