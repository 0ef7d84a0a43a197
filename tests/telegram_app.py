"""Agents reached over Telegram, for the channel tests (their bots talk to a local Bot API
server; tokens come from the environment the test sets)."""

from __future__ import annotations

from toren import Agent, ToolContext, tool
from toren.channels import Telegram
from toren.sandboxes import Sandbox

MODEL = "anthropic/claude-sonnet-4-6"
APPROVER = 4242
TOKEN_ENV = "TOREN_TEST_TELEGRAM_TOKEN"
BRIEF_TOKEN_ENV = "TOREN_TEST_TELEGRAM_BRIEF_TOKEN"
ONCE_TOKEN_ENV = "TOREN_TEST_TELEGRAM_ONCE_TOKEN"
FILER_TOKEN_ENV = "TOREN_TEST_TELEGRAM_FILER_TOKEN"
TOPICS_TOKEN_ENV = "TOREN_TEST_TELEGRAM_TOPICS_TOKEN"
FRONT_TOKEN_ENV = "TOREN_TEST_TELEGRAM_FRONT_TOKEN"
PAY_TOKEN_ENV = "TOREN_TEST_TELEGRAM_PAY_TOKEN"
FRONT_APPROVER = 501
PAY_APPROVER = 999


@tool(effects="external", idempotency="keyed", approval="always")
async def refund(ctx: ToolContext, amount: int, note: str = "") -> str:
    """Refund an amount to the customer (with a note for the books)."""
    return f"refunded {amount}"


# Replies to each message; refunds only with an approver's decision; asks its clerk to.
teller = Agent(
    name="teller",
    model=MODEL,
    system="teller",
    tools=[refund],
    calls=["clerk"],
    telegram=Telegram(
        bot="teller", token_env=TOKEN_ENV, approvers=[APPROVER], poll_timeout=1, chat_interval=0
    ),
)
# Refunds when the teller asks (a cross-agent call): its calls are prompted in the teller's chat.
clerk = Agent(
    name="clerk",
    model=MODEL,
    system="clerk",
    description="Refunds what it is asked to.",
    accepts=["teller"],
    tools=[refund],
)
# Its pairing codes last a second.
brief = Agent(
    name="brief",
    model=MODEL,
    system="brief",
    telegram=Telegram(
        bot="brief", token_env=BRIEF_TOKEN_ENV, poll_timeout=1, chat_interval=0, pair_code_ttl=1
    ),
)
# At-most-once delivery.
once = Agent(
    name="once",
    model=MODEL,
    system="once",
    telegram=Telegram(
        bot="once",
        token_env=ONCE_TOKEN_ENV,
        poll_timeout=1,
        chat_interval=0,
        delivery="at_most_once",
    ),
)
# Has a workspace: takes files from the chat (at most 64 KiB) and sends files back.
filer = Agent(
    name="filer",
    model=MODEL,
    system="filer",
    sandbox=Sandbox(allow=["*"], idle_stop="1h"),
    telegram=Telegram(
        bot="filer",
        token_env=FILER_TOKEN_ENV,
        poll_timeout=1,
        chat_interval=0,
        max_file_bytes=64 * 1024,
    ),
)
# One conversation per forum topic.
topics = Agent(
    name="topics",
    model=MODEL,
    system="topics",
    telegram=Telegram(
        bot="topics", token_env=TOPICS_TOKEN_ENV, poll_timeout=1, chat_interval=0, per_thread=True
    ),
)


@tool(effects="external", idempotency="keyed", approval="always")
async def transfer(ctx: ToolContext, amount: int) -> str:
    """Transfer an amount (each transfer approved by one of pay's approvers)."""
    return f"transferred {amount}"


# Each behind its own bot with its own approvers; front calls pay, whose calls only pay's
# approvers decide, also from front's chat.
front = Agent(
    name="front",
    model=MODEL,
    system="front",
    calls=["pay"],
    telegram=Telegram(
        bot="front",
        token_env=FRONT_TOKEN_ENV,
        approvers=[FRONT_APPROVER],
        poll_timeout=1,
        chat_interval=0,
    ),
)
pay = Agent(
    name="pay",
    model=MODEL,
    system="pay",
    description="Transfers money; give it the amount.",
    accepts=["front"],
    tools=[transfer],
    telegram=Telegram(
        bot="pay",
        token_env=PAY_TOKEN_ENV,
        approvers=[PAY_APPROVER],
        poll_timeout=1,
        chat_interval=0,
    ),
)
