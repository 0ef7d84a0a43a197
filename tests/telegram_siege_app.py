"""Agents for the attack tests of the Telegram channel (tests/test_telegram_attacks.py).

Their names and bots are used nowhere else in the suite: ``siegehook`` runs its bot in webhook
mode (for a real ``toren worker`` whose DEBUG log is read), ``siegespin`` polls with a long-poll
timeout under a second.
"""

from __future__ import annotations

from toren import Agent
from toren.channels import Telegram

MODEL = "anthropic/claude-sonnet-4-6"
HOOK_TOKEN_ENV = "TOREN_TEST_TELEGRAM_SIEGEHOOK_TOKEN"
HOOK_SECRET_ENV = "TOREN_TEST_TELEGRAM_SIEGEHOOK_SECRET"
SPIN_TOKEN_ENV = "TOREN_TEST_TELEGRAM_SIEGESPIN_TOKEN"

siegehook = Agent(
    name="siegehook",
    model=MODEL,
    system="siegehook",
    telegram=Telegram(
        bot="siegehook",
        token_env=HOOK_TOKEN_ENV,
        mode="webhook",
        webhook_url="https://toren.example/telegram/siegehook",
        webhook_secret_env=HOOK_SECRET_ENV,
        poll_timeout=1,
        chat_interval=0,
    ),
)

siegespin = Agent(
    name="siegespin",
    model=MODEL,
    system="siegespin",
    telegram=Telegram(bot="siegespin", token_env=SPIN_TOKEN_ENV, poll_timeout=1, chat_interval=0),
)
