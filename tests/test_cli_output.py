"""What the command line tells a newcomer: quiet logs by default, boot-time warnings that say
what is missing, and errors in their own module that name the real cause."""

from __future__ import annotations

import logging
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

import anyio
import click
import pytest

from tests.conftest import ROOT, running_worker, wait_for
from tests.test_cli import toren as run_toren
from toren import Client
from toren._core.logs import OWN_LOGGERS, configure, show_info_from

pytestmark = pytest.mark.anyio


def toren(
    *args: str, cwd: Path = ROOT, db_url: str = "postgresql://nobody@/nowhere", **env: str
) -> subprocess.CompletedProcess[str]:
    """``toren ARGS`` in a process with no provider key (unless given in ``env``)."""
    keys = {"ANTHROPIC_API_KEY": "", "OPENAI_API_KEY": ""}
    return run_toren(*args, db_url=db_url, cwd=cwd, **(keys | env))


@pytest.fixture
def logging_restored() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    names = [*OWN_LOGGERS, "myapp"]
    levels = {name: logging.getLogger(name).level for name in names}
    yield
    root.handlers[:] = handlers
    root.setLevel(level)
    for name, old in levels.items():
        logging.getLogger(name).setLevel(old)


def test_by_default_only_toren_and_the_app_log_info(logging_restored: None) -> None:
    configure()
    show_info_from("myapp")
    for name in ("toren.worker", "supervisors._supervisor", "myapp.tools"):
        assert logging.getLogger(name).isEnabledFor(logging.INFO), name
    for name in ("pgserver", "httpx2", "anthropic._base_client", "aiohttp.access"):
        assert not logging.getLogger(name).isEnabledFor(logging.INFO), name
        assert logging.getLogger(name).isEnabledFor(logging.WARNING), name


def test_a_chosen_level_applies_to_every_library(logging_restored: None) -> None:
    configure("info")
    show_info_from("myapp")
    assert logging.getLogger("pgserver").isEnabledFor(logging.INFO)
    assert not logging.getLogger("pgserver").isEnabledFor(logging.DEBUG)
    configure("WARNING")
    show_info_from("myapp")
    assert not logging.getLogger("toren.worker").isEnabledFor(logging.INFO)
    assert not logging.getLogger("myapp").isEnabledFor(logging.INFO)


def test_an_app_that_configures_logging_itself_keeps_its_levels(logging_restored: None) -> None:
    configure("ERROR")
    logging.basicConfig(force=True, level=logging.ERROR)  # the app, at its import
    show_info_from("myapp")
    assert not logging.getLogger("myapp").isEnabledFor(logging.INFO)
    assert logging.getLogger("myapp").getEffectiveLevel() == logging.ERROR


def test_an_unknown_log_level_is_a_usage_error() -> None:
    result = toren("--log-level", "LOUD", "workers")
    assert result.returncode == 2
    assert "LOUD" in result.stderr
    assert "Traceback" not in result.stderr


async def test_a_worker_without_an_app_warns_that_it_runs_no_agents(empty_db_url: str) -> None:
    # Against an unmigrated database the worker stops right after its boot checks (exit 2).
    result = await anyio.to_thread.run_sync(lambda: toren("worker", db_url=empty_db_url))
    assert result.returncode == 2
    assert "no --app: this worker runs no agents" in result.stderr
    assert "toren worker --app MODULE" in result.stderr


async def test_a_missing_provider_key_is_warned_once_per_agent_at_boot(empty_db_url: str) -> None:
    result = await anyio.to_thread.run_sync(
        lambda: toren("worker", "--app", "tests.run_app", db_url=empty_db_url)
    )
    assert result.returncode == 2
    warnings = [line for line in result.stderr.splitlines() if "is not set: its runs" in line]
    assert (
        "agent support uses anthropic/claude-sonnet-4-6, but ANTHROPIC_API_KEY is not set"
        in result.stderr
    )
    assert "agent support_openai uses openai/gpt-4o, but OPENAI_API_KEY is not set" in (
        result.stderr
    )
    assert not any("support_bedrock" in line for line in warnings)  # found by its own chain
    assert len([line for line in warnings if "agent support uses" in line]) == 1
    keyed = await anyio.to_thread.run_sync(
        lambda: toren(
            "worker",
            "--app",
            "tests.run_app",
            db_url=empty_db_url,
            ANTHROPIC_API_KEY="k",
            OPENAI_API_KEY="k",
        )
    )
    assert keyed.returncode == 2
    assert "is not set: its runs" not in keyed.stderr


@pytest.fixture
def user_dir(tmp_path: Path) -> Path:
    (tmp_path / "missing_dep.py").write_text("import os\nimport requests_not_installed_xyz\n")
    (tmp_path / "bad_syntax.py").write_text("x = 1\ndef f(:\n    pass\n")
    (tmp_path / "bad_name.py").write_text("from os import no_such_name_xyz\n")
    (tmp_path / "raises.py").write_text("import raises_helper\n")
    (tmp_path / "raises_helper.py").write_text("x = {}\ny = x['nope']\n")
    # A script turned app: its main() runs (and exits) at import.
    (tmp_path / "exits.py").write_text("import sys\n\ndef main():\n    sys.exit(0)\n\nmain()\n")
    (tmp_path / "base_raises.py").write_text(
        "class Boom(BaseException):\n    pass\nraise Boom('x')\n"
    )
    return tmp_path


@pytest.mark.parametrize(
    ("module", "says"),
    [
        (
            "missing_dep",
            [
                "app module 'missing_dep' failed to import: No module named "
                "'requests_not_installed_xyz'",
                "at missing_dep.py:2: import requests_not_installed_xyz",
                "Install the missing package",
            ],
        ),
        (
            "bad_syntax",
            [
                "app module 'bad_syntax' has a syntax error: bad_syntax.py, line 2: invalid syntax",
                "\n    def f(:\n          ^\n",
            ],
        ),
        (
            "bad_name",
            ["cannot import name 'no_such_name_xyz' from 'os'", "at bad_name.py:1: from os import"],
        ),
        (
            "raises",
            [
                "app module 'raises' failed to import: KeyError: 'nope'",
                "at raises.py:1: import raises_helper\n  at raises_helper.py:2: y = x['nope']",
            ],
        ),
        (  # not a silent exit 0 (a container would restart it forever, saying nothing)
            "exits",
            [
                "app module 'exits' called sys.exit(0) while it was imported",
                "at exits.py:6: main()\n  at exits.py:4: sys.exit(0)",
                'if __name__ == "__main__":',
            ],
        ),
        (
            "base_raises",
            ["app module 'base_raises' failed to import: Boom: x", "at base_raises.py:3"],
        ),
    ],
)
def test_an_error_inside_the_app_module_names_its_real_cause(
    user_dir: Path, module: str, says: list[str]
) -> None:
    for command in (("worker", "--app", module), ("agents", "check", "--app", module)):
        result = toren(*command, cwd=user_dir)
        assert result.returncode == 2, result.stderr
        for text in says:
            assert text in result.stderr, result.stderr
        assert "Traceback" not in result.stderr
        assert "importlib" not in result.stderr
        assert "toren/_agent/app.py" not in result.stderr


def test_an_app_module_that_is_not_there_is_named_as_such(user_dir: Path) -> None:
    result = toren("worker", "--app", "not_here_xyz", cwd=user_dir)
    assert result.returncode == 2
    assert "cannot import app module 'not_here_xyz': No module named 'not_here_xyz'" in (
        result.stderr
    )
    assert "--app (or TOREN_APP)" in result.stderr


async def test_piped_output_keeps_each_line_whole(
    client: Client, db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from toren._agent.app import load_app
    from toren.runs import read_run, start_run
    from toren.testing import AnthropicServer, Reply

    load_app("tests.run_app")
    text = "please " + "refund " * 60 + "order A-17"  # far wider than any terminal

    async with AnthropicServer([Reply("Done.")]) as server:
        for name, value in server.env().items():
            monkeypatch.setenv(name, value)
        async with running_worker(db_url):
            run_id = await start_run(client, "support", text)

            async def completed() -> bool:
                return (await read_run(client, run_id)).status == "completed"

            await wait_for(completed, what="the run completed")
    shown = await anyio.to_thread.run_sync(lambda: toren("jobs", "show", run_id, db_url=db_url))
    assert shown.returncode == 0, shown.stderr
    first, second = shown.stdout.splitlines()[:2]
    assert first.startswith("   1  started support: please refund refund")
    assert len(first) > 200  # as the run's text is shown (cut by Toren, not by the width)
    assert second.startswith("   2  ")  # the next event, not the rest of the first


def _summaries(help_text: str) -> dict[str, list[str]]:
    """Each command's summary in a ``--help`` listing, as the lines it takes."""
    rows: dict[str, list[str]] = {}
    for line in help_text.split("\nCommands:\n", 1)[1].splitlines():
        if named := re.fullmatch(r"  (\S+)  +(\S.*)", line):
            rows[named[1]] = [named[2]]
        elif line.startswith("   ") and rows:  # a summary wrapped onto the next line
            rows[list(rows)[-1]].append(line.strip())
    return rows


def _cut_summaries(label: str, group: click.Group, help_text: str) -> list[str]:
    """The commands whose summary in the listing is not their help's first sentence, whole,
    on one line."""
    rows = _summaries(help_text)
    assert set(rows) == {n for n, c in group.commands.items() if not c.hidden}, help_text
    cut = []
    for name, lines in rows.items():
        summary = " ".join(lines)
        help_words = " ".join((group.commands[name].help or "").split())
        if len(lines) > 1 or not summary.endswith(".") or not help_words.startswith(summary):
            cut.append(f"{label} {name}: {summary!r}")
    return cut


def test_the_top_level_help_lists_every_command_with_a_whole_sentence() -> None:
    from toren.cli import main

    result = toren("--help", COLUMNS="80")
    assert result.returncode == 0, result.stderr
    assert max(len(line) for line in result.stdout.splitlines()) <= 80
    assert _cut_summaries("toren", main, result.stdout) == []


def test_every_command_group_lists_its_commands_with_whole_sentences(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from toren.cli import main

    monkeypatch.setenv("COLUMNS", "80")  # the width click reads, as in an 80-column terminal

    def groups(group: click.Group, name: str) -> list[tuple[str, click.Group]]:
        found = [(name, group)]
        for sub, command in group.commands.items():
            if isinstance(command, click.Group):
                found += groups(command, f"{name} {sub}")
        return found

    cut = []
    for name, group in groups(main, "toren"):
        with click.Context(group, info_name=name) as ctx:
            cut += _cut_summaries(name, group, group.get_help(ctx))
    assert cut == []
