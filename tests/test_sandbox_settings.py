"""Sandbox settings without Docker: allow rules, sizes and durations, [agents.NAME.sandbox]
tables, the tools an agent gets, and the sandbox's state through a snapshot."""

from __future__ import annotations

import pytest

from toren import Agent, ConfigError
from toren._agent.tables import configured, read_agent_tables
from toren.sandboxes import Sandbox, allowed
from toren.sandboxes._settings import SANDBOX_PART

MODEL = "anthropic/claude-sonnet-4-6"

PARTS = {"sandbox": SANDBOX_PART}  # as toren.Settings hands them


@pytest.mark.parametrize(
    ("command", "rules", "runs_unasked"),
    [
        ("ls", ["ls"], True),
        ("ls -la", ["ls"], False),  # exact: the same words only
        ("ls  ", ["ls"], True),
        ("'ls'", ["ls"], True),  # the words a shell would see
        ("git log", ["git log *"], True),
        ("git log --oneline -3", ["git log *"], True),
        ("git logs", ["git log *"], False),
        ("git", ["git log *"], False),
        ("rm -rf /workspace", ["*"], True),  # "*" allows every plain command
        ("ls; rm -rf /", ["ls *", "*"], False),
        ("ls && rm -rf /", ["*"], False),
        ("ls & rm -rf /", ["*"], False),
        ("git status | sh", ["git status *", "*"], False),
        ("ls\nrm -rf /", ["*"], False),
        ("ls\rrm", ["*"], False),
        ("echo `id`", ["echo *"], False),
        ("echo $(id)", ["echo *"], False),
        ("echo $HOME", ["echo *"], False),
        ("echo hi > /workspace/x", ["echo *"], False),
        ("cat < /etc/passwd", ["cat *"], False),
        ("echo 'a;b'", ["echo *"], False),  # quoting does not help: the raw text is checked
        ("(ls)", ["*"], False),
        ("ls\0", ["*"], False),
        ("echo 'unclosed", ["echo *"], False),  # not a command a shell would split
        ("", ["*"], False),
        ("ls", [], False),
    ],
)
def test_allow_rules_match_whole_words_and_never_shell_control_syntax(
    command: str, rules: list[str], runs_unasked: bool
) -> None:
    assert allowed(command, rules) is runs_unasked
    agent = Agent(name="a", model=MODEL, sandbox=Sandbox(allow=rules))
    bash = agent.tool_named("bash")
    assert bash is not None
    assert bash.needs_approval({"command": command}) is not runs_unasked


@pytest.mark.parametrize(
    ("rules", "says"),
    [
        (["ls; rm"], "shell control syntax"),
        (["* ls"], "only be the last word"),
        ([""], "is not a command"),
        (["'unclosed"], "is not a command"),
        ("ls", "a list of commands"),
    ],
)
def test_bad_allow_rules_are_refused(rules: object, says: str) -> None:
    with pytest.raises(ConfigError, match=says):
        Sandbox(allow=rules)  # type: ignore[arg-type]


def test_sizes_durations_and_limits_are_parsed_and_checked() -> None:
    box = Sandbox(memory="1GiB", workspace_size="64MiB", output_cap="4KiB", command_timeout="2m")
    assert (box.memory, box.workspace_size, box.output_cap) == (2**30, 64 * 2**20, 4096)
    assert box.command_timeout == 120.0
    for bad in (
        {"memory": "lots"},
        {"memory": "1MiB"},
        {"memory": True},
        {"output_cap": 10},
        {"command_timeout": "forever"},
        {"pids": 3},
        {"cpus": 0},
        {"image": "two words"},
        {"network": ""},
    ):
        with pytest.raises(ConfigError):
            Sandbox(**bad)  # type: ignore[arg-type]
    assert Sandbox.from_args(box.as_args()) == box
    assert Sandbox.from_args({**box.as_args(), "from_a_newer_version": 1}) == box


def test_a_sandbox_gives_the_model_four_tools_and_bash_is_at_most_once() -> None:
    agent = Agent(name="a", model=MODEL, sandbox=Sandbox())
    assert [t.name for t in agent.all_tools] == ["bash", "read_file", "write_file", "list_files"]
    assert agent.tools == ()
    tools = {t.name: t for t in agent.all_tools}
    assert (tools["bash"].effects, tools["bash"].idempotency) == ("external", "at_most_once")
    assert not tools["bash"].dangerous
    assert tools["read_file"].effects == "read"
    rerun = Agent(name="b", model=MODEL, sandbox=Sandbox(rerunnable=True))
    assert rerun.tool_named("bash").idempotency == "unkeyed"  # type: ignore[union-attr]
    # The settings are not in what the model is told: changing a limit changes no request.
    tight = Agent(name="a", model=MODEL, sandbox=Sandbox(command_timeout="5s", output_cap=2048))
    assert [t.description for t in tight.all_tools] == [t.description for t in agent.all_tools]
    with pytest.raises(ConfigError, match="duplicate tool names"):
        Agent(name="c", model=MODEL, sandbox=Sandbox(), tools=[tools["read_file"]])


def test_a_sandbox_table_replaces_the_codes_values_key_by_key() -> None:
    agent = Agent(name="coder", model=MODEL, sandbox=Sandbox(memory="256MiB", allow=["ls"]))
    raw = {"coder": {"sandbox": {"memory": "1GiB", "network": "host"}}}
    merged = configured(agent, read_agent_tables(raw, "t.toml", PARTS)["coder"], "t.toml")
    assert merged.sandbox is not None
    assert (merged.sandbox.memory, merged.sandbox.network) == (2**30, "host")
    assert merged.sandbox.allow == ("ls",)  # kept from the code
    for table, says in (
        ({"sandbox": {"memry": "1GiB"}}, "unknown key"),
        ({"sandbox": "big"}, "must be a table"),
        ({"sandbox": {"memory": "lots"}}, r"\[agents.coder.sandbox\] in t.toml"),
        ({"sandbox": {"rerunnable": "yes"}}, "true or false"),
        ({"sandbox": {"allow": "ls"}}, "list of commands"),
    ):
        with pytest.raises(ConfigError, match=says):
            configured(
                agent, read_agent_tables({"coder": table}, "t.toml", PARTS)["coder"], "t.toml"
            )
    plain = Agent(name="coder", model=MODEL)
    with pytest.raises(ConfigError, match="has no sandbox in its code"):
        configured(plain, read_agent_tables(raw, "t.toml", PARTS)["coder"], "t.toml")


def test_the_sandbox_state_goes_through_a_snapshot_unchanged() -> None:
    import toren.runs  # noqa: F401  (registers the snapshot hooks)
    from toren._core.json_text import dumps, loads
    from toren._core.snapshots import _state as read_state
    from toren._core.snapshots import encode as encode_snapshot
    from toren.sandboxes import (
        Checkpointed,
        CommandFinished,
        CommandIntended,
        SandboxCreated,
        SandboxState,
        fold,
    )

    events = [
        SandboxCreated(container_id="c1", name="toren-x", image="i"),
        CommandIntended(call_id="a", tool="bash", arguments={"command": "ls"}, marker="m1"),
        CommandFinished(
            call_id="a", state="finished", exit_code=0, content="x\0\ud800y", is_error=False
        ),
        Checkpointed(checkpoint="k1", files=1, bytes=2, uploaded_bytes=3, blobs_uploaded=1),
        CommandIntended(call_id="b", tool="bash", arguments={"command": "sleep 9"}, marker="m2"),
    ]
    state = SandboxState()
    for event in events:
        state = fold(state, event)
    snap = encode_snapshot(state, len(events))
    assert read_state(dict(snap.chunks), loads(dumps(snap.row)), SandboxState) == state
    assert set(state.open) == {"b"}
    assert (state.checkpoint, state.finished, state.status) == ("k1", 1, "running")
