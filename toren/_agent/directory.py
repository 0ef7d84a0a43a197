"""The agent directory: what each live worker says about the agents it runs.

Cross-agent calls are consented on both sides (the caller lists the callee in ``calls``, the
callee lists the caller in ``accepts``), and the callee may live in another worker's app. So
every worker publishes a card per agent it runs (its description and consent lists, after the
settings file's ``[agents.NAME]`` tables) with each lease renewal, and a call is checked, when
it is made, against the cards live workers publish.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import asyncpg
import attrs

from toren._agent.agents import Agent, agent_named, served_routes


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


def local_cards() -> dict[str, dict[str, Any]]:
    """The cards of the agents this process runs, as published with each renewal."""
    cards: dict[str, dict[str, Any]] = {}
    for route in served_routes():
        agent = agent_named(route.removeprefix("agent:"))
        if agent is not None:
            card = Card.of(agent)
            cards[card.name] = {
                "description": card.description,
                "calls": list(card.calls),
                "accepts": list(card.accepts),
            }
    return cards


_pool: asyncpg.Pool | None = None


def attach(pool: asyncpg.Pool) -> None:
    """Give the directory the worker's pool (done when the worker starts hosting actors)."""
    global _pool
    _pool = pool


async def published(name: str) -> list[Card]:
    """The cards live workers publish for agent ``name`` (this process's own included, also
    before its first renewal); empty if no live worker runs it."""
    from toren._core.workers import published_cards

    cards: list[Card] = []
    local = agent_named(name)
    if local is not None and f"agent:{name}" in served_routes():
        cards.append(Card.of(local))
    if _pool is not None:
        for data in await published_cards(_pool, name):
            card = Card.read(name, data) if isinstance(data, Mapping) else None
            if card is not None:
                cards.append(card)
    return cards


async def route_served(route: str) -> bool:
    """Whether this process or a live worker serves ``route`` (``sandbox``: it has Docker)."""
    from toren._core.workers import route_served as published_route

    if route in served_routes():
        return True
    return _pool is not None and await published_route(_pool, route)
