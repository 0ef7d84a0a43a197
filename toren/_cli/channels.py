"""``toren channels list | pair | unpair | observe | messages``: Telegram channels from the
command line.

``list`` and ``messages`` read the channel actors' rows and journals (no worker needed).
``pair``, ``unpair`` and ``observe`` are asked of the bot's channel actor, which decides them in
its own journal: a worker that runs the bot (it holds the bot's token) must be live. Each
command names the agent whose bot it is about; the CLI is recorded as the operating-system user
who ran it. Exit codes: 0 done; 1 the agent has no channel, no worker answered in time, or the
channel refused (too many pending codes, a chat that is not paired...), or another Toren error
at run time; 2 usage or configuration.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from datetime import datetime
from typing import TYPE_CHECKING, Any

import click
from rich.table import Table
from rich.text import Text

from toren._cli.common import database_url, out, run_async
from toren._cli.run_ids import resolve
from toren._cli.runs import who
from toren._core.terminal import plain, printable

if TYPE_CHECKING:
    from toren._core.client import Client
    from toren._settings import Settings

TEXT_WIDTH = 80
"""Characters of a message's text ``toren channels messages`` prints (``--json``: 300)."""
# Telegram chat ids of groups are negative: `unpair support -1001234` must not read as options.
_NUMBERS_OK = {"ignore_unknown_options": True}


def ago(seconds: float) -> str:
    """A duration for people: ``12s``, ``5m``, ``3h``, ``2d``."""
    seconds = max(0.0, seconds)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{int(seconds // size)}{unit}"
    return f"{int(seconds)}s"


def within(seconds: float) -> str:
    """How long until something: ``in 10 minutes``, ``in 45 seconds``, ``already``."""
    if seconds <= 0:
        return "already"
    if seconds < 90:
        return f"in {round(seconds)} seconds"
    return f"in {round(seconds / 60)} minutes"


def one_line(text: str, width: int = TEXT_WIDTH) -> str:
    """The first ``width`` characters of untrusted ``text`` on one line, inert on a terminal
    (:func:`~toren._core.terminal.printable`; newlines written ``\\n``)."""
    cut = text[:width]
    shown = printable(cut).replace("\n", "\\n").replace("\t", " ")
    return shown + ("..." if len(text) > width else "")


def register(main: click.Group) -> None:
    """Add ``channels`` to the ``toren`` command group."""

    @main.group()
    def channels() -> None:
        """Telegram channels: pairing, chats, observers, deliveries."""

    @channels.command("list")
    @click.option("--json", "as_json", is_flag=True, help="Print JSON instead of tables.")
    @click.pass_context
    @run_async
    async def list_cmd(ctx: click.Context, as_json: bool) -> None:
        """Every channel and its paired chats. Each channel with its bot, agent, @username,
        status, paired chats and messages pending, sent and failed; one that Telegram does not
        answer is shown failing, with since when and why."""
        from toren.channels import client as api

        async with await _client(ctx) as client:
            rows = await api.channels(client)
        if as_json:
            click.echo(json.dumps(rows, indent=2, ensure_ascii=True))
            return
        if not rows:
            out.print(
                plain(
                    "no channels: give an agent [agents.NAME.telegram] (bot, token_env) and "
                    "start a worker that has its token"
                )
            )
            return
        table = Table(title=f"{len(rows)} channel(s)")
        for col in ("bot", "agent", "username", "status"):
            table.add_column(col)
        for col in ("chats", "pending", "sent", "failed"):
            table.add_column(col, justify="right")
        for row in rows:
            table.add_row(
                plain(str(row["bot"])),
                plain(str(row.get("agent") or "")),
                plain(f"@{row['username']}" if row.get("username") else "-"),
                _status(row),
                str(len(row.get("chats") or [])),
                str(row.get("pending", 0)),
                str(row.get("sent", 0)),
                str(row.get("failed", 0)),
            )
        out.print(table)
        for row in rows:
            failing = _failing(row)
            if failing:
                out.print(plain(failing, style="red"))
        for row in rows:
            if row.get("chats"):
                out.print(_chats(row))

    @channels.command("pair")
    @click.argument("agent")
    @click.pass_context
    @run_async
    async def pair_cmd(ctx: click.Context, agent: str) -> None:
        """Print a code that pairs a Telegram chat with AGENT's bot. Single-use: send `/pair
        CODE` to the bot from that chat before it expires."""
        from toren.channels import client as api

        async with await _client(ctx) as client:
            code, expires = await api.pair(client, agent, by=who(), telegram=_table(ctx, agent))
            username = await _username(client, agent)
        local = datetime.fromtimestamp(expires).astimezone()
        bot = f" (@{username})" if username else ""
        out.print(plain(f"pairing code for agent {agent}{bot}: {code}"))
        out.print(
            plain(
                f"single use; expires at {local:%Y-%m-%d %H:%M:%S %Z} "
                f"({within(expires - time.time())})"
            )
        )
        out.print(plain("send this line to the bot from the chat to pair:"))
        out.print(plain(f"/pair {code}"))
        if username:
            out.print(plain(f"(in a group, address the bot: /pair@{username} {code})"))

    @channels.command("unpair", context_settings=_NUMBERS_OK)
    @click.argument("agent")
    @click.argument("chat_id", type=int)
    @click.pass_context
    @run_async
    async def unpair_cmd(ctx: click.Context, agent: str, chat_id: int) -> None:
        """Unpair chat CHAT_ID from AGENT's bot. It no longer reaches the agent (the chat is
        told; its conversation run is left as it is)."""
        from toren.channels import client as api

        async with await _client(ctx) as client:
            detail = await api.unpair(client, agent, chat_id, by=who())
        out.print(plain(detail))

    @channels.command("observe", context_settings=_NUMBERS_OK)
    @click.argument("agent")
    @click.argument("chat_id", type=int)
    @click.option(
        "--run",
        "run_id",
        metavar="RUN",
        help="The run to observe (run/<uuid>, the uuid, or a unique prefix of it).",
    )
    @click.option(
        "--agent", "observed", metavar="OBSERVED", help="Observe every new run of this agent."
    )
    @click.option("--stop", is_flag=True, help="Stop observing it.")
    @click.pass_context
    @run_async
    async def observe_cmd(
        ctx: click.Context,
        agent: str,
        chat_id: int,
        run_id: str | None,
        observed: str | None,
        stop: bool,
    ) -> None:
        """Make chat CHAT_ID observe a run or an agent's new runs. The chat, paired with
        AGENT's bot, receives what a run does (--run RUN) or what every new run of an agent
        does (--agent OBSERVED), read-only: tool calls, what waits for approval, how it ends.
        AGENT names whose bot sends; OBSERVED may be another agent. --stop ends it."""
        if (run_id is None) == (observed is None):
            raise click.UsageError("give exactly one of --run RUN and --agent AGENT")
        from toren.channels import client as api

        async with await _client(ctx) as client:
            detail = await api.observe(
                client,
                agent,
                chat_id,
                run=await resolve(client, run_id) if run_id else "",
                observed_agent=observed or "",
                stop=stop,
                by=who(),
            )
        out.print(plain(detail))

    @channels.command("messages")
    @click.argument("agent")
    @click.option("--chat", "chat_id", type=int, help="Only the messages to this chat.")
    @click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
    @click.pass_context
    @run_async
    async def messages_cmd(
        ctx: click.Context, agent: str, chat_id: int | None, as_json: bool
    ) -> None:
        """AGENT's bot's outbound messages and their delivery state. Oldest first; a state is
        queued, sending, sent, lost (at-most-once: the worker stopped during its send), blocked (the
        user blocked the bot), refused (Telegram refused it). Pending ones and the last 200
        delivered or failed."""
        from toren.channels import client as api

        async with await _client(ctx) as client:
            found = await api.messages(client, agent, chat_id)
        if as_json:
            click.echo(json.dumps(found, indent=2, ensure_ascii=True))
            return
        which = f" to chat {chat_id}" if chat_id is not None else ""
        table = Table(title=plain(f"{len(found)} outbound message(s) of {agent}'s bot{which}"))
        for col in ("n", "chat"):
            table.add_column(col, justify="right")
        for col in ("kind", "state", "age", "text"):
            table.add_column(col)
        for m in found:
            table.add_row(
                str(m["n"]),
                str(m["chat_id"]),
                plain(str(m["kind"])),
                plain(str(m["state"]), style=_STYLES.get(str(m["state"]), "")),
                ago(float(m["age"])),
                plain(one_line(str(m["text"]))),
            )
        out.print(table)


_STYLES = {"sent": "green", "lost": "red", "blocked": "red", "refused": "red"}


def _status(row: dict[str, Any]) -> Text:
    """The actor's status; ``failing`` (red) for a live channel that Telegram does not answer."""
    if row["status"] == "live" and isinstance(row.get("failing"), dict):
        return plain("failing", style="red")
    return plain(str(row["status"]))


def _failing(row: dict[str, Any]) -> str:
    """``BOT: failing since WHEN (AGO): WHY`` for a live channel Telegram does not answer."""
    failing = row.get("failing")
    if row["status"] != "live" or not isinstance(failing, dict):
        return ""
    since = float(failing.get("since") or 0)
    local = datetime.fromtimestamp(since).astimezone()
    return (
        f"{row['bot']}: failing since {local:%Y-%m-%d %H:%M:%S %Z} "
        f"({ago(time.time() - since)}): {one_line(str(failing.get('error') or ''), 500)}"
    )


async def _client(ctx: click.Context) -> Client:
    from toren._core.client import Client

    settings: Settings = ctx.find_root().obj["settings"]
    return await Client.connect(database_url(settings), pool_size=2)


def _table(ctx: click.Context, agent: str) -> Mapping[str, Any] | None:
    """The agent's ``[agents.NAME.telegram]`` table in the settings file, if it has one."""
    settings: Settings = ctx.find_root().obj["settings"]
    table = settings.agents.get(agent, {}).get("telegram")
    return table if isinstance(table, Mapping) else None


async def _username(client: Client, agent: str) -> str:
    from toren.channels import client as api

    for row in await api.channels(client):
        if row.get("agent") == agent:
            return str(row.get("username") or "")
    return ""


def _chats(row: dict[str, Any]) -> Table:
    table = Table(title=plain(f"chats paired with {row['bot']}"))
    table.add_column("chat", justify="right")
    for col in ("title", "type", "paired by", "blocked", "conversation run"):
        table.add_column(col)
    for chat in row["chats"]:
        by = str(chat.get("paired_by") or "")
        table.add_row(
            str(chat.get("chat_id")),
            plain(one_line(str(chat.get("title") or ""), 40)),
            plain(str(chat.get("type") or "")),
            plain(f"{by} ({chat.get('paired_by_id')})" if by else "-"),
            "yes" if chat.get("blocked") else "no",
            plain(str(chat.get("run") or "-")),
        )
    return table
