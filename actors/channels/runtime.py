"""What a worker's channel actors share: each bot's API client, the database, the settings.

At boot (:func:`open_channels`) the worker reads the token of every bot its agents name, serves
the route of each bot it can run (``telegram/<bot>``: channel actors are claimed only where their
token is), creates each bot's channel actor if it is new and wakes it. A bot whose token is
missing is logged and left to workers that have it.
"""

from __future__ import annotations

import logging
from typing import Any

import asyncpg
import attrs

from toren import Agent, Client, ConfigError, Context, Settings
from toren.actors.channels.telegram import BotApi
from toren.channels import (
    CHANNEL_KIND,
    DEFAULT_API_URL,
    PairingKey,
    Telegram,
    Tick,
    channel_address,
    channel_route,
    pairing_key,
)
from toren.kernel import set_args
from toren.runs import Agents
from toren.sandboxes.files import open_store
from toren.sandboxes.store import WorkspaceStore

log = logging.getLogger("toren.channel")


class Unavailable(Exception):
    """This worker does not run the bot (no token here, or no agent names it)."""


@attrs.define
class Bot:
    """A bot this worker runs: its agent, its settings, its API client, and the key its
    pairing codes are hashed with (the same for every bot of the fleet)."""

    agent: Agent
    settings: Telegram
    api: BotApi
    pairing: PairingKey


def api_url(settings: Settings) -> str:
    """The Bot API's address: Telegram's, or ``TOREN_TELEGRAM_API_URL`` (a local server)."""
    return settings.telegram_api_url or DEFAULT_API_URL


def configured_bots(agents: list[Agent]) -> dict[str, Agent]:
    """Each bot named by ``agents``, with its agent.

    Raises:
        ConfigError: two agents name the same bot (a bot talks for one agent).
    """
    bots: dict[str, Agent] = {}
    for agent in agents:
        if agent.telegram is None:
            continue
        other = bots.get(agent.telegram.bot)
        if other is not None:
            raise ConfigError(
                f"agents {other.name!r} and {agent.name!r} both use telegram bot "
                f"{agent.telegram.bot!r}",
                hint="A bot talks for one agent: create one bot per agent with @BotFather.",
            )
        bots[agent.telegram.bot] = agent
    return bots


class Channels:
    """One worker's channel runtime: the bots it runs, its pool, its settings, its file store.

    Opened at the worker's start (:func:`open_channels`), closed at its stop (:meth:`close`);
    channel actors find it in their worker's resources (``ctx.resources.get(Channels)``).
    """

    def __init__(self, settings: Settings, pool: asyncpg.Pool, agents: Agents) -> None:
        self.settings = settings
        self.pool = pool
        self.agents = agents
        self.bots: dict[str, Bot] = {}
        # Sends whose step stopped before sending (a lapsed lease, the database), on this
        # worker: a step handled again may send them, even at most once. Kept across
        # activations (a lapsed lease ends one); another worker does not know, and records
        # such a message lost.
        self.unsent: set[tuple[str, int]] = set()
        self._store: WorkspaceStore | None = None

    def bot(self, name: str) -> Bot:
        """The bot ``name`` as this worker runs it.

        Raises:
            Unavailable: this worker does not run it.
        """
        found = self.bots.get(name)
        if found is None:
            raise Unavailable(f"telegram bot {name!r} is not run by this worker")
        return found

    def store(self) -> WorkspaceStore:
        """The workspace store (files the agent sends are read from its checkpoints)."""
        if self._store is None:
            self._store = open_store(self.settings)
        return self._store

    async def close(self) -> None:
        """Stop serving the bots and close their clients and the store."""
        bots, self.bots = self.bots, {}
        for name, bot in bots.items():
            self.agents.serve_route(channel_route(name), serve=False)
            await bot.api.close()
        store, self._store = self._store, None
        if store is not None:
            await store.close()


async def open_channels(settings: Settings, pool: asyncpg.Pool, agents: Agents) -> Channels:
    """Open the bots of ``agents`` this worker can run (serving their routes) and wake their
    channel actors.

    Raises:
        ConfigError: two agents name the same bot, or ``TOREN_PAIRING_KEY`` is too short.
    """
    channels = Channels(settings, pool, agents)
    bots = configured_bots(agents.registered())
    if not bots:
        return channels
    key = await pairing_key(pool)
    for name, agent in bots.items():
        telegram = agent.telegram
        if telegram is None:
            continue
        try:
            token = telegram.token()
            if telegram.mode == "webhook":
                telegram.webhook_secret()
        except ConfigError as exc:
            log.error("telegram bot %r of agent %r not run here: %s", name, agent.name, exc)  # noqa: TRY400
            continue
        api = BotApi(token, api_url(settings))
        channels.bots[name] = Bot(agent=agent, settings=telegram, api=api, pairing=key)
        agents.serve_route(channel_route(name))
        client = Client(pool, "")
        address = channel_address(name)
        # What the surfaces need without the app: the agent, where the webhook's secret is.
        args = {"bot": name, "agent": agent.name, "webhook_secret_env": telegram.webhook_secret_env}
        if not await client.spawn(CHANNEL_KIND, address, args, route=channel_route(name)):
            await set_args(pool, address, args)
        await client.send(address, Tick(), system=True)
        log.info(
            "telegram bot %r runs agent %r here (%s, %s)",
            name,
            agent.name,
            telegram.mode,
            telegram.delivery.replace("_", "-"),
        )
    return channels


def of(ctx: Context[Any]) -> Channels:
    """The channel runtime of the worker hosting ``ctx``'s actor.

    Raises:
        Unavailable: that worker opened none (it is not a worker's actor).
    """
    found = ctx.resources.find(Channels)
    if found is None:
        raise Unavailable("channels are not open in this worker")
    return found
