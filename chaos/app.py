"""The app the chaos matrix runs: one agent whose run touches every kind of step, two that make
a cross-agent call, two whose tools run in a sandbox, and two reached through Telegram bots.

The scripted model (see :func:`chaos.servers.script`) has the ``chaos`` agent open a ticket (a
keyed external effect), refund the customer (a keyed external effect that needs an approval),
sleep on a durable timer, and answer. The ``caller`` agent calls the ``callee`` agent (its child
run opens a ticket and answers) and answers with what the callee said: the call cells' run.
The ``sandboxed`` agent writes a
script into its workspace and runs it twice (see :data:`chaos.servers.SANDBOX_CALLS`): the sandbox
cells' run; ``rerunnable`` is the same with its sandbox declared rerunnable. ``chatty`` and
``chatty_once`` answer a Telegram chat (the Telegram cells), delivering at least once and at most
once. ``ticker`` starts a run every second on its ``tick`` schedule (the schedule cells), each
run a one-line answer; its workers alone declare it (``CHAOS_SCHEDULES``). ``versioned`` opens a
ticket and refunds (the version cells: a run upgraded to another version, a run forked); a
worker's ``CHAOS_VERSION`` changes its system prompt, so workers with and without it serve two
versions of it. The effects go to
the harness's :class:`chaos.servers.EffectServer`, which applies each idempotency key once and
counts every request.

If ``CHAOS_MUTATION`` names a mutation, importing this module loads it into the worker process
(see :mod:`chaos.mutations`): the harness's way to remove one protection and watch cells turn
red. Production code has no such switch.
"""

from __future__ import annotations

import os

import aiohttp

from toren import Agent, ToolContext, durable_sleep, tool
from toren.channels import Telegram
from toren.sandboxes import Sandbox
from toren.schedules import Schedule


async def _apply(ctx: ToolContext, kind: str, detail: str) -> str:
    url = os.environ["CHAOS_EFFECTS_URL"]
    body = {"run": ctx.run_id, "kind": kind, "detail": detail, "key": ctx.idempotency_key}
    async with (
        aiohttp.ClientSession() as session,
        session.post(
            f"{url}/effects", json=body, headers={"Idempotency-Key": ctx.idempotency_key}
        ) as response,
    ):
        response.raise_for_status()
        answer = await response.json()
    return f"{kind} {detail}: {'applied' if answer['applied'] else 'already applied'}"


@tool(effects="external", idempotency="keyed")
async def open_ticket(ctx: ToolContext, title: str) -> str:
    """Open a ticket in the tracker."""
    return await _apply(ctx, "ticket", title)


@tool(effects="external", idempotency="keyed", approval=lambda args: True)
async def refund(ctx: ToolContext, amount: float) -> str:
    """Refund the customer (a person approves every refund)."""
    return await _apply(ctx, "refund", f"{amount:g}")


chaos = Agent(
    name="chaos",
    model="anthropic/claude-sonnet-4-6",
    system="You resolve support cases.",
    tools=[open_ticket, refund, durable_sleep],
)

# The call cells' agents: the script answers by the name their system prompts start with.
caller = Agent(
    name="caller",
    model="anthropic/claude-sonnet-4-6",
    system="caller: You hand support cases to a colleague.",
    calls=["callee"],
)
callee = Agent(
    name="callee",
    model="anthropic/claude-sonnet-4-6",
    system="callee: You open tickets.",
    description="Opens a ticket for a case and says so.",
    accepts=["caller"],
    tools=[open_ticket],
)

# The sandbox cells' agents: their commands need no approval (plain commands, no shell control
# syntax), and their containers never idle-stop within a cell.
_STEPS = ("python3 step.py *", "ps -eo args", "ls /run/toren")
sandboxed = Agent(
    name="sandboxed",
    model="anthropic/claude-sonnet-4-6",
    system="sandbox: You run scripts in your workspace.",
    sandbox=Sandbox(allow=_STEPS, command_timeout="60s", memory="256MiB", idle_stop="1h"),
)
rerunnable = Agent(
    name="rerunnable",
    model="anthropic/claude-sonnet-4-6",
    system="sandbox: You run scripts in your workspace.",
    sandbox=Sandbox(
        allow=_STEPS, command_timeout="60s", memory="256MiB", idle_stop="1h", rerunnable=True
    ),
)

# The Telegram cells' agents: each answers a chat through its own bot, one delivering at least
# once, the other at most once. A worker runs a bot only with its token, which the harness gives
# the workers of a Telegram cell alone (each cell its own token and Bot API server); the others
# log that the bots are not run there.
TELEGRAM_TOKEN_ENV = {
    "at_least_once": "CHAOS_TELEGRAM_TOKEN",
    "at_most_once": "CHAOS_TELEGRAM_ONCE_TOKEN",
}
chatty = Agent(
    name="chatty",
    model="anthropic/claude-sonnet-4-6",
    system="telegram: You answer people in a chat.",
    telegram=Telegram(
        bot="chaos_chatty",
        token_env=TELEGRAM_TOKEN_ENV["at_least_once"],
        delivery="at_least_once",
        poll_timeout=1,
        chat_interval=0,
    ),
)
chatty_once = Agent(
    name="chatty_once",
    model="anthropic/claude-sonnet-4-6",
    system="telegram: You answer people in a chat.",
    telegram=Telegram(
        bot="chaos_chatty_once",
        token_env=TELEGRAM_TOKEN_ENV["at_most_once"],
        delivery="at_most_once",
        poll_timeout=1,
        chat_interval=0,
    ),
)

# The schedule cells' agent: a slot every second, each starting a run whatever is in flight
# (allow_all), so every slot of a cell's window must have started exactly one run. Declared
# only by the workers of a schedule cell (``CHAOS_SCHEDULES``): a worker of another cell runs
# the agent without it, so no slot fires there.
SCHEDULE = "tick"
TICK = Schedule(name=SCHEDULE, every=1, input="tick {slot_utc}", overlap="allow_all")
ticker = Agent(
    name="ticker",
    model="anthropic/claude-sonnet-4-6",
    system="schedule: You note each tick of a clock.",
    schedules=[TICK] if os.environ.get("CHAOS_SCHEDULES") else [],
)

# The version cells' agent: the chaos agent's ticket and refund (its run parks on the refund's
# approval), without the timer. A worker started with ``CHAOS_VERSION`` serves another version
# of it (another system prompt); under ``next_turn`` a run moved to it takes its calls by value.
VERSION_ENV = "CHAOS_VERSION"


def versioned_system(deploy: str) -> str:
    """The ``versioned`` agent's system prompt on workers whose ``CHAOS_VERSION`` is ``deploy``."""
    return "versioned: You resolve support cases." + (f" (deploy {deploy})" if deploy else "")


versioned = Agent(
    name="versioned",
    model="anthropic/claude-sonnet-4-6",
    system=versioned_system(os.environ.get(VERSION_ENV, "")),
    tools=[open_ticket, refund],
    version_policy="next_turn",
)

_mutation = os.environ.get("CHAOS_MUTATION")
if _mutation:
    from chaos.mutations import load

    load(_mutation)
