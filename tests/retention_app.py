"""Agents for the retention tests: boss calls helper (a child run per call); boss's ended runs
are kept an hour (the tests age them), helper's go with their parent."""

from __future__ import annotations

from toren import Agent, Retention

MODEL = "anthropic/claude-sonnet-4-6"

boss = Agent(
    name="boss", model=MODEL, system="boss", calls=["helper"], retention=Retention(keep_for="1h")
)
helper = Agent(
    name="helper", model=MODEL, system="helper", description="Helps the boss.", accepts=["boss"]
)
