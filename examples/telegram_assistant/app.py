"""``telegram_assistant``: answers a paired Telegram chat, with a tool to look time zones up.

The bot's token comes from ``ASSISTANT_BOT_TOKEN`` (from @BotFather). Run it offline against a
real bot (from the repository's root)::

    export ASSISTANT_BOT_TOKEN=123456789:AAE...
    toren dev --app examples.telegram_assistant.app \\
        --model-script examples.telegram_assistant.model:script
    toren channels pair telegram_assistant       # then send /pair CODE to the bot
"""

from __future__ import annotations

from toren import Agent, ToolContext, tool
from toren.channels import Telegram

TOKEN_ENV = "ASSISTANT_BOT_TOKEN"  # noqa: S105  (the name of the variable, not a token)
ZONES = {
    "oslo": "Europe/Oslo (UTC+1)",
    "lima": "America/Lima (UTC-5)",
    "tokyo": "Asia/Tokyo (UTC+9)",
}


@tool(effects="read")
async def time_zone(ctx: ToolContext, city: str) -> str:
    """The time zone of a city."""
    zone = ZONES.get(city.strip().lower())
    if zone is None:
        raise LookupError(f"no time zone known for {city}")
    return zone


telegram_assistant = Agent(
    name="telegram_assistant",
    model="anthropic/claude-sonnet-4-6",
    system="You are a helpful assistant in a Telegram chat. Keep answers short.",
    tools=[time_zone],
    telegram=Telegram(bot="assistant", token_env=TOKEN_ENV),
    budget_usd=1.0,
)
