"""Telegram settings: what ``Telegram(...)`` and ``[agents.NAME.telegram]`` accept, where the
token is read from (and that errors name the place, never the value), one agent per bot."""

from __future__ import annotations

from pathlib import Path

import pytest

from toren import Agent, ConfigError
from toren._agent.parts import PartTable
from toren._agent.tables import configured, read_agent_tables
from toren.actors.channels.runtime import configured_bots
from toren.channels import Telegram
from toren.channels._settings import TELEGRAM_PART

MODEL = "anthropic/claude-sonnet-4-6"

PARTS = {"telegram": TELEGRAM_PART}  # as toren.Settings hands them


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"bot": "has space"}, "must be 1-64 letters"),
        ({"bot": "b", "approvers": ["@ann"]}, "is not a Telegram user id"),
        ({"bot": "b", "approvers": 5}, "must be a list of user ids"),
        ({"bot": "b", "delivery": "exactly_once"}, "delivery must be one of"),
        ({"bot": "b", "mode": "webhook"}, "webhook mode needs webhook_url"),
        ({"bot": "b", "poll_timeout": 0.5}, "poll_timeout must be at least 1 second"),
        ({"bot": "b", "chat_interval": -1}, "chat_interval must be 0 or more"),
        ({"bot": "b", "global_per_second": "inf"}, "global_per_second must be positive and finite"),
        ({"bot": "b", "global_per_second": "nan"}, "global_per_second must be positive and finite"),
    ],
)
def test_bad_settings_are_refused_with_what_is_wrong(
    values: dict[str, object], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        Telegram(**values)  # type: ignore[arg-type]


def test_the_token_comes_from_its_variable_or_its_file(tmp_path: Path) -> None:
    telegram = Telegram(bot="b", token_env="MY_BOT_TOKEN")
    assert telegram.token({"MY_BOT_TOKEN": " 123:abc \n"}) == "123:abc"
    with pytest.raises(ConfigError, match="has no token in MY_BOT_TOKEN") as missing:
        telegram.token({"OTHER": "123:secret-value"})
    assert "secret-value" not in str(missing.value)
    path = tmp_path / "token"
    path.write_text("456:from-a-file\n")
    assert Telegram(bot="b", token_file=str(path)).token({}) == "456:from-a-file"
    with pytest.raises(ConfigError, match="cannot read token_file"):
        Telegram(bot="b", token_file=str(tmp_path / "nope")).token({})
    with pytest.raises(ConfigError, match="must hold 16-256"):
        Telegram(bot="b", webhook_secret_env="S").webhook_secret({"S": "short"})


def test_the_settings_table_gives_or_changes_a_bot() -> None:
    tables = read_agent_tables(
        {"ann": {"telegram": {"bot": "annbot", "approvers": [7], "delivery": "at_most_once"}}},
        "toren.toml",
        PARTS,
    )
    agent = configured(Agent(name="ann", model=MODEL), tables["ann"], "toren.toml")
    assert agent.telegram == Telegram(bot="annbot", approvers=(7,), delivery="at_most_once")
    coded = Agent(name="ann", model=MODEL, telegram=Telegram(bot="coded", chat_interval=2))
    changed = configured(coded, {"telegram": PartTable(TELEGRAM_PART, {"chat_interval": 0})}, "t")
    assert changed.telegram == Telegram(bot="coded", chat_interval=0)
    with pytest.raises(ConfigError, match="unknown key"):
        configured(coded, {"telegram": PartTable(TELEGRAM_PART, {"token": "1:a"})}, "t")
    with pytest.raises(ConfigError, match='needs bot = "NAME"'):
        configured(
            Agent(name="ann", model=MODEL),
            {"telegram": PartTable(TELEGRAM_PART, {"approvers": [1]})},
            "t",
        )


def test_one_agent_per_bot() -> None:
    a = Agent(name="a", model=MODEL, telegram=Telegram(bot="same"))
    b = Agent(name="b", model=MODEL, telegram=Telegram(bot="same"))
    with pytest.raises(ConfigError, match="both use telegram bot 'same'"):
        configured_bots([a, b])
    assert configured_bots([a, Agent(name="c", model=MODEL)]) == {"same": a}


def test_send_file_is_offered_only_with_a_sandbox_and_a_bot() -> None:
    from toren.sandboxes import Sandbox

    both = Agent(name="f", model=MODEL, sandbox=Sandbox(), telegram=Telegram(bot="f"))
    assert "send_file" in [t.name for t in both.all_tools]
    sandbox_only = Agent(name="g", model=MODEL, sandbox=Sandbox())
    assert "send_file" not in [t.name for t in sandbox_only.all_tools]


def test_a_lookalike_is_not_a_kinds_part_and_a_read_table_equals_its_items() -> None:
    # The agent layer does not import the kinds: it still takes only their own classes.
    class LooksLikeTelegram:
        agent_field = "telegram"

        def agent_tools(self, agent: Agent) -> tuple[()]:
            return ()

    with pytest.raises(ConfigError, match=r"telegram must be a toren.channels.Telegram"):
        Agent(name="ann", model=MODEL, telegram=LooksLikeTelegram())  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"sandbox must be a toren.sandboxes.Sandbox"):
        Agent(name="ann", model=MODEL, sandbox=LooksLikeTelegram())  # type: ignore[arg-type]
    tables = read_agent_tables({"ann": {"telegram": {"bot": "annbot"}}}, "toren.toml", PARTS)
    assert tables["ann"]["telegram"] == {"bot": "annbot"}
