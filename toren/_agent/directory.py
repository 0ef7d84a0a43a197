"""The agent directory: what each live worker says about the agents it runs.

Cross-agent calls are consented on both sides (the caller lists the callee in ``calls``, the
callee lists the caller in ``accepts``), and the callee may live in another worker's app. So
every worker publishes a card per agent it runs (its description and consent lists, after the
settings file's ``[agents.NAME]`` tables) with each lease renewal, and a call is checked, when
it is made, against the cards live workers publish.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import asyncpg
import attrs

from toren._agent.agents import Agent
from toren._agent.registry import Agents, agents_of
from toren._agent.routes import agent_route

if TYPE_CHECKING:
    from toren._core.actor import Context


@attrs.frozen(kw_only=True)
class Card:
    """One agent as a worker publishes it."""

    name: str
    description: str
    calls: tuple[str, ...]
    accepts: tuple[str, ...]

    @classmethod
    def of(cls, agent: Agent) -> Card:
        return cls(
            name=agent.name,
            description=agent.description,
            calls=tuple(agent.calls),
            accepts=tuple(agent.accepts),
        )

    @classmethod
    def read(cls, name: str, data: Mapping[str, Any]) -> Card | None:
        """A card as published (``None`` if it is not one: a worker of another version)."""
        try:
            return cls(
                name=name,
                description=str(data.get("description", "")),
                calls=tuple(str(n) for n in data.get("calls", ())),
                accepts=tuple(str(n) for n in data.get("accepts", ())),
            )
        except (AttributeError, TypeError):
            return None


def card_version(card: object) -> str | None:
    """The version a published card names (``None``: none, a worker of an earlier release)."""
    version = card.get("version") if isinstance(card, Mapping) else None
    return version if isinstance(version, str) and version else None


class Directory:
    """The agent directory as one worker sees it: its own agents, and the cards other live
    workers publish (read through its pool; without one, only its own).

    The worker makes one at its start and lends it to its actors (:func:`directory_of`).
    """

    NEWEST_SECONDS = 1.0
    """How long a worker keeps the newest version it read (cards change at renewals anyway)."""

    def __init__(self, agents: Agents, pool: asyncpg.Pool | None = None) -> None:
        self.agents = agents
        self.pool = pool
        self._newest: dict[str, tuple[float, str | None]] = {}  # by agent: (read at, version)

    def local_cards(self) -> dict[str, dict[str, Any]]:
        """The cards of the agents this worker runs, as published with each renewal: with
        each agent's version and version policy (what ``toren agents versions`` reads) and its
        retention policy."""
        cards: dict[str, dict[str, Any]] = {}
        served = set(self.agents.served_routes())
        for agent in self.agents.registered():
            if agent_route(agent.name) in served:
                card = Card.of(agent)
                cards[card.name] = {
                    "description": card.description,
                    "calls": list(card.calls),
                    "accepts": list(card.accepts),
                    "version": self.agents.version(agent.name),
                    "version_policy": self.agents.version_policy(agent),
                    # what `toren jobs prune --dry-run` computes with, without loading the app
                    "retention": agent.retention.to_json() if agent.retention else None,
                }
        return cards

    async def published(self, name: str) -> list[Card]:
        """The cards live workers publish for agent ``name`` (this worker's own included, also
        before its first renewal); empty if no live worker runs it."""
        from toren._core.workers import published_cards

        cards: list[Card] = []
        local = self.agents.named(name)
        if local is not None and agent_route(name) in self.agents.served_routes():
            cards.append(Card.of(local))
        if self.pool is not None:
            for data in await published_cards(self.pool, name):
                card = Card.read(name, data) if isinstance(data, Mapping) else None
                if card is not None:
                    cards.append(card)
        return cards

    async def newest_version(self, name: str) -> str | None:
        """The newest version of agent ``name``: of the versions live workers serve, the one
        first seen latest (``None``: none does; without a pool, this worker's own), as read at
        most :attr:`NEWEST_SECONDS` ago."""
        if self.pool is None:
            return self.agents.version(name)
        from toren._core.workers import newest_card

        now = time.monotonic()
        known = self._newest.get(name)
        if known is not None and now - known[0] < self.NEWEST_SECONDS:
            return known[1]
        # Read at a run's start and at a next_turn run's waits: kept a moment, so that a burst
        # of starts reads the registry (and pg_locks) once.
        version = card_version(await newest_card(self.pool, name))
        self._newest[name] = (now, version)
        return version

    async def route_served(self, route: str) -> bool:
        """Whether this worker or a live one serves ``route`` (``sandbox``: it has Docker)."""
        from toren._core.workers import route_served as published_route

        if route in self.agents.served_routes():
            return True
        return self.pool is not None and await published_route(self.pool, route)


def directory_of(ctx: Context[Any]) -> Directory:
    """The directory of the worker hosting ``ctx``'s actor (outside a worker: the process's
    agents alone)."""
    return ctx.resources.find(Directory) or Directory(agents_of(ctx))
