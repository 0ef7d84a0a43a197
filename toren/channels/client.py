"""Channels from outside: listing bots and chats, pairing codes, unpairing, observers, and each
outbound message's delivery state. What the CLI and the HTTP API call.

Reads come from the channel actors' rows and journals (no worker needed). Pairing, unpairing and
observing are asked of the channel actor, which decides them in its own journal: a worker that
runs the bot must be live.
"""

from __future__ import annotations

import os
import secrets
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from toren._agent.principal import Principal
from toren._core.errors import AskTimeout, ConfigError, TorenError
from toren._core.journal import replay
from toren._core.rows import actors_of_kind
from toren.channels._messages import (
    CHANNEL_KIND,
    Answer,
    IssueCode,
    Observe,
    Unpair,
    channel_route,
)
from toren.channels._settings import configured
from toren.channels._state import SNAPSHOT_VERSION, ChannelState, fold
from toren.channels.pairing import pairing_key

if TYPE_CHECKING:
    from toren._core.client import Client

CODE_ALPHABET = "ABCDEFGHJKMNPQRSTUVWXYZ23456789"  # no 0/O, 1/I/L: read aloud, typed on a phone
CODE_LENGTH = 10  # about 50 bits: with five tries per chat per ten minutes, not guessable
ASK_WAIT = 10.0


class ChannelError(TorenError):
    """A channel request that cannot be done (the message says why and what to do)."""


def new_code() -> str:
    """A fresh pairing code."""
    return "".join(secrets.choice(CODE_ALPHABET) for _ in range(CODE_LENGTH))


async def channels(client: Client) -> list[dict[str, Any]]:
    """Every channel: its bot, agent, chats and delivery counts (from its row)."""
    rows = await actors_of_kind(client.pool, CHANNEL_KIND, fields=("args", "summary"), order="id")
    found = []
    for row in rows:
        summary, args = row.summary_dict, row.args_dict
        found.append(
            {
                "channel": row.actor_id,
                "bot": args.get("bot", row.actor_id.rsplit("/", 1)[-1]),
                "agent": summary.get("agent") or args.get("agent", ""),
                "status": row.status,
                **{k: v for k, v in summary.items() if k not in ("agent", "bot")},
            }
        )
    return found


async def channel_of(
    client: Client, agent: str, *, telegram: Mapping[str, Any] | None = None
) -> str:
    """The channel actor of ``agent``'s bot.

    ``telegram`` is the agent's ``[agents.NAME.telegram]`` table as this process read it, if
    any: when no worker has run the bot, the error then says where its token is read from.

    Raises:
        ChannelError: no worker has run a bot for ``agent``.
    """
    from toren._core.workers import route_served

    found = [c for c in await channels(client) if c["agent"] == agent and c["status"] == "live"]
    if len(found) > 1:  # the agent's bot was renamed: the old channel's row stays
        served = [c for c in found if await route_served(client.pool, channel_route(c["bot"]))]
        found = served or found
    if len(found) == 1:
        return str(found[0]["channel"])
    if found:
        names = ", ".join(str(c["bot"]) for c in found)
        raise ChannelError(
            f"agent {agent!r} has several Telegram channels ({names}) and no live worker runs "
            "exactly one of them: start the worker that runs the bot you mean"
        )
    if telegram is not None:
        raise ChannelError(_no_token(agent, telegram))
    raise ChannelError(
        f"agent {agent!r} has no Telegram channel: give it [agents.{agent}.telegram] (bot, "
        "token_env) and start a worker that has the token (docs/channels.md)"
    )


def _no_token(agent: str, table: Mapping[str, Any], environ: Mapping[str, str] = os.environ) -> str:
    """Why agent ``agent``, whose settings give it a bot, has no channel yet: no worker has
    run the bot, which a worker does only with its token. Names where the token is read from
    and whether it is there for this process (a worker is usually started with the same
    environment); never shows a value."""
    where = f"[agents.{agent}.telegram]"
    try:
        settings = configured(None, {"bot": "unnamed", **table}, where)
    except ConfigError as exc:  # the worker refuses it too
        return f"agent {agent!r} has no Telegram channel: {exc}"
    bot = f" {settings.bot!r}" if "bot" in table else ""  # else named in code, not known here
    head = f"agent {agent!r} has no Telegram channel yet: no worker has run its bot{bot}"
    source = f"token_file {settings.token_file!r}" if settings.token_file else settings.token_env
    try:
        settings.token(environ)
    except ConfigError:
        missing = f"{source} is not set"
        if settings.token_file:
            missing = f"{source} cannot be read here, or holds no token"
        return (
            f"{head}, and its token is missing here: {missing}. Put the bot's token from "
            f"@BotFather in {source} where the worker runs, and restart the worker "
            "(docs/channels.md)"
        )
    return (
        f"{head}: a worker runs it only with the bot's token in {source} (set here). Start "
        "the worker with it; its log says why it does not run the bot (docs/channels.md)"
    )


async def _ask(client: Client, channel: str, msg: Any) -> Answer:
    try:
        answer = await client.ask(channel, msg, timeout=ASK_WAIT, system=True)
    except AskTimeout:
        raise ChannelError(
            f"{channel} did not answer in {ASK_WAIT:g} s: is a worker with the bot's token "
            "running? (`toren workers`)"
        ) from None
    if not isinstance(answer, Answer):
        raise ChannelError(f"{channel} answered {answer!r}")
    if not answer.ok:
        raise ChannelError(answer.detail)
    return answer


async def pair(
    client: Client, agent: str, *, by: Principal, telegram: Mapping[str, Any] | None = None
) -> tuple[str, float]:
    """A single-use pairing code for ``agent``'s bot, and when it expires (epoch seconds).

    The code is recorded as its keyed hash (:mod:`toren.channels.pairing`: this process's
    ``TOREN_PAIRING_KEY``, else the database's key), never as itself.

    ``telegram``: the agent's ``[agents.NAME.telegram]`` table, if this process read one
    (:func:`channel_of`).

    Raises:
        ChannelError: no channel (with ``telegram``: it names where the bot's token is read
            from), no worker answered, too many codes are pending, or the worker's pairing
            key is not this process's.
        ConfigError: ``TOREN_PAIRING_KEY`` is too short.
    """
    channel = await channel_of(client, agent, telegram=telegram)
    key = await pairing_key(client.pool)
    code = new_code()
    until = time.time() + ASK_WAIT
    issue = IssueCode(code_hash=key.digest(code), key_id=key.id, by=by, until=until)
    answer = await _ask(client, channel, issue)
    return code, float(answer.detail)


async def unpair(client: Client, agent: str, chat_id: int, *, by: Principal) -> str:
    """Unpair a chat: it no longer reaches the agent (its conversation run is left as is)."""
    channel = await channel_of(client, agent)
    return (await _ask(client, channel, Unpair(chat_id=chat_id, by=by))).detail


async def observe(
    client: Client,
    agent: str,
    chat_id: int,
    *,
    run: str = "",
    observed_agent: str = "",
    stop: bool = False,
    by: Principal,
) -> str:
    """Make a paired chat of ``agent``'s bot observe ``run`` or every new run of
    ``observed_agent``, read-only (or stop)."""
    if bool(run) == bool(observed_agent):
        raise ChannelError("observe either a run or an agent")
    channel = await channel_of(client, agent)
    msg = Observe(chat_id=chat_id, run=run, agent=observed_agent, stop=stop, by=by)
    return (await _ask(client, channel, msg)).detail


async def read_channel(client: Client, channel: str) -> ChannelState:
    """A channel's state, folded here from its journal (and snapshot)."""
    rebuilt = await replay(
        client.pool, channel, ChannelState(), fold, snapshots=(ChannelState, SNAPSHOT_VERSION)
    )
    state: ChannelState = rebuilt.state
    return state


async def messages(client: Client, agent: str, chat_id: int | None = None) -> list[dict[str, Any]]:
    """The channel's outbound messages still pending and the last ones delivered or failed,
    oldest first, with their delivery state."""
    state = await read_channel(client, await channel_of(client, agent))
    out = []
    for n, outgoing in state.in_order():
        if chat_id is not None and chat_id not in (outgoing.chat_id, outgoing.queued.chat_id):
            continue
        queued = outgoing.queued
        out.append(
            {
                "n": n,
                "chat_id": outgoing.chat_id,
                "kind": queued.kind,
                "state": outgoing.state,
                "text": queued.text[:300],
                "queued_at": queued.at,
                "at": outgoing.at,
                "age": round(time.time() - queued.at, 1),
                "message_ids": list(outgoing.message_ids),
                "source": queued.source,
            }
        )
    return out
