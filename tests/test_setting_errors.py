"""Errors about a setting say where its value came from (the variable; for ``X_FILE`` the
variable and the file) and what form was expected, never the value: a secret put in the wrong
variable, or a secret file mounted under the wrong name, must not reach a terminal or a log."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.test_cli import toren
from toren._agent.app import load_app
from toren._core.errors import ConfigError
from toren._core.secret_files import read_secret_files
from toren._settings import Settings
from toren.channels import Telegram
from toren.providers import RetryPolicy
from toren.sandboxes.store import store_from_url

SECRET = "sk-ant-api03-not-a-real-key-4f9c2e"

# One setting of each kind Settings converts: a float, two ints, a boolean, a list.
SETTINGS = [
    "TOREN_LEASE_SECONDS",
    "TOREN_MAX_MESSAGE_BYTES",
    "TOREN_STREAMS_MAX",
    "TOREN_SECURE_COOKIES",
    "TOREN_TRUSTED_PROXIES",
]


def _refusal(env: dict[str, str]) -> str:
    with pytest.raises(ConfigError) as caught:
        Settings.load(env=env)
    return str(caught.value)


@pytest.mark.parametrize("var", SETTINGS)
def test_a_setting_file_that_does_not_parse_is_named_with_its_path_never_its_content(
    tmp_path: Path, var: str
) -> None:
    path = tmp_path / "mounted-secret"
    path.write_text(SECRET + "\n")
    env = {f"{var}_FILE": str(path)}
    read_secret_files(env)  # what the CLI does at boot: X_FILE's content becomes X
    message = _refusal(env)
    assert SECRET not in message
    assert f"{var}_FILE" in message
    assert str(path) in message


@pytest.mark.parametrize("var", SETTINGS)
def test_a_setting_variable_that_does_not_parse_is_named_never_its_value(var: str) -> None:
    message = _refusal({var: SECRET})
    assert SECRET not in message
    assert var in message
    assert "must be" in message  # what form it should take, instead of what it holds


def test_the_settings_file_is_named_for_a_value_it_holds_never_the_value(tmp_path: Path) -> None:
    config = tmp_path / "toren.toml"
    config.write_text(f'streams_max = "{SECRET}"\ntrusted_proxies = ["10.0.0.1", "{SECRET}"]\n')
    message = _refusal({"TOREN_CONFIG": str(config)})
    assert SECRET not in message
    assert str(config) in message


@pytest.mark.parametrize(
    ("args", "var"),
    [(("workers",), "TOREN_LOG_LEVEL"), (("serve",), "TOREN_PORT"), (("worker",), "TOREN_APP")],
)
def test_a_command_option_from_the_environment_is_refused_without_its_value(
    args: tuple[str, ...], var: str
) -> None:
    done = toren(*args, db_url="postgresql://nobody@/nothing", **{var: SECRET})
    assert done.returncode == 2, done
    assert SECRET not in done.stdout + done.stderr
    assert var in done.stderr
    assert "Traceback" not in done.stderr


def test_a_command_fails_naming_the_file_when_a_setting_file_holds_a_secret(
    tmp_path: Path,
) -> None:
    path = tmp_path / "lease"
    path.write_text(SECRET)
    done = toren("workers", TOREN_LEASE_SECONDS_FILE=str(path))
    assert done.returncode == 2, done
    assert SECRET not in done.stdout + done.stderr
    assert f"error: lease_seconds from TOREN_LEASE_SECONDS_FILE ({path})" in done.stderr


def test_the_model_retry_variables_are_named_never_their_values() -> None:
    for var in ("TOREN_MODEL_RETRY_ATTEMPTS", "TOREN_MODEL_RETRY_BASE_SECONDS"):
        with pytest.raises(ConfigError) as caught:
            RetryPolicy.from_env({var: SECRET})
        assert SECRET not in str(caught.value)
        assert var in str(caught.value)
    assert RetryPolicy.from_env({}) == RetryPolicy()
    policy = RetryPolicy.from_env(
        {"TOREN_MODEL_RETRY_ATTEMPTS": "2", "TOREN_MODEL_RETRY_BASE_SECONDS": "0.05"}
    )
    assert (policy.attempts, policy.base) == (2, 0.05)


def test_an_app_module_that_is_no_module_path_is_refused_without_echoing_it() -> None:
    with pytest.raises(ConfigError) as caught:
        load_app(SECRET)
    assert SECRET not in str(caught.value)
    assert "MODULE[:ATTR]" in str(caught.value)


@pytest.mark.parametrize("url", [f"{SECRET}:x", f"s3://{SECRET.upper()}/p", f"s3://b/p?{SECRET}"])
def test_a_workspace_store_url_that_does_not_parse_is_not_echoed(url: str) -> None:
    with pytest.raises(ConfigError) as caught:
        store_from_url(url)
    assert SECRET not in str(caught.value)
    assert SECRET.upper() not in str(caught.value)


def test_an_s3_endpoint_that_is_no_url_is_named_never_shown() -> None:
    for var in ("TOREN_S3_ENDPOINT_URL", "AWS_ENDPOINT_URL"):
        with pytest.raises(ConfigError) as caught:
            store_from_url("s3://toren-ws/runs", env={var: SECRET})
        assert SECRET not in str(caught.value)
        assert var in str(caught.value)


def test_a_bot_token_put_where_a_name_belongs_is_refused_without_echoing_it() -> None:
    token = "1234567:AAH-not-a-real-bot-token"
    for fields in ({"bot": token}, {"token_env": token}, {"webhook_secret_env": token}):
        with pytest.raises(ConfigError) as caught:
            Telegram(**{"bot": "support", **fields})
        assert token not in str(caught.value)


@pytest.mark.anyio
@pytest.mark.parametrize("opened", ["connect", "create_pool"])
async def test_a_database_url_whose_password_breaks_its_parsing_never_shows_the_password(
    opened: str,
) -> None:
    """A password with an unescaped ``@`` and ``:`` (a common slip) makes asyncpg read part of
    it as the port; its error quotes that part, and the error Toren shows must not."""
    from toren._core import db as _db
    from toren._core.errors import DatabaseUnavailable

    url = "postgresql://toren:p@ss:hunter2-secret@127.0.0.1/toren"
    with pytest.raises(DatabaseUnavailable) as caught:
        await getattr(_db, opened)(url)
    # Nor a logged traceback of it (the exceptions it is chained from).
    import traceback

    shown = "".join(traceback.format_exception(caught.value))
    assert "hunter2" not in shown
    assert "percent-encode" in str(caught.value)  # what to fix is said
