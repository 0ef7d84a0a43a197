"""The route a run of an agent is claimed on, in a module of its own: the readers of runs (the
CLI's listing) use it without importing what defines agents (pydantic among it)."""

from __future__ import annotations


def agent_route(name: str) -> str:
    """The route a run of agent ``name`` is claimed on: only workers that define it serve it."""
    return f"agent:{name}"
