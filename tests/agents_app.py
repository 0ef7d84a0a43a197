"""An app module with agents, for `toren agents check` and worker boot tests."""

from tests.test_agents import create_ticket, refund, send_email
from toren import Agent

support = Agent(
    name="support",
    model="anthropic/claude-sonnet-4-6",
    system="You help customers.",
    tools=[create_ticket, refund, send_email],
)
