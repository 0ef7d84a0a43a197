"""Schedules as users declare them: ``Schedule(...)`` with its JSON form, ``Agent(schedules=...)``
and ``[agents.NAME.schedules.SLOT]`` tables merged the way an agent's other parts are, and
schedules never in a model request's digest."""

from __future__ import annotations

import math
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from toren import Agent, ConfigError, Settings
from toren._agent.tables import configured, read_agent_tables
from toren.actors.runs.request import build_request, parameters
from toren.runs import Message, Text
from toren.schedules import OVERLAPS, Schedule, ScheduleError, Spec
from toren.schedules._declaration import SCHEDULES_PART

MODEL = "anthropic/claude-sonnet-4-6"
PARTS = {"schedules": SCHEDULES_PART}  # as toren.Settings hands them

DIGEST = Schedule(name="digest", cron="0 9 * * 1-5", timezone="Europe/Berlin")
SWEEP = Schedule(name="sweep", every="30m", input="Sweep at {slot_utc}.")


def agent(*schedules: Schedule) -> Agent:
    return Agent(name="reports", model=MODEL, schedules=list(schedules))


def merged(base: Agent, raw: dict[str, Any]) -> Agent:
    tables = read_agent_tables({base.name: {"schedules": raw}}, "t.toml", PARTS)
    return configured(base, tables[base.name], "t.toml")


# The declaration.


def test_a_schedule_gives_its_spec_and_keeps_its_values() -> None:
    assert DIGEST.spec == Spec(cron="0 9 * * 1-5", timezone="Europe/Berlin")
    assert SWEEP.every == 1800.0
    assert SWEEP.spec.every == 1800.0
    assert (DIGEST.overlap, DIGEST.catch_up, DIGEST.pause_on_failure) == ("skip", 0.0, False)
    assert DIGEST.input == "{slot}"
    assert Schedule(name="n", cron="@hourly").cron == "0 * * * *"
    assert Schedule(name="n", every=60, catch_up="1h", jitter="2m").catch_up == 3600.0


def test_the_json_form_goes_back_to_the_same_schedule() -> None:
    full = Schedule(
        name="full",
        cron="30 2 * * *",
        timezone="America/Sao_Paulo",
        jitter=12.5,
        start=datetime.fromisoformat("2026-01-01T00:00:00-03:00"),
        end="2027-01-01T00:00:00Z",
        input="Report {{date}} = {date}",
        concurrency_key="customer-42",
        overlap="buffer_one",
        catch_up=900,
        pause_on_failure=True,
    )
    for schedule in (DIGEST, SWEEP, full):
        data = schedule.to_json()
        assert all(isinstance(v, str | int | float | bool | None) for v in data.values())
        assert Schedule.from_json(data) == schedule
    assert full.to_json()["start"] == "2026-01-01T00:00:00-03:00"


@given(
    name=st.from_regex(r"[a-z0-9][a-z0-9_-]{0,62}", fullmatch=True),
    every=st.floats(min_value=1, max_value=1e7, allow_nan=False),
    jitter=st.floats(min_value=0, max_value=1e6, allow_nan=False),
    catch_up=st.floats(min_value=0, max_value=1e7, allow_nan=False),
    overlap=st.sampled_from(OVERLAPS),
    text=st.text(min_size=1).filter(lambda t: t.strip() and "\x00" not in t),
    key=st.none() | st.text(min_size=1, max_size=50).filter(lambda t: "\x00" not in t),
    pause=st.booleans(),
)
def test_the_json_form_round_trips(
    name: str,
    every: float,
    jitter: float,
    catch_up: float,
    overlap: str,
    text: str,
    key: str | None,
    pause: bool,
) -> None:
    try:
        text.encode()
        template = text.replace("{", "{{").replace("}", "}}")
        schedule = Schedule(
            name=name,
            every=every,
            jitter=jitter,
            catch_up=catch_up,
            overlap=overlap,  # type: ignore[arg-type]
            input=template,
            concurrency_key=key,
            pause_on_failure=pause,
        )
    except (UnicodeEncodeError, ScheduleError):  # lone surrogates are refused: not this test
        return
    assert Schedule.from_json(schedule.to_json()) == schedule


def test_from_json_refuses_unknown_keys_unless_told_they_are_a_newer_versions() -> None:
    data = DIGEST.to_json() | {"colour": "blue"}
    with pytest.raises(ScheduleError, match=r"unknown key.*colour"):
        Schedule.from_json(data)
    assert Schedule.from_json(data, strict=False) == DIGEST
    with pytest.raises(ScheduleError, match="name: is required"):
        Schedule.from_json({"cron": "0 9 * * *"})
    with pytest.raises(ScheduleError, match="must be an object"):
        Schedule.from_json(["digest"])  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("values", "field", "message"),
    [
        ({"name": "Digest"}, "name", "lowercase letters"),
        ({"name": "-x"}, "name", "lowercase letters"),
        ({"name": "x" * 64}, "name", "at most 63 bytes"),
        ({"name": "a/b"}, "name", "lowercase letters"),
        ({"name": "a\x00"}, "name", "NUL"),
        ({"cron": "nope"}, "cron", "needs 5 fields"),
        ({"timezone": "Europe/Nowhere"}, "timezone", "unknown time zone"),
        ({"every": 60}, "cron", "exactly one of cron and every"),
        ({"cron": None}, "cron", "exactly one of cron and every"),
        ({"every": "soon", "cron": None}, "every", "not a duration"),
        ({"jitter": -1}, "jitter", "0 or more"),
        ({"jitter": math.nan}, "jitter", "finite"),
        ({"catch_up": math.inf}, "catch_up", "finite"),
        ({"catch_up": -1}, "catch_up", "0 or more"),
        ({"overlap": "queue"}, "overlap", "must be one of skip, buffer_one"),
        ({"pause_on_failure": "yes"}, "pause_on_failure", "true or false"),
        ({"input": "{nope}"}, "input", "unknown placeholder"),
        ({"input": "y" * 100 * 1024}, "input", "at most 65536 bytes"),
        ({"concurrency_key": "k" * 100 * 1024}, "concurrency_key", "at most 200 bytes"),
        ({"concurrency_key": "a\x00b"}, "concurrency_key", "NUL"),
        ({"concurrency_key": "a\udc80"}, "concurrency_key", "lone surrogate"),
        ({"concurrency_key": ""}, "concurrency_key", "must not be empty"),
        ({"start": "2026-01-01T00:00:00"}, "start", "needs a UTC offset"),
        ({"start": "2026-02-01T00:00Z", "end": "2026-01-01T00:00Z"}, "end", "after start"),
    ],
)
def test_bad_values_are_refused_naming_the_schedule_and_field(
    values: dict[str, Any], field: str, message: str
) -> None:
    given_values = {"name": "digest", "cron": "0 9 * * *"} | values
    with pytest.raises(ScheduleError, match=message) as caught:
        Schedule(**given_values)
    assert caught.value.field == field
    assert len(str(caught.value)) < 500  # a huge value is never echoed
    if field != "name":
        assert str(caught.value).startswith(f"schedule 'digest': {field}: ")


# Agent(schedules=...).


def test_an_agent_takes_a_list_of_schedules_and_refuses_anything_else() -> None:
    assert agent(DIGEST, SWEEP).schedules == (DIGEST, SWEEP)
    assert Agent(name="a", model=MODEL).schedules == ()
    with pytest.raises(
        ConfigError, match=r"schedules must be a list of toren\.schedules\.Schedule"
    ):
        Agent(name="a", model=MODEL, schedules=[{"name": "x"}])  # type: ignore[list-item]
    with pytest.raises(ConfigError, match="schedules must be a list"):
        Agent(name="a", model=MODEL, schedules=DIGEST)  # type: ignore[arg-type]


def test_two_schedules_of_one_name_are_refused() -> None:
    with pytest.raises(ConfigError, match="two schedules are named 'digest'"):
        agent(DIGEST, Schedule(name="digest", every=60))


def test_schedules_give_the_model_no_tools_and_do_not_move_the_request_digest() -> None:
    plain = Agent(name="reports", model=MODEL, system="Write reports.")
    scheduled = Agent(name="reports", model=MODEL, system="Write reports.", schedules=[DIGEST])
    changed = merged(scheduled, {"digest": {"cron": "0 10 * * *"}, "extra": {"every": 60}})
    messages = [Message(role="user", content=(Text(text="hello"),))]
    assert scheduled.all_tools == plain.all_tools
    for other in (scheduled, changed):
        assert build_request(other, messages) == build_request(plain, messages)
        assert parameters(other) == parameters(plain)


# [agents.NAME.schedules.SLOT] tables.


def test_a_table_replaces_the_keys_of_the_codes_schedule() -> None:
    result = merged(agent(DIGEST, SWEEP), {"digest": {"cron": "0 8 * * 1-5", "jitter": "1m"}})
    digest, sweep = result.schedules
    assert (digest.cron, digest.jitter, digest.timezone) == ("0 8 * * 1-5", 60.0, "Europe/Berlin")
    assert sweep == SWEEP


def test_a_tables_trigger_replaces_the_codes_other_trigger() -> None:
    result = merged(agent(DIGEST, SWEEP), {"digest": {"every": "1h"}, "sweep": {"cron": "@daily"}})
    digest, sweep = result.schedules
    assert (digest.cron, digest.every) == (None, 3600.0)
    assert (sweep.cron, sweep.every) == ("0 0 * * *", None)


def test_a_table_for_a_slot_the_code_has_not_adds_a_schedule() -> None:
    result = merged(
        agent(DIGEST),
        {"nightly": {"cron": "0 3 * * *", "timezone": "Asia/Tokyo", "overlap": "buffer_all"}},
    )
    assert [s.name for s in result.schedules] == ["digest", "nightly"]
    nightly = result.schedules[1]
    assert (nightly.timezone, nightly.overlap, nightly.input) == (
        "Asia/Tokyo",
        "buffer_all",
        "{slot}",
    )
    assert [s.name for s in merged(agent(), {"only": {"every": 60}}).schedules] == ["only"]


def test_enabled_false_removes_the_codes_schedule() -> None:
    result = merged(agent(DIGEST, SWEEP), {"digest": {"enabled": False}, "new": {"enabled": False}})
    assert result.schedules == (SWEEP,)
    assert merged(agent(DIGEST), {"digest": {"enabled": True}}).schedules == (DIGEST,)


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"digest": {"colour": "red"}}, r"unknown key\(s\) in \[agents.reports.schedules.digest\] "
         r"in t.toml: colour"),
        ({"digest": 5}, r"\[agents.reports.schedules.digest\] in t.toml must be a table"),
        ({"Bad Name": {"every": 60}}, r"\[agents.reports.schedules.Bad Name\] in t.toml: the "
         r"schedule's name must be"),
        ({"digest": {"enabled": "no"}}, r"enabled in \[agents.reports.schedules.digest\]"),
        ({"digest": {"cron": 5}}, r"cron in \[agents.reports.schedules.digest\] in t.toml must "
         r"be a string"),
        ({"digest": {"name": "other"}}, r"unknown key\(s\) in .*: name"),
    ],
)  # fmt: skip
def test_a_malformed_table_is_refused_when_the_file_is_read(
    raw: dict[str, Any], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        read_agent_tables({"reports": {"schedules": raw}}, "t.toml", PARTS)


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"digest": {"cron": "0 9 * *"}}, "digest] in t.toml: cron: needs 5 fields"),
        ({"digest": {"timezone": "Mars/Base"}}, "digest] in t.toml: timezone: unknown time zone"),
        ({"digest": {"every": 60, "cron": "0 9 * * *"}}, "exactly one of cron and every"),
        ({"digest": {"every": -1}}, "digest] in t.toml: every: must be more than 0"),
        ({"new": {"input": "{slot}"}}, "new] in t.toml: cron: give exactly one"),
        ({"new": {"every": 60, "jitter": [1]}}, "new] in t.toml: jitter: must be a number"),
        ({"new": {"every": 60, "start": 2026}}, "new] in t.toml: start: must be a date"),
    ],
)
def test_a_bad_value_in_a_table_names_the_table_and_the_field(
    raw: dict[str, Any], message: str
) -> None:
    with pytest.raises(ScheduleError, match=message.replace("[", r"\[")) as caught:
        merged(agent(DIGEST), raw)
    assert "[agents.reports.schedules." in str(caught.value)


def test_the_settings_file_gives_schedules_through_toren_settings(tmp_path: Path) -> None:
    config = tmp_path / "toren.toml"
    config.write_text(
        "[agents.reports.schedules.digest]\n"
        'cron = "0 7 * * 1-5"\n'
        "start = 2026-01-05T00:00:00+01:00\n"
        "\n"
        "[agents.reports.schedules.weekly]\n"
        'cron = "0 18 * * FRI"\n'
        'timezone = "Europe/Berlin"\n'
        'input = "Week ending {date}"\n'
        "pause_on_failure = true\n"
    )
    settings = Settings.load(config_file=config, env={})
    result = configured(agent(DIGEST), settings.agents["reports"], str(config))
    digest, weekly = result.schedules
    assert digest.cron == "0 7 * * 1-5"
    assert digest.start == datetime.fromisoformat("2026-01-05T00:00:00+01:00")
    assert (weekly.name, weekly.timezone, weekly.pause_on_failure) == (
        "weekly",
        "Europe/Berlin",
        True,
    )


def test_a_bad_key_in_the_settings_file_is_refused_at_load(tmp_path: Path) -> None:
    config = tmp_path / "toren.toml"
    config.write_text('[agents.reports.schedules.digest]\ncron = "0 7 * * *"\nevry = 60\n')
    with pytest.raises(ConfigError, match=r"unknown key\(s\) in \[agents.reports.schedules."
                       r"digest\] in .*toren.toml: evry"):  # fmt: skip
        Settings.load(config_file=config, env={})
