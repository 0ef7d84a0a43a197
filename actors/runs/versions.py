"""A run and its agent's version (:func:`toren.runs.agent_version`).

A run records the version it starts on (``run.started``'s ``version``) and, unless its agent's
policy is ``upgrade``, is pinned to it in the same step: its row is re-routed to
``agent:NAME@VERSION``, which only workers whose agent has that version serve. So in a rolling
deploy a run started on the old code finishes on the old workers, and one started on the new
code on the new ones; nothing is checked or paid again.

A run started on a worker while a newer version runs elsewhere (the newest: what the most
recently started live worker running its agent publishes) is handed to that version before it
records anything, so new runs start on the new code.

A worker that handles a run recorded on another version (a run started before versions, one
under ``upgrade``, one moved by ``toren jobs upgrade`` or by ``next_turn``) records
``run.upgraded`` and pins the run to its own version (``upgrade``: unpins it). How the history
is taken: ``next_turn`` by value (the calls so far are settled: never checked or paid again);
the others by replay (checked against this code's requests, invalidated forward from the first
that differs).

Under ``next_turn`` a run keeps its version for the turn in progress; at the step where it
waits for a human or a timer, or takes a human's message or a timer after one, it looks up the
newest version (what the most recently started live worker running its agent publishes: one
read, outside any transaction) and, if that is another, is re-routed to it and handed over.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from toren import Context, Principal
from toren.directory import directory_of
from toren.runs import (
    MessageReceived,
    RunCompleted,
    RunState,
    RunUpgraded,
    StartRun,
    TimerFired,
    TimerSet,
    Upgrade,
    UpgradeHow,
    agent_route,
    agents_of,
    version_route,
)


def started(ctx: Context[RunState], agent: str) -> str:
    """The version a run of ``agent`` starting here records (``""``: the agent is unknown)."""
    return agents_of(ctx).version(agent) or ""


async def handed_over(ctx: Context[RunState], msg: StartRun) -> bool:
    """At a run's start: a run whose agent's policy pins it, started here while a newer
    version runs elsewhere, is handed to that version (its start message goes with it), so
    that in a rolling deploy new runs start on the new code. Whether it was."""
    agents = agents_of(ctx)
    agent = agents.named(msg.agent)
    mine = agents.version(msg.agent)
    if agent is None or mine is None or agents.version_policy(agent) == "upgrade":
        return False
    newest = await directory_of(ctx).newest_version(msg.agent)
    if newest is None or newest == mine:
        return False
    ctx.send(ctx.actor_id, msg)
    ctx.reroute(version_route(msg.agent, newest), leave=True)
    return True


def pin(ctx: Context[RunState]) -> None:
    """Pin the run to the version it recorded, unless its agent's policy is ``upgrade``."""
    state = ctx.state
    agents = agents_of(ctx)
    agent = agents.named(state.agent)
    if agent is not None and state.version and agents.version_policy(agent) != "upgrade":
        ctx.reroute(version_route(state.agent, state.version))


def asked_by(args: Mapping[str, Any], version: str) -> Principal | None:
    """Who asked (``toren jobs upgrade``) to move the run to ``version``, as its row says."""
    asked = args.get("upgrade")
    if not isinstance(asked, Mapping) or asked.get("to_version") != version:
        return None
    try:
        return Principal(**asked["by"])
    except (KeyError, TypeError, ValueError):  # not one: the move is recorded without it
        return None


def check(ctx: Context[RunState], msg: Any, args: Mapping[str, Any]) -> bool:
    """Before a message is handled: a run recorded on another version than this worker's
    moves to it (``run.upgraded``, with who asked for it: the :class:`~toren.runs.Upgrade`
    in hand, or the request ``upgrade_run`` left in the run's ``args``, when mail queued
    before that message moves it); an Upgrade to a version this worker does not serve is
    handed to one that does.

    Returns:
        Whether the message was handed over (then nothing else is done with it here).
    """
    state = ctx.state
    if not state.agent or state.status == "cancelled":
        return False
    agents = agents_of(ctx)
    agent = agents.named(state.agent)
    mine = agents.version(state.agent)
    if agent is None or mine is None:
        return False
    if isinstance(msg, Upgrade) and msg.to_version != mine:
        # Re-routed by toren jobs upgrade while this worker held it: the message goes with it.
        ctx.send(ctx.actor_id, msg, system=True)
        ctx.reroute(version_route(state.agent, msg.to_version), leave=True)
        return True
    if state.version == mine:
        return False
    policy = agents.version_policy(agent)
    how: UpgradeHow = "value" if policy == "next_turn" and state.version else "replay"
    ctx.emit(
        RunUpgraded(
            from_version=state.version,
            to_version=mine,
            how=how,
            by=msg.by if isinstance(msg, Upgrade) else asked_by(args, mine),
            at=time.time(),
        )
    )
    if policy == "upgrade":
        ctx.reroute(agent_route(state.agent))
    else:
        ctx.reroute(version_route(state.agent, mine))
    return False


_BOUNDARIES = (RunCompleted, TimerSet, TimerFired)


async def at_boundary(ctx: Context[RunState], was: str) -> None:
    """After a step under ``next_turn``: if the run waits for a human or a timer now, or this
    step took a human's message after a turn or a timer (``was``: its status before), and
    another version is the newest, re-route it there (handed over, unless this worker serves
    that version too). The newest version is read only at such steps."""
    state = ctx.state
    if ctx.route is not None or state.status in ("failed", "cancelled") or not state.version:
        return
    agents = agents_of(ctx)
    agent = agents.named(state.agent)
    if agent is None or agents.version_policy(agent) != "next_turn":
        return
    recorded = [e[3] for e in ctx.events]
    took = was == "completed" and any(isinstance(e, MessageReceived) for e in recorded)
    if not (took or any(isinstance(e, _BOUNDARIES) for e in recorded)):
        return
    newest = await directory_of(ctx).newest_version(state.agent)
    if newest is not None and newest != state.version:
        leave = newest != agents.version(state.agent)
        ctx.reroute(version_route(state.agent, newest), leave=leave)
