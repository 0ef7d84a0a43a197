"""``pair_coder``: writes files and runs commands in a container of its own (``Sandbox``).

Commands that start with ``python3`` or ``ls`` run at once (allow rules); any other command
waits for a human to approve it. Run it offline (from the repository's root; needs Docker and
the sandbox image, ``./scripts/sandbox-image``)::

    toren dev --app examples.coding_agent.app --model-script examples.coding_agent.model:script
"""

from __future__ import annotations

from toren import Agent
from toren.sandboxes import Sandbox

pair_coder = Agent(
    name="pair_coder",
    model="anthropic/claude-sonnet-4-6",
    system="You write small Python programs in /workspace and run them to check them.",
    sandbox=Sandbox(allow=["python3 *", "ls", "ls *"], command_timeout="60s", memory="256MiB"),
    budget_usd=1.0,
)
