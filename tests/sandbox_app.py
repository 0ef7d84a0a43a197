"""Agents with sandboxes, for the sandbox tests (each agent's model is scripted by the test)."""

from __future__ import annotations

import os

from toren import Agent, ToolContext, tool
from toren.sandboxes import Sandbox

MODEL = "anthropic/claude-sonnet-4-6"

# Plain commands run without asking; anything with shell control syntax is asked about.
coder = Agent(
    name="coder",
    model=MODEL,
    system="coder",
    sandbox=Sandbox(allow=["*"], command_timeout="60s", memory="256MiB", idle_stop="1h"),
)
# Every command is approved, except `ls` and `git status` exactly, and `echo` with anything.
careful = Agent(
    name="careful",
    model=MODEL,
    system="careful",
    sandbox=Sandbox(allow=["ls", "git status", "echo *"], idle_stop="1h"),
)
# Stops its container after a second without a command.
sleepy = Agent(
    name="sleepy",
    model=MODEL,
    system="sleepy",
    sandbox=Sandbox(allow=["*"], idle_stop="1s"),
)
# Its commands may run again after a crash.
rerunner = Agent(
    name="rerunner",
    model=MODEL,
    system="rerunner",
    sandbox=Sandbox(allow=["*"], rerunnable=True, idle_stop="1h"),
)


@tool(effects="external", idempotency="at_most_once", timeout="5m")
async def launch(ctx: ToolContext, name: str, seconds: float = 0) -> str:
    """Launch something once: never twice, even across a crash. Each launch appends a line to
    the file TOREN_TEST_LAUNCHES names, then takes ``seconds``."""
    import anyio

    path = anyio.Path(os.environ["TOREN_TEST_LAUNCHES"])
    async with await path.open("a") as f:
        await f.write(f"{name}\n")
    await anyio.sleep(seconds)
    return f"launched {name}"


launcher = Agent(name="launcher", model=MODEL, system="launcher", tools=[launch])
