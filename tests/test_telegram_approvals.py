"""Approvals from Telegram: a prompt with Approve / Deny buttons whose callback data is a short
opaque id, a text reply to the prompt, only configured approvers deciding (recorded as their
Telegram user), stale buttons, observers who cannot decide; a call shown with its bidi controls
escaped, and one too long to show whole in a message decided only elsewhere."""

from __future__ import annotations

from typing import Any

import pytest

import toren.providers.anthropic  # noqa: F401  (the SDK import is paid here, not in a step)
from tests.conftest import person, wait_for
from tests.telegram_app import FRONT_APPROVER, PAY_APPROVER
from tests.telegram_support import (
    ALICE,
    APPROVER,
    FRONT,
    bots,
    channel_row,
    channel_worker,
    paired,
    received,
)
from toren import Client
from toren.channels import TEXT_LIMIT, telegram_principal
from toren.channels.client import ChannelError, observe, pair
from toren.runs import decide, read_run, waiting_on
from toren.testing.telegram_server import TelegramServer

pytestmark = pytest.mark.anyio
__all__ = ["bots", "channel_worker"]  # the fixtures

STRANGER = 777


def buttons(message: Any) -> list[tuple[str, str]]:
    rows = (message.reply_markup or {}).get("inline_keyboard", [])
    return [(b["text"], b["callback_data"]) for row in rows for b in row]


async def conversation(client: Client, chat_id: int) -> str:
    summary = await channel_row(client, "teller")
    assert summary is not None
    [run] = [c["run"] for c in summary["chats"] if c["chat_id"] == chat_id]
    return str(run)


async def decisions(client: Client, run_id: str) -> list[dict[str, Any]]:
    rows = await client.pool.fetch(
        "SELECT data FROM toren.journal WHERE actor_id = $1 AND type = 'approval.decided' "
        "ORDER BY seq",
        run_id,
    )
    return [r["data"] for r in rows]


async def answer_to(server: TelegramServer, n: int) -> str:
    async def answered() -> str | None:
        answers = server.callback_answers
        return (answers[n - 1].text or "") if len(answers) >= n else None

    return str(await wait_for(answered, what=f"callback answer {n}"))


async def test_a_button_decides_only_for_an_approver_and_a_stale_one_says_so(
    client: Client, bots: tuple[TelegramServer, Any]
) -> None:
    server, _ = bots
    await paired(client, server, 100)
    server.push_message(100, "please refund 5", user_id=ALICE)
    prompt = await received(server, 100, lambda t: "asks to run refund" in t)
    assert '"amount": 5' in prompt.text
    [(approve, approve_data), (deny, _deny_data)] = buttons(prompt)
    assert (approve, deny) == ("Approve", "Deny")
    assert 1 <= len(approve_data.encode()) <= 64  # Telegram's limit; the server enforces it
    run_id = await conversation(client, 100)
    opaque = approve_data.split(":", 1)[1]
    assert run_id.removeprefix("run/") not in opaque  # nothing of the run or the call in it
    assert "refund" not in opaque

    server.push_callback(100, prompt.message_id, approve_data, user_id=STRANGER)
    assert "Only the agent's approvers" in await answer_to(server, 1)
    assert (await read_run(client, run_id)).status == "parked"

    server.push_callback(100, prompt.message_id, approve_data, user_id=APPROVER)
    assert await answer_to(server, 2) == "Approved."
    await received(server, 100, lambda t: t == "done: refunded 5")
    [decision] = await decisions(client, run_id)
    assert decision["approved"] is True
    assert decision["by"] == {
        "kind": "channel",
        "id": f"telegram:{APPROVER}",
        "name": f"user{APPROVER}",
        "via": "telegram",
    }

    server.push_callback(100, prompt.message_id, approve_data, user_id=APPROVER)  # again
    assert "no longer waits" in await answer_to(server, 3)
    server.push_callback(100, prompt.message_id, "a:not-a-known-id", user_id=APPROVER)
    assert "not known" in await answer_to(server, 4)
    assert len(await decisions(client, run_id)) == 1


async def test_a_reply_to_the_prompt_decides_with_its_reason(
    client: Client, bots: tuple[TelegramServer, Any]
) -> None:
    server, _ = bots
    await paired(client, server, 100)
    server.push_message(100, "refund 7", user_id=ALICE)
    prompt = await received(server, 100, lambda t: "asks to run refund" in t)
    run_id = await conversation(client, 100)

    server.push_message(100, "deny", user_id=STRANGER, reply_to=prompt.message_id)
    await received(server, 100, lambda t: t.startswith("Only the agent's approvers"))
    server.push_message(100, "maybe", user_id=APPROVER, reply_to=prompt.message_id)
    await received(server, 100, lambda t: t.startswith("Reply with approve or deny"))
    assert (await read_run(client, run_id)).status == "parked"

    server.push_message(100, "deny: too much", user_id=APPROVER, reply_to=prompt.message_id)
    await received(server, 100, lambda t: t.startswith("Denied by"))
    await received(server, 100, lambda t: t.startswith("done:") and "denied" in t)
    [decision] = await decisions(client, run_id)
    assert decision["approved"] is False
    assert decision["reason"] == "too much"
    assert decision["by"]["id"] == f"telegram:{APPROVER}"


async def observed(client: Client, server: TelegramServer) -> None:
    """Chat 100 paired with the teller, and chat 900 (an approver's) observing its runs."""
    await paired(client, server, 100)
    await paired(client, server, 900, user=APPROVER)
    await observe(client, "teller", 900, observed_agent="teller", by=person("op"))
    await received(server, 900, lambda t: "observes (read-only)" in t)


async def test_an_observer_sees_a_run_and_cannot_decide(
    client: Client, bots: tuple[TelegramServer, Any]
) -> None:
    server, _ = bots
    await observed(client, server)
    with pytest.raises(ChannelError, match="not paired"):
        await observe(client, "teller", 901, observed_agent="teller", by=person("op"))

    server.push_message(100, "refund 9", user_id=ALICE)
    await received(server, 100, lambda t: "asks to run refund" in t)
    seen = await received(server, 900, lambda t: "waits for a decision on refund" in t)
    assert buttons(seen) == []  # nothing to press
    server.push_message(900, "approve", user_id=APPROVER, reply_to=seen.message_id)
    run_id = await conversation(client, 100)

    async def forwarded() -> bool:  # the reply went to the observer chat's own conversation
        summary = await channel_row(client, "teller")
        return bool(summary and any(c["chat_id"] == 900 and c["run"] for c in summary["chats"]))

    await wait_for(forwarded, what="the observer's reply handled")
    assert await decisions(client, run_id) == []
    assert (await read_run(client, run_id)).status == "parked"


async def test_a_childs_call_shown_in_its_parents_chat_is_decided_only_by_the_childs_approvers(
    client: Client, channel_worker: tuple[TelegramServer, Any, Any]
) -> None:
    server, _, worker = channel_worker
    code, _ = await pair(client, "front", by=person("op"))
    server.push_message(100, f"/pair {code}", user_id=FRONT_APPROVER, token=FRONT)
    await received(server, 100, lambda t: t.startswith("Paired with front"), token=FRONT)
    server.push_message(100, "please pay 5", user_id=FRONT_APPROVER, token=FRONT)
    prompt = await received(server, 100, lambda t: "transfer (in pay, run" in t, token=FRONT)
    [(_, approve_data), _deny] = buttons(prompt)
    child = await client.pool.fetchval(
        "SELECT actor_id FROM toren.actors WHERE kind = 'toren.run' AND args->>'agent' = 'pay'"
    )

    # front's approver may not decide pay's call, from front's chat or straight to the run.
    server.push_callback(100, prompt.message_id, approve_data, user_id=FRONT_APPROVER, token=FRONT)
    assert "Only the approvers of pay" in await answer_to(server, 1)
    [waiting] = waiting_on(await read_run(client, child))
    outcome = await decide(
        client,
        child,
        call_id=waiting.id,
        approved=True,
        by=telegram_principal(FRONT_APPROVER, "front approver"),
    )
    assert outcome is not None
    assert outcome.outcome == "forbidden"
    assert (await read_run(client, child)).status == "parked"

    # pay's approver, in the same chat, may.
    server.push_callback(100, prompt.message_id, approve_data, user_id=PAY_APPROVER, token=FRONT)
    assert await answer_to(server, 2) == "Approved."
    await received(server, 100, lambda t: t == "done: done: transferred 5", token=FRONT)
    [decision] = await decisions(client, child)
    assert decision["by"]["id"] == f"telegram:{PAY_APPROVER}"

    # A prompt an earlier version opened names no agent: the agent of its run decides who may.
    from toren import Context
    from toren.actors.channels import runtime
    from toren.actors.channels.actor import ChannelActor
    from toren.actors.channels.inbound import Inbound
    from toren.channels import Prompt, PromptOpened

    earlier = PromptOpened(decision="d", run=child, call_id="c", name="transfer", chat_id=100)
    front = "channel/telegram/front"
    actor = ChannelActor(front, {"bot": "front"})
    ctx = Context(actor, None, 0, 1, None, resources=worker.resources)
    inbound = Inbound(ctx, runtime.of(ctx).bot("front"), front)  # type: ignore[arg-type]
    assert await inbound._approvers(Prompt(opened=earlier)) == ("pay", (PAY_APPROVER,))


async def test_a_calls_bidi_controls_show_as_escapes_in_its_prompt_and_to_observers(
    client: Client, bots: tuple[TelegramServer, Any]
) -> None:
    server, _ = bots
    await observed(client, server)
    # U+202E reverses what follows: raw, the note would read "...sh.pdf" beside the buttons.
    server.push_message(100, "refund 5 noting /home/\u202efdp.sh; rm -rf ~", user_id=ALICE)
    prompt = await received(server, 100, lambda t: "asks to run refund" in t)
    assert "\u202e" not in prompt.text, f"the prompt shows a raw U+202E: {prompt.text!r}"
    assert '"note": "/home/\\u202efdp.sh; rm -rf ~"' in prompt.text
    assert [text for text, _ in buttons(prompt)] == ["Approve", "Deny"]  # shown whole: decides
    seen = await received(server, 900, lambda t: "waits for a decision on refund" in t)
    assert "\u202e" not in seen.text, f"the observer sees a raw U+202E: {seen.text!r}"
    assert "/home/\\u202efdp.sh" in seen.text
    server.push_callback(100, prompt.message_id, buttons(prompt)[0][1], user_id=APPROVER)
    ran = await received(server, 900, lambda t: t.startswith("\U0001f527") and "refund" in t)
    assert "\u202e" not in ran.text
    assert "/home/\\u202efdp.sh" in ran.text


async def _waiting_call(client: Client, run_id: str) -> str:
    async def waiting() -> str | None:
        calls = waiting_on(await read_run(client, run_id))
        return calls[0].id if calls else None

    return str(await wait_for(waiting, what=f"a call of {run_id} waiting"))


@pytest.mark.parametrize("via", ["the run", "a child run"])
async def test_a_call_too_long_for_one_message_is_prompted_without_buttons_and_decided_elsewhere(
    client: Client, bots: tuple[TelegramServer, Any], via: str
) -> None:
    server, _ = bots
    await paired(client, server, 100)
    ask = "refund 5 with a 5000-character note"
    server.push_message(100, ask if via == "the run" else f"ask the clerk to {ask}", user_id=ALICE)
    prompt = await received(server, 100, lambda t: "asks to run refund" in t)
    run_id = await conversation(client, 100)
    if via == "a child run":  # the call waits in the clerk's run, and is decided there
        [child] = (await read_run(client, run_id)).children.values()
        run_id = child.run_id
        assert f"(in clerk, run {run_id})" in prompt.text
    call_id = await _waiting_call(client, run_id)
    # Shown cut (in one message), with no button to decide what it does not show, and where
    # to see it whole and decide it.
    assert buttons(prompt) == []
    assert len(prompt.text.encode("utf-16-le")) // 2 <= TEXT_LIMIT
    assert "[cut: " in prompt.text
    assert "cannot be decided here" in prompt.text
    assert f"console's page of run {run_id}" in prompt.text
    assert f"toren jobs approve {run_id} --call {call_id}" in prompt.text
    assert f"toren jobs deny {run_id} --call {call_id}" in prompt.text

    server.push_message(100, "approve", user_id=APPROVER, reply_to=prompt.message_id)
    # The clerk has no approvers on Telegram at all: that is what its chat is told first.
    why = (
        "cannot be decided from Telegram"
        if via == "the run"
        else "clerk, whose call it is, has no approvers on Telegram"
    )
    told = await received(server, 100, lambda t: why in t)
    assert f"toren jobs approve {run_id} --call {call_id}" in told.text
    assert await decisions(client, run_id) == []
    assert await _waiting_call(client, run_id) == call_id
    assert (await read_run(client, run_id)).status == "parked"
    # Decided where it is shown whole, it is applied as any decision is.
    await decide(client, run_id, call_id=call_id, approved=False, by=person("ana"))
    await received(server, 100, lambda t: t.startswith("done:") and "denied" in t)
    [decision] = await decisions(client, run_id)
    assert decision["by"]["name"] == "ana"


async def test_a_press_refused_for_a_call_decided_elsewhere_says_where_in_full(
    client: Client, bots: tuple[TelegramServer, Any]
) -> None:
    """A button press on a child run's call whose agent has no approvers on Telegram is refused
    with where to decide it. A button's answer holds at most 200 characters, too few for the run
    and both commands: the press is answered briefly, and the chat is told in full."""
    server, _ = bots
    await paired(client, server, 100)
    server.push_message(100, "ask the clerk to refund 5", user_id=ALICE)
    prompt = await received(server, 100, lambda t: "asks to run refund (in clerk" in t)
    [child] = (await read_run(client, await conversation(client, 100))).children.values()
    call_id = await _waiting_call(client, child.run_id)
    server.push_callback(100, prompt.message_id, buttons(prompt)[0][1], user_id=APPROVER)
    answered = await answer_to(server, 1)
    assert len(answered) <= 200
    # Whatever the answer holds, what it names is whole: no command cut in the middle.
    command = f"toren jobs approve {child.run_id} --call {call_id}"
    assert command in answered or "toren jobs" not in answered, answered
    told = await received(server, 100, lambda t: command in t)
    assert f"toren jobs deny {child.run_id} --call {call_id}" in told.text
    assert await decisions(client, child.run_id) == []
