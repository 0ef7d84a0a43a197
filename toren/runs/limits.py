"""Runs under concurrency limits: at most ``max_runs`` runs of an agent, and at most
``max_runs_per_key`` runs of one ``concurrency_key``, in flight across every worker.

A run in flight is one that works (status ``running``); a run parked on a human, a timer or a
child run, or ended, holds no slot. A run over a limit has the status ``queued``: it waits, in
order of arrival, and is started by the step that frees a slot (see :mod:`toren._core.limits`).

Limits are named so that an agent's and a key's never collide (agent names hold no ``/``):
``agent/<agent>`` and ``key/<agent>/<key>``; ``keys/<agent>`` holds the per-key cap a new key's
limit is created with. A run takes its key's permit before its agent's.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Literal

import attrs

from toren._core.json_text import utf8_size
from toren._core.limits import (
    Wait,
    impose,
    impose_limit,
    set_caps,
    set_family_cap,
    usage,
    waits,
)
from toren._core.rows import actor_row
from toren.runs.events import RUN_KIND

if TYPE_CHECKING:
    import asyncpg

    from toren._agent.agents import Agent
    from toren._core.client import Client, Connection

KEY_CAP = 200
"""Bytes (UTF-8) a concurrency key may hold."""

QUEUED: Literal["queued"] = "queued"
"""The status a run over a limit shows (never recorded: it comes from the limit's queue)."""

Shown = Literal["queued", "running", "parked", "completed", "failed", "cancelled"]
"""What surfaces show as a run's status: its recorded one (``toren.runs.STATUSES``), or
``queued`` while a run that has not ended waits for a slot of a concurrency limit."""


def agent_limit(agent: str) -> str:
    """The name of ``agent``'s cap on runs in flight."""
    return f"agent/{agent}"


def key_limit(agent: str, key: str) -> str:
    """The name of the cap on ``agent``'s runs in flight under concurrency key ``key``."""
    return f"key/{agent}/{key}"


def keys_template(agent: str) -> str:
    """The name under which ``agent``'s per-key cap is kept for keys not seen yet."""
    return f"keys/{agent}"


def key_problem(key: object) -> str | None:
    """What is wrong with ``key`` as a concurrency key, or ``None``: 1 to 200 bytes of text,
    no NUL, no lone surrogate."""
    if not isinstance(key, str) or not key:
        return "a non-empty text"
    if "\x00" in key:
        return "no NUL characters"
    try:
        key.encode("utf-8")
    except UnicodeEncodeError:
        return "valid Unicode (no lone surrogates)"
    if utf8_size(key) > KEY_CAP:
        return f"at most {KEY_CAP} bytes in UTF-8"
    return None


async def impose_run(conn: Connection, run_id: str, agent: str, key: str | None) -> bool:
    """Put a new run under its key's limit (created at the agent's per-key cap, 1 if no worker
    stored one yet) and its agent's (if a worker stored one), in ``conn``'s transaction, key
    first: it holds its permits, or has its place in line. Returns whether it holds them."""
    limits: list[tuple[str, int | None]] = []
    if key is not None:
        found = await usage(conn, [keys_template(agent)])
        limits.append((key_limit(agent, key), found[0].cap if found else 1))
    limits.append((agent_limit(agent), None))
    return await impose(conn, run_id, limits)


async def ensure_key_limit(conn: Connection, agent: str, key: str) -> None:
    """Create the limit of ``agent``'s runs under ``key`` at the agent's per-key cap (1 if no
    worker stored one yet), if there is none: for runs spawned in a step (a schedule's), whose
    key's limit must exist before their claim (one that does not is no cap)."""
    name = key_limit(agent, key)
    if await usage(conn, [name]):
        return
    found = await usage(conn, [keys_template(agent)])
    await impose_limit(conn, name, found[0].cap if found else 1)


def child_limits(agent: Agent | None, name: str) -> tuple[str, ...]:
    """The limits of a child run of agent ``name`` (called by another run; ``agent`` is its
    definition if this worker has it): its agent's cap. An agent defined elsewhere is listed
    all the same (a limit no worker set is no cap); one defined here without a cap is not."""
    return () if agent is not None and agent.max_runs is None else (agent_limit(name),)


async def set_agent_caps(pool: asyncpg.Pool, agents: Iterable[Agent]) -> None:
    """Store the caps of ``agents`` (a worker at boot): ``max_runs`` as the agent's limit, its
    per-key cap for new keys and for the keys it has. An agent without ``max_runs`` has no
    agent limit; one that had one keeps it until a worker sets another (workers of two
    versions must not undo each other's)."""
    caps: dict[str, int] = {}
    for agent in agents:
        caps[keys_template(agent.name)] = agent.max_runs_per_key
        if agent.max_runs is not None:
            caps[agent_limit(agent.name)] = agent.max_runs
    await set_caps(pool, caps)
    for agent in agents:
        await set_family_cap(pool, f"key/{agent.name}/", agent.max_runs_per_key)


async def queued(client: Client, run_ids: Iterable[str]) -> dict[str, Wait]:
    """Which of ``run_ids`` wait on a limit, on which and where in its queue."""
    return await waits(client.pool, run_ids)


@attrs.frozen(kw_only=True)
class Concurrency:
    """A run's concurrency key (``None``: none) and, if it waits for a slot, on what."""

    key: str | None
    wait: Wait | None


async def concurrency(client: Client, run_id: str) -> Concurrency:
    """Run ``run_id``'s concurrency key and wait (none for a run that does not exist)."""
    found = await actor_row(client.pool, run_id, kind=RUN_KIND, fields=("args.concurrency_key",))
    key = found.args_dict.get("concurrency_key") if found is not None else None
    wait = (await waits(client.pool, [run_id])).get(run_id)
    return Concurrency(key=key if isinstance(key, str) else None, wait=wait)


def reason(wait: Wait) -> str:
    """A wait as one line: ``waiting for key/bot/chat-1 (cap 1): position 2 in its queue``."""
    cap = f" (cap {wait.cap})" if wait.cap is not None else ""
    return f"waiting for {wait.limit}{cap}: position {wait.position} in its queue"
