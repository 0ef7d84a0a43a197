"""How an agent is reached on Telegram: ``[agents.NAME.telegram]`` or ``Telegram(...)`` in code.

::

    [agents.support.telegram]
    bot = "support"                 # the channel's name: channel/telegram/support
    token_env = "SUPPORT_BOT_TOKEN" # where the worker reads the token (or token_file)
    approvers = [123456789]         # Telegram user ids who may approve or deny calls
    delivery = "at_least_once"      # or "at_most_once": what a crash between send and record does

The token is read by the worker from the environment variable or the file named here, when the
channel starts; it is never written to the journal, a log line or an error (URLs holding it are
redacted, :func:`redact`, as every log line is).
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import attrs

from toren._agent.agents import parse_duration
from toren._agent.parts import AgentPart
from toren._core.errors import ConfigError
from toren._core.logs import redact as redact

if TYPE_CHECKING:
    from toren._agent.agents import Agent, Tool

BOT_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
DEFAULT_API_URL = "https://api.telegram.org"
TEXT_LIMIT = 4096
"""Characters (UTF-16 code units) one Telegram message may hold; longer texts are split."""

Delivery = Literal["at_least_once", "at_most_once"]
Mode = Literal["polling", "webhook"]


# Errors about these settings never show a value that does not fit: the token itself is
# easily put where its variable's name, or the bot's name, belongs.
NOT_SHOWN = "(the value given is not shown: it may be a secret)"
_VARIABLE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _bot(inst: Any, attribute: attrs.Attribute[Any], value: str) -> None:
    if not isinstance(value, str) or not BOT_NAME.fullmatch(value):
        raise ConfigError(
            f"a telegram bot's name must be 1-64 letters, digits, '_' or '-' {NOT_SHOWN}",
            hint="It names the channel (channel/telegram/BOT), not the bot's @username or token.",
        )


def _variable(inst: Any, attribute: attrs.Attribute[Any], value: str) -> None:
    if not isinstance(value, str) or (value and not _VARIABLE.fullmatch(value)):
        raise ConfigError(
            f"telegram {attribute.name} must name an environment variable (letters, digits "
            f"and '_') {NOT_SHOWN}",
            hint="Put the secret in that variable (or the token in token_file), and the "
            "variable's name here.",
        )


def _approvers(value: Iterable[Any]) -> tuple[int, ...]:
    if isinstance(value, str | int):
        raise ConfigError(f"telegram approvers must be a list of user ids {NOT_SHOWN}")
    ids = tuple(value)
    for n, uid in enumerate(ids, start=1):
        if isinstance(uid, bool) or not isinstance(uid, int) or uid <= 0:
            raise ConfigError(
                f"telegram approver {n} of {len(ids)} is not a Telegram user id (a positive "
                f"number) {NOT_SHOWN}",
                hint="A user id is stable; a @username can change hands. Ask @userinfobot.",
            )
    return ids


def _choice(*allowed: str) -> Any:
    def check(inst: Any, attribute: attrs.Attribute[Any], value: str) -> None:
        if value not in allowed:
            raise ConfigError(
                f"telegram {attribute.name} must be one of {', '.join(allowed)} {NOT_SHOWN}"
            )

    return check


def _positive(inst: Any, attribute: attrs.Attribute[Any], value: float) -> None:
    if not 0 < value < math.inf:
        raise ConfigError(f"telegram {attribute.name} must be positive and finite, got {value!r}")


def _at_least_one(inst: Any, attribute: attrs.Attribute[Any], value: float) -> None:
    if not value >= 1:  # Telegram's long poll counts whole seconds: less would not wait
        raise ConfigError(f"telegram {attribute.name} must be at least 1 second, got {value!r}")


def _not_negative(inst: Any, attribute: attrs.Attribute[Any], value: float) -> None:
    if not value >= 0:
        raise ConfigError(f"telegram {attribute.name} must be 0 or more, got {value!r}")


@attrs.frozen(kw_only=True)
class Telegram:
    """An agent's Telegram bot.

    Attributes:
        bot: The channel's name (``channel/telegram/<bot>``); one agent per bot.
        token_env: The environment variable the worker reads the bot token from.
        token_file: A file holding the token (read instead of ``token_env`` when set).
        approvers: Telegram user ids who may approve or deny the agent's tool calls from a
            chat (a button or a reply to the prompt). Nobody else can, whoever pairs.
        delivery: A crash between a send and its record: ``at_least_once`` sends the message
            again (a possible duplicate), ``at_most_once`` does not (a possible loss).
        mode: ``polling`` (``getUpdates``; no public address needed) or ``webhook`` (Telegram
            posts to ``webhook_url``, served by ``toren serve`` at ``/telegram/<bot>``).
        webhook_url: The public HTTPS address Telegram posts updates to (webhook mode).
        webhook_secret_env: The environment variable holding the secret Telegram sends with
            each update (webhook mode); requests without it are refused.
        per_thread: One conversation per forum topic / reply thread instead of per chat.
        poll_timeout: Seconds a ``getUpdates`` long poll waits; also how long a run's reply
            may wait to be noticed while no update comes.
        chat_interval: Seconds between two messages to one chat (Telegram allows about one a
            second per chat, 20 a minute in groups).
        global_per_second: Messages per second to all chats together (Telegram: about 30).
        max_file_bytes: The largest file a chat may send into the workspace (Telegram's bots
            download at most 20 MB).
        pair_code_ttl: How long a pairing code stays valid.
        max_pending_codes: Unused, unexpired codes that may exist at once.
    """

    bot: str = attrs.field(validator=_bot)
    token_env: str = attrs.field(
        default="TELEGRAM_BOT_TOKEN",  # a variable's name, not a token
        validator=_variable,
    )
    token_file: str | None = None
    approvers: tuple[int, ...] = attrs.field(default=(), converter=_approvers)
    delivery: str = attrs.field(
        default="at_least_once", validator=_choice("at_least_once", "at_most_once")
    )
    mode: str = attrs.field(default="polling", validator=_choice("polling", "webhook"))
    webhook_url: str | None = None
    webhook_secret_env: str = attrs.field(
        default="TELEGRAM_WEBHOOK_SECRET",  # a variable's name
        validator=_variable,
    )
    per_thread: bool = False
    poll_timeout: float = attrs.field(default=3.0, converter=float, validator=_at_least_one)
    chat_interval: float = attrs.field(default=1.0, converter=float, validator=_not_negative)
    global_per_second: float = attrs.field(default=30.0, converter=float, validator=_positive)
    max_file_bytes: int = attrs.field(default=20 * 1024 * 1024, validator=_positive)
    pair_code_ttl: float = attrs.field(default=600.0, converter=parse_duration)
    max_pending_codes: int = attrs.field(default=20, validator=_positive)

    def __attrs_post_init__(self) -> None:
        if self.mode == "webhook" and not self.webhook_url:
            raise ConfigError(
                f"telegram bot {self.bot!r}: webhook mode needs webhook_url",
                hint="The public https:// address of `toren serve`, ending in /telegram/BOT.",
            )
        if not self.token_env.strip() and not self.token_file:
            raise ConfigError(f"telegram bot {self.bot!r}: give token_env or token_file")

    def token(self, environ: Mapping[str, str] | None = None) -> str:
        """The bot token, from ``token_file`` or ``token_env``.

        Raises:
            ConfigError: neither holds one (the message names where it looked, never a value).
        """
        environ = os.environ if environ is None else environ
        if self.token_file:
            try:
                token = Path(self.token_file).read_text(encoding="utf-8").strip()
            except OSError as exc:
                raise ConfigError(
                    f"telegram bot {self.bot!r}: cannot read token_file {self.token_file!r}: "
                    f"{exc.strerror}"
                ) from None
        else:
            token = environ.get(self.token_env, "").strip()
        if not token or any(c.isspace() for c in token):
            where = f"token_file {self.token_file!r}" if self.token_file else self.token_env
            raise ConfigError(
                f"telegram bot {self.bot!r} has no token in {where}",
                hint="Create a bot with @BotFather and put its token there (docs/channels.md).",
            )
        return token

    def webhook_secret(self, environ: Mapping[str, str] | None = None) -> str:
        """The webhook's secret token (webhook mode).

        Raises:
            ConfigError: the variable is unset, or not 1-256 of ``A-Za-z0-9_-`` (Telegram's
                rule for ``secret_token``).
        """
        environ = os.environ if environ is None else environ
        secret = environ.get(self.webhook_secret_env, "")
        if not re.fullmatch(r"[A-Za-z0-9_-]{16,256}", secret):
            raise ConfigError(
                f"telegram bot {self.bot!r}: {self.webhook_secret_env} must hold 16-256 "
                "letters, digits, '_' or '-'",
                hint="Generate one: python -c 'import secrets; print(secrets.token_urlsafe(32))'",
            )
        return secret

    def as_args(self) -> dict[str, Any]:
        """What the channel actor is spawned with (JSON; no secret: only where to read it)."""
        return attrs.asdict(self, recurse=False) | {"approvers": list(self.approvers)}

    agent_field: ClassVar[str] = "telegram"  # toren._agent.parts: Agent(telegram=...)

    def agent_tools(self, agent: Agent) -> tuple[Tool, ...]:
        """None: a bot gives the model no tools of its own (a sandbox's send_file is the
        sandbox's)."""
        return ()

    @classmethod
    def from_args(cls, args: Mapping[str, Any]) -> Telegram:
        """The settings from :meth:`as_args` (unknown keys ignored: a newer version's)."""
        names = {f.name for f in attrs.fields(cls)}
        return cls(**{k: v for k, v in args.items() if k in names})


SETTABLE = tuple(f.name for f in attrs.fields(Telegram))
"""The keys of an ``[agents.NAME.telegram]`` table."""


def configured(current: Telegram | None, table: Mapping[str, Any], where: str) -> Telegram:
    """``current`` (or a new channel) with the keys of ``[agents.NAME.telegram]`` applied.

    Raises:
        ConfigError: a key is unknown, a value has the wrong type, or ``bot`` is missing.
    """
    unknown = sorted(set(table) - set(SETTABLE))
    if unknown:
        raise ConfigError(
            f"unknown key(s) in {where}: {', '.join(unknown)}",
            hint=f"Known keys: {', '.join(SETTABLE)}.",
        )
    for key, value in table.items():
        if key == "per_thread" and not isinstance(value, bool):
            raise ConfigError(f"{key} in {where} must be true or false {NOT_SHOWN}")
        strings = ("bot", "token_env", "token_file", "delivery", "mode", "webhook_url")
        if key in (*strings, "webhook_secret_env") and not isinstance(value, str):
            raise ConfigError(f"{key} in {where} must be a string {NOT_SHOWN}")
        numbers = ("poll_timeout", "chat_interval", "global_per_second", "max_file_bytes")
        if key in (*numbers, "max_pending_codes") and (
            isinstance(value, bool) or not isinstance(value, int | float)
        ):
            raise ConfigError(f"{key} in {where} must be a number {NOT_SHOWN}")
    if current is None and "bot" not in table:
        raise ConfigError(f'{where} needs bot = "NAME"')
    try:
        if current is None:
            return Telegram(**table)
        return attrs.evolve(current, **table)
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc.what}", hint=exc.hint) from None
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{where}: {exc}") from None


TELEGRAM_PART = AgentPart(field="telegram", settable=None, configured=configured)
"""How ``[agents.NAME.telegram]`` changes (or gives) an agent's bot: its keys are checked when
merged."""
