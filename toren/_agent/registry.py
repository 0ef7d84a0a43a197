"""The agents an app registers and the routes a worker running them serves (:class:`Agents`),
and the process's own (:data:`PROCESS_AGENTS`) with the functions that use it.

Registering merges each agent with its ``[agents.NAME]`` table (:mod:`toren._agent.tables`),
which reads ``Agent``'s fields: so this module sits above both.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from toren._agent.agents import Agent, VersionPolicy
from toren._agent.routes import agent_route, version_route
from toren._agent.tables import configured
from toren._agent.version import agent_version
from toren._core.errors import ConfigError

if TYPE_CHECKING:
    from toren._core.actor import Context


class Agents:
    """An app's agents, as its code declared them and as registered (with their settings
    applied), and the routes a worker running them serves (one per agent, and the routes of
    what it can run: ``sandbox``, ``telegram/<bot>``).

    A worker is given one (:class:`~toren.supervisors.worker.Worker`'s ``agents``) and lends
    it to its actors (``ctx.resources``; :func:`agents_of`): two workers in one process may
    run different apps, with agents of the same name. The process's own
    (:data:`PROCESS_AGENTS`) serves the single-app case.
    """

    def __init__(self) -> None:
        self._declared: dict[str, Agent] = {}  # each registered agent as its code declared it
        self._registry: dict[str, Agent] = {}
        self._versions: dict[str, tuple[Agent, str]] = {}  # a registered agent's version
        self._capabilities: set[str] = set()
        self.default_version_policy: VersionPolicy = "pin"
        """The policy of an agent that names none (the worker sets its settings')."""

    def register(
        self,
        agents: Iterable[Agent],
        settings: Mapping[str, Mapping[str, Any]] | None = None,
        *,
        source: str = "the settings file",
    ) -> list[Agent]:
        """Make agents known (the worker runs them by name), each with the keys of its
        ``[agents.NAME]`` table in ``settings`` replacing the values given in code.
        Registering the same declared agent again replaces its settings.

        Returns:
            The agents as registered (merged with their settings).

        Raises:
            ConfigError: another agent of the same name is registered already, or an agent
                merged with its table (read from ``source``) is invalid; then none is
                registered.
        """
        merged = []
        for agent in agents:
            known = self._declared.get(agent.name)
            if known is not None and known is not agent:
                raise ConfigError(f"two agents are named {agent.name!r}")
            merged.append((agent, configured(agent, (settings or {}).get(agent.name), source)))
        for agent, registered in merged:
            self._declared[agent.name] = agent
            self._registry[agent.name] = registered
        return [registered for _, registered in merged]

    def serve_route(self, route: str, *, serve: bool = True) -> None:
        """Serve (or stop serving) a route that is not an agent's: ``sandbox`` when the
        worker has Docker."""
        if serve:
            self._capabilities.add(route)
        else:
            self._capabilities.discard(route)

    def served_routes(self) -> list[str]:
        """The routes served: two per registered agent (``agent:NAME``, which unpinned runs
        are claimed on, and ``agent:NAME@VERSION``, which runs pinned to its version are),
        then the capabilities."""
        agents = [
            route
            for name in sorted(self._registry)
            for route in (agent_route(name), version_route(name, self._version(name)))
        ]
        return agents + sorted(self._capabilities)

    def version(self, name: str) -> str | None:
        """The version of the registered agent called ``name``
        (:func:`toren.runs.agent_version`)."""
        return self._version(name) if name in self._registry else None

    def _version(self, name: str) -> str:
        agent = self._registry[name]
        known = self._versions.get(name)
        if known is None or known[0] is not agent:  # digested once per registration
            known = self._versions[name] = (agent, agent_version(agent))
        return known[1]

    def version_policy(self, agent: Agent) -> VersionPolicy:
        """``agent``'s version policy: its own, else this worker's default."""
        return agent.version_policy or self.default_version_policy

    def registered(self) -> list[Agent]:
        """Every agent registered, by name."""
        return [self._registry[name] for name in sorted(self._registry)]

    def named(self, name: str) -> Agent | None:
        """The registered agent called ``name``, if any."""
        return self._registry.get(name)


PROCESS_AGENTS = Agents()
"""The process's agents: what :func:`register_agents` and ``load_app`` fill unless given
another :class:`Agents`, and what a worker runs unless given its own."""


def agents_of(ctx: Context[Any]) -> Agents:
    """The agents of the worker hosting ``ctx``'s actor (the process's outside a worker)."""
    return ctx.resources.find(Agents) or PROCESS_AGENTS


def register_agents(
    agents: Iterable[Agent],
    settings: Mapping[str, Mapping[str, Any]] | None = None,
    *,
    source: str = "the settings file",
    into: Agents | None = None,
) -> list[Agent]:
    """Register agents into ``into`` (the process's agents by default): see
    :meth:`Agents.register`."""
    return (into or PROCESS_AGENTS).register(agents, settings, source=source)


def serve_route(route: str, *, serve: bool = True) -> None:
    """Serve (or stop serving) a route of the process's agents (:meth:`Agents.serve_route`)."""
    PROCESS_AGENTS.serve_route(route, serve=serve)


def served_routes() -> list[str]:
    """The routes the process's agents serve (:meth:`Agents.served_routes`)."""
    return PROCESS_AGENTS.served_routes()


def registered_agents() -> list[Agent]:
    """Every agent registered in the process's agents, by name."""
    return PROCESS_AGENTS.registered()


def agent_named(name: str) -> Agent | None:
    """The agent called ``name`` in the process's agents, if registered."""
    return PROCESS_AGENTS.named(name)
