"""The route a run of an agent is claimed on, in a module of its own: the readers of runs (the
CLI's listing) use it without importing what defines agents (pydantic among it).

A run is spawned on its agent's route, ``agent:NAME``, which every worker running the agent
serves. A run pinned to a version (``Agent.version_policy``) is re-routed by the worker that
starts it to ``agent:NAME@VERSION``, which only workers whose agent has that version serve.
"""

from __future__ import annotations


def agent_route(name: str) -> str:
    """The route a run of agent ``name`` is claimed on: only workers that define it serve it."""
    return f"agent:{name}"


def version_route(name: str, version: str) -> str:
    """The route of a run of agent ``name`` pinned to ``version``: ``agent:NAME@VERSION``."""
    return f"agent:{name}@{version}"


def route_version(route: str) -> tuple[str, str | None]:
    """The agent and the version (``None``: not pinned) a run's route names (an agent's
    name holds no ``@``).

    Raises:
        ValueError: ``route`` is not an agent's route.
    """
    if not route.startswith("agent:"):
        raise ValueError(f"not an agent's route: {route!r}")
    name, at, version = route.removeprefix("agent:").partition("@")
    return name, version if at else None
