"""Per-agent settings in the TOML file (``[agents.NAME]``), their precedence over code, and the
cross-agent consent check at boot and in ``toren agents check``."""

from __future__ import annotations

import subprocess
import textwrap
from pathlib import Path
from typing import Any

import anyio
import pytest

from tests.conftest import ROOT
from tests.test_cli import toren
from toren import Agent, ConfigError, Settings
from toren._agent import registry
from toren._agent.registry import agent_named, register_agents
from toren._agent.tables import ConsentFinding, configured, consent_findings, unloaded_tables

MODEL = "anthropic/claude-sonnet-4-6"

# An app whose consent is declared on one side only, in each way there is: written to a temporary
# directory so that no in-process test registers its agents.
CONSENT_APP = """
from toren import Agent

MODEL = "anthropic/claude-sonnet-4-6"
triage = Agent(name="triage", model=MODEL, calls=["billing", "ledger"])
billing = Agent(name="billing", model=MODEL, description="Answers billing questions.")
refunds = Agent(
    name="refunds", model=MODEL, description="Issues refunds.", accepts=["triage"]
)
"""


def load(tmp_path: Path, text: str) -> Settings:
    config = tmp_path / "toren.toml"
    config.write_text(textwrap.dedent(text))
    return Settings.load(config_file=config, env={})


@pytest.fixture
def fresh_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    """Agents registered by a test stay out of the process's registry."""
    monkeypatch.setattr(registry.PROCESS_AGENTS, "_registry", {})
    monkeypatch.setattr(registry.PROCESS_AGENTS, "_declared", {})


def test_agent_tables_are_read_checked_and_frozen(tmp_path: Path) -> None:
    settings = load(
        tmp_path,
        """
        [agents.support]
        calls = ["billing"]
        budget_usd = 3
        wall_clock = "45m"
        compact_soft = 0.4

        [agents.billing]
        wall_clock = 90
        """,
    )
    assert dict(settings.agents["support"]) == {
        "calls": ("billing",),
        "budget_usd": 3.0,
        "wall_clock": 2700.0,
        "compact_soft": 0.4,
    }
    assert settings.agents["billing"]["wall_clock"] == 90.0
    assert settings.config_file == tmp_path / "toren.toml"
    with pytest.raises(TypeError):
        settings.agents["support"]["budget_usd"] = 100  # type: ignore[index]
    with pytest.raises(TypeError):
        settings.agents["other"] = {}  # type: ignore[index]


def test_an_unknown_key_names_the_table_and_the_known_keys(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as caught:
        load(tmp_path, "[agents.support]\nbudget = 3\n")
    assert "unknown key(s) in [agents.support]" in str(caught.value)
    assert "budget" in caught.value.what
    assert str(tmp_path / "toren.toml") in caught.value.what
    assert "budget_usd" in caught.value.hint


def test_code_keys_are_refused_with_the_reason(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"unknown key.*model") as caught:
        load(tmp_path, '[agents.support]\nmodel = "openai/gpt-5"\n')
    assert "are code" in caught.value.hint


@pytest.mark.parametrize(
    ("line", "needle"),
    [
        ('calls = "billing"', "calls in .agents.support. .* must be a list of agent names"),
        ('accepts = ["a", 3]', "accepts .* must be a list of agent names"),
        ('budget_usd = "lots"', "budget_usd .* must be a number"),
        ("max_attempts = 2.5", "max_attempts .* must be an integer"),
        ("max_tokens = true", "max_tokens .* must be an integer"),
        ("description = 4", "description .* must be a string"),
        ('wall_clock = "soon"', "wall_clock .*: not a duration"),
        ("wall_clock = -5", "wall_clock .*: duration must be positive"),
    ],
)
def test_a_value_of_the_wrong_type_names_the_setting(
    tmp_path: Path, line: str, needle: str
) -> None:
    with pytest.raises(ConfigError, match=needle):
        load(tmp_path, f"[agents.support]\n{line}\n")


def test_agents_must_hold_tables(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"agents\.support in .* must be a table"):
        load(tmp_path, "[agents]\nsupport = 3\n")


def test_the_table_replaces_the_codes_values_key_by_key(
    tmp_path: Path, fresh_registry: None
) -> None:
    code = Agent(name="support", model=MODEL, budget_usd=1.0, calls=["billing"], max_tokens=512)
    settings = load(tmp_path, '[agents.support]\nbudget_usd = 2.5\ncalls = ["ledger"]\n')
    [registered] = register_agents([code], settings.agents, source="toren.toml")
    assert registered.budget_usd == 2.5
    assert registered.calls == ("ledger",)
    assert registered.max_tokens == 512  # not in the table: the code's value
    assert agent_named("support") is registered
    # Registered again (another load of the same app), the settings are applied again.
    [again] = register_agents([code])
    assert again is code


def test_an_agent_without_a_table_is_registered_as_declared(fresh_registry: None) -> None:
    code = Agent(name="support", model=MODEL)
    assert register_agents([code], {"billing": {"budget_usd": 1.0}}) == [code]


def test_merged_values_that_make_an_invalid_agent_name_the_file(tmp_path: Path) -> None:
    code = Agent(name="support", model=MODEL)
    settings = load(tmp_path, "[agents.support]\ncompact_soft = 0.9\n")
    with pytest.raises(ConfigError, match="compact_soft < compact_hard") as caught:
        configured(code, settings.agents["support"], str(settings.config_file))
    assert f"from [agents.support] in {tmp_path / 'toren.toml'}" in caught.value.what


def test_accepting_callers_from_the_file_needs_a_description() -> None:
    code = Agent(name="billing", model=MODEL)
    with pytest.raises(ConfigError, match=r"no description.*accepts from \[agents\.billing\]"):
        configured(code, {"accepts": ("support",)}, "toren.toml")
    assert configured(code, {"accepts": ("support",), "description": "Bills."}, "f").accepts


def test_a_failed_merge_registers_none_of_the_agents(fresh_registry: None) -> None:
    good = Agent(name="good", model=MODEL)
    bad = Agent(name="bad", model=MODEL)
    with pytest.raises(ConfigError):
        register_agents([good, bad], {"bad": {"max_attempts": 0}})
    assert agent_named("good") is None


def test_tables_for_agents_not_loaded_here_are_named() -> None:
    tables: dict[str, dict[str, Any]] = {"support": {}, "nobody": {}, "elsewhere": {}}
    assert unloaded_tables(tables, ["support"]) == ["elsewhere", "nobody"]


def agents(**declared: dict[str, Any]) -> list[Agent]:
    return [
        Agent(name=name, model=MODEL, description=f"{name} does things.", **kw)
        for name, kw in declared.items()
    ]


def test_consent_on_both_sides_finds_nothing() -> None:
    assert consent_findings(agents(a={"calls": ["b"]}, b={"accepts": ["a"]})) == []


def test_a_callee_that_does_not_accept_the_caller_is_one_sided() -> None:
    [finding] = consent_findings(agents(a={"calls": ["b"]}, b={}))
    assert finding == ConsentFinding(kind="not_accepted", caller="a", callee="b")
    assert finding.message == "a calls b but b does not accept a: the call is refused"
    assert not finding.error


def test_accepting_a_loaded_caller_that_does_not_call_is_one_sided() -> None:
    [finding] = consent_findings(agents(a={}, b={"accepts": ["a"]}))
    assert finding == ConsentFinding(kind="not_called", caller="a", callee="b")
    assert finding.message == "b accepts a but a does not call b"


def test_accepting_a_caller_not_loaded_here_is_fine() -> None:
    assert consent_findings(agents(b={"accepts": ["elsewhere"]})) == []


def test_a_callee_not_loaded_here_is_checked_at_call_time() -> None:
    [finding] = consent_findings(agents(a={"calls": ["elsewhere"]}))
    assert finding.kind == "unknown_callee"
    assert "unknown here: checked at call time" in finding.message


def test_an_agent_calling_itself_is_an_error() -> None:
    [finding] = consent_findings(agents(a={"calls": ["a"], "accepts": ["a"]}))
    assert finding.kind == "self_call"
    assert finding.error


def with_consent_app(
    tmp_path: Path, config: str, *args: str, db_url: str | None = None
) -> subprocess.CompletedProcess[str]:
    """``toren --config FILE ARGS...`` with FILE holding ``config`` and the consent app
    importable (as ``consent_app``)."""
    (tmp_path / "consent_app.py").write_text(CONSENT_APP)
    path = tmp_path / "toren.toml"
    path.write_text(config)
    return toren("--config", str(path), *args, db_url=db_url, PYTHONPATH=f"{ROOT}:{tmp_path}")


CHECK = ("agents", "check", "--app", "consent_app")


def test_agents_check_lists_consent_findings_and_fails_only_when_strict(tmp_path: Path) -> None:
    result = with_consent_app(tmp_path, "", *CHECK)
    assert result.returncode == 0, result.stderr
    assert "cross-agent consent: 3 finding(s)" in result.stdout
    assert "WARN triage calls billing but billing does not accept triage" in result.stdout
    assert "WARN triage calls ledger, unknown here: checked at call time" in result.stdout
    assert "WARN refunds accepts triage but triage does not call refunds" in result.stdout
    assert with_consent_app(tmp_path, "", *CHECK, "--strict").returncode == 1


def test_agents_check_applies_the_file_and_lists_tables_for_no_agent_here(
    tmp_path: Path,
) -> None:
    config = (
        '[agents.billing]\naccepts = ["triage"]\n\n[agents.triage]\ncalls = ["billing"]\n'
        "[agents.refunds]\naccepts = []\n\n[agents.nobody]\nbudget_usd = 1\n"
    )
    result = with_consent_app(tmp_path, config, *CHECK)
    assert result.returncode == 0, result.stderr
    assert "no one-sided declaration" in result.stdout
    assert f"4 [agents.NAME] table(s) in {tmp_path / 'toren.toml'}" in result.stdout
    assert "[agents.billing] applied: accepts" in result.stdout
    assert "[agents.nobody] no such agent loaded here" in result.stdout
    strict = with_consent_app(tmp_path, config, *CHECK, "--strict")
    assert strict.returncode == 1
    assert "[agents.nobody] no such agent loaded here" in strict.stdout


def test_agents_check_exits_1_for_a_self_call_without_strict(tmp_path: Path) -> None:
    result = with_consent_app(tmp_path, '[agents.billing]\ncalls = ["billing"]\n', *CHECK)
    assert result.returncode == 1
    assert "ERROR billing calls itself" in result.stdout


def test_agents_check_exits_2_for_an_invalid_merge(tmp_path: Path) -> None:
    result = with_consent_app(tmp_path, "[agents.billing]\ncompact_hard = 0.2\n", *CHECK)
    assert result.returncode == 2
    assert f"from [agents.billing] in {tmp_path / 'toren.toml'}" in result.stderr


def test_a_worker_refuses_to_boot_with_an_invalid_merge_naming_the_file(tmp_path: Path) -> None:
    config = "[agents.triage]\ncompact_soft = 0.8\ncompact_hard = 0.7\n"
    result = with_consent_app(tmp_path, config, "worker", "--app", "consent_app")
    assert result.returncode == 2
    assert "error: agent 'triage': compaction thresholds" in result.stderr
    where = f"(with compact_hard, compact_soft from [agents.triage] in {tmp_path / 'toren.toml'})"
    assert where in result.stderr


@pytest.mark.anyio
async def test_a_booting_worker_warns_of_one_sided_consent_and_notes_foreign_tables(
    tmp_path: Path, empty_db_url: str
) -> None:
    config = "[agents.nobody]\nbudget_usd = 1\n"
    result = await anyio.to_thread.run_sync(
        lambda: with_consent_app(
            tmp_path, config, "worker", "--app", "consent_app", db_url=empty_db_url
        )
    )
    assert result.returncode == 2  # the database is not migrated: the checks ran before that
    logged = [line for line in result.stderr.splitlines() if "toren.worker" in line]
    warnings = [line for line in logged if "WARNING" in line and "consent" in line]
    assert len(warnings) == 3
    assert any("triage calls billing but billing does not accept triage" in w for w in warnings)
    [info] = [line for line in logged if "[agents.nobody]" in line]
    assert " INFO toren.worker: " in info
    assert "names no agent this worker loads" in info
