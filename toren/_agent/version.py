"""An agent's version: a digest of what the model sees and what a run does with what it says.

Runs are pinned to this digest (not to a deploy's label): two workers whose code and settings
give an agent the same version serve the same runs, whatever they are called. It covers:

- what the request digest covers: the model, the system prompt, ``max_tokens``, each tool's
  name, description and input schema;
- each tool's declarations: effects, idempotency, approval (``"never"``, ``"always"`` or
  ``"predicate:<module>.<qualname>"``: a predicate is named, never called) and timeout;
- ``calls``, ``accepts``, ``description``, ``max_call_depth``;
- the sandbox: every field of its settings that decides the container or what its commands may
  do (image, limits, network, allow rules, ``rerunnable``; not ``idle_stop``, which only says
  when an idle container is stopped);
- compaction (``context_window``, ``compact_soft``, ``compact_hard``) and the caps on what is
  recorded (``max_tool_result_bytes``, ``max_response_bytes``).

Not in it: budgets and limits (``budget_usd``, ``wall_clock``, ``max_attempts``, ``max_runs``,
``max_runs_per_key``), the Telegram bot, schedules, the version policy, retention, log levels
and Toren's own version: changing them changes no run's requests. The digest is sha256 over
canonical JSON (sorted keys, no whitespace), so it is the same in every process: nothing in it
comes from ``id()`` or ``hash()``.
"""

from __future__ import annotations

import hashlib
from typing import Any

import attrs

from toren._agent.agents import Agent, Tool
from toren._core.json_text import dumps

VERSION_LENGTH = 12
"""Hex characters of an agent version."""

_SANDBOX_NOT_IN_VERSION = ("idle_stop",)


def approval_name(tool: Tool) -> str:
    """A tool's approval rule as a version records it: ``"never"``, ``"always"`` or
    ``"predicate:<module>.<qualname>"``."""
    rule = tool.approval
    if isinstance(rule, str):
        return rule
    module = getattr(rule, "__module__", None) or ""
    name = getattr(rule, "__qualname__", None) or type(rule).__qualname__
    return f"predicate:{module}.{name}"


def _tool(tool: Tool) -> dict[str, Any]:
    return {
        "name": tool.name,
        "description": tool.description,
        "input_schema": tool.input_schema,
        "effects": tool.effects,
        "idempotency": tool.idempotency,
        "approval": approval_name(tool),
        "timeout": tool.timeout,
    }


def _sandbox(agent: Agent) -> dict[str, Any] | None:
    if agent.sandbox is None:
        return None
    fields = attrs.asdict(agent.sandbox, recurse=False)
    for name in _SANDBOX_NOT_IN_VERSION:
        fields.pop(name, None)
    return {k: list(v) if isinstance(v, tuple) else v for k, v in fields.items()}


def version_document(agent: Agent) -> dict[str, Any]:
    """What :func:`agent_version` digests, as a JSON value (for tests and for showing)."""
    return {
        "model": agent.model,
        "system": agent.system,
        "max_tokens": agent.max_tokens,
        "tools": [_tool(t) for t in agent.all_tools],
        "calls": list(agent.calls),
        "accepts": list(agent.accepts),
        "description": agent.description,
        "max_call_depth": agent.max_call_depth,
        "sandbox": _sandbox(agent),
        "context_window": agent.context_window,
        "compact_soft": agent.compact_soft,
        "compact_hard": agent.compact_hard,
        "max_tool_result_bytes": agent.max_tool_result_bytes,
        "max_response_bytes": agent.max_response_bytes,
    }


def agent_version(agent: Agent) -> str:
    """The agent's version: 12 lowercase hex characters of the sha256 of
    :func:`version_document` as canonical JSON."""
    text = dumps(version_document(agent), sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:VERSION_LENGTH]
