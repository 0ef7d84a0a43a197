"""An agent served by another worker process than its caller's (tests/test_calls.py)."""

from __future__ import annotations

from toren import Agent

remote_helper = Agent(
    name="remote_helper",
    model="anthropic/claude-sonnet-4-6",
    system="remote_helper",
    description="Helps from another worker.",
    accepts=["desk"],
)
