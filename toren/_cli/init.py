"""``toren init NAME``: a small app to start from, runnable and tested offline.

It writes ``NAME/`` holding a package ``NAME`` (``app.py``: one agent with one tool that asks for
approval; ``model.py``: an offline model script for it), ``tests/test_NAME.py`` (run through
:func:`toren.testing.harness`), ``toren.toml`` and a README saying how to run and test it.
"""

from __future__ import annotations

import keyword
import sys
from importlib.machinery import PathFinder
from pathlib import Path

import click

from toren._cli.common import out, print_error
from toren._core.errors import ConfigError
from toren._core.terminal import plain

README = """\
# {name}

A Toren app: one agent, `{name}` (in `{name}/app.py`), with one tool, `send_message`, that asks
a human before it runs. `{name}/model.py` is an offline model script: it answers in Toren's own
terms (the conversation in, text and tool calls out), so everything runs with no provider key.

Run it offline, from this directory:

```
toren dev --app {name}.app --model-script {name}.model:script
toren run {name} "Tell the team the release is out" --wait   # a second terminal: it parks
toren jobs approve RUN                                          # then: toren jobs show RUN
```

Test it (`pip install pytest` first; Postgres is embedded): `pytest`.

With a real model, set `ANTHROPIC_API_KEY` and leave the script out: `toren dev --app {name}.app`.
Settings that are not code (budgets, worker limits) are in `toren.toml`.
"""

SETTINGS = """\
# Settings that are not code (see Toren's docs/reference.md, "Settings"). Worker settings go at
# the top level or under [worker]; TOREN_* environment variables override them.
# max_actors = 100

# [agents.NAME] replaces what Agent(...) says in code, key by key, without a deploy.
[agents.{name}]
budget_usd = 0.5
"""

CONFTEST = '''\
"""pytest: this directory is put on sys.path (so the tests import {name}), and async tests run
on asyncio."""

import pytest


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"
'''

APP = '''\
"""The {name} agent: passes messages on, asking a human before each one is sent."""

from toren import Agent, ToolContext, tool


@tool(effects="external", idempotency="keyed", approval="always")
async def send_message(ctx: ToolContext, to: str, text: str) -> str:
    """Send a message to a person or a team."""
    # Call your system here, passing ctx.idempotency_key on: a retried step sends once.
    return f"sent to {{to}}"


{name} = Agent(
    name="{name}",
    model="anthropic/claude-sonnet-4-6",
    system="You pass messages on to the team. Use send_message.",
    tools=[send_message],
    budget_usd=1.0,
)
'''

MODEL = '''\
"""An offline model for {name}: it reads the conversation (Toren messages) and answers with
text and tool calls. `toren dev --model-script {name}.model:script` and the tests use it."""

from toren.testing import ModelRequest, Reply, ToolCall, Usage, latest_results, latest_text, turns

USAGE = Usage(input_tokens=300, output_tokens=30)  # reported, and priced, for each call


def script(request: ModelRequest) -> Reply:
    """Send the task (or a message sent to the run later) on to the team, then say whether
    it went."""
    results = latest_results(request)
    if not results:  # the latest turn is a person's text: the task, or a later message
        arguments = {{"to": "team", "text": latest_text(request)}}
        call_id = f"send-{{turns(request) + 1}}"  # each call an id of its own
        call = ToolCall(id=call_id, name="send_message", arguments=arguments)
        return Reply(["I will pass that on.", call], usage=USAGE)
    result = results[0]
    if result.is_error:
        return Reply(f"Not sent: {{result.content}}.", usage=USAGE)
    return Reply(f"Done: {{result.content}}.", usage=USAGE)
'''

TEST = '''\
"""{name} on a real worker and Postgres (embedded, unless TOREN_DATABASE_URL names a server),
its model scripted offline by {name}.model."""

from pathlib import Path

import pytest
from toren.testing import harness

from {name}.model import USAGE, script

pytestmark = pytest.mark.anyio

SETTINGS = Path(__file__).resolve().parent.parent / "toren.toml"
TASK = "Tell the team the release is out."


async def test_it_asks_before_sending_then_sends() -> None:
    async with harness("{name}.app", script, config=SETTINGS) as h:
        run_id = await h.start("{name}", TASK)
        [call] = await h.waiting(run_id)
        assert call.name == "send_message"
        assert call.arguments == {{"to": "team", "text": TASK}}

        await h.approve(run_id)
        state = await h.wait(run_id, "completed")
        assert state.output == "Done: sent to team."
        receipt = await h.receipt(run_id)
        assert receipt.calls_made == 2
        assert receipt.input_tokens == 2 * USAGE.input_tokens
        assert receipt.usd_paid > 0


async def test_a_denied_message_is_not_sent() -> None:
    async with harness("{name}.app", script, config=SETTINGS) as h:
        run_id = await h.start("{name}", TASK)
        await h.deny(run_id, reason="not yet")
        state = await h.wait(run_id, "completed")
        assert state.output is not None
        assert state.output.startswith("Not sent: denied")
'''


def check_name(name: str) -> None:
    """Refuse a name that cannot be the app's package (and agent) name.

    Raises:
        ConfigError: it is not a Python identifier, is a keyword, or is already a module.
    """
    hint = "Pick a lower-case Python identifier that is not a module yet, e.g. support_desk."
    # ASCII only: Python reads a module name in its NFKC form (a package written in full-width
    # letters is imported by their ASCII forms), and TOML's bare keys ([agents.NAME]) are ASCII.
    if not name.isascii() or not name.isidentifier() or keyword.iskeyword(name):
        raise ConfigError(
            f"{name!r} is not a Python identifier of ASCII letters, digits and _", hint=hint
        )
    if name in ("conftest", "tests"):  # the app's own conftest.py and tests/
        raise ConfigError(f"{name!r} is a name the app's own files take", hint=hint)
    elsewhere = [p for p in sys.path if p not in ("", str(Path.cwd()))]  # not what init wrote
    if name in sys.stdlib_module_names or PathFinder.find_spec(name, elsewhere) is not None:
        raise ConfigError(f"{name!r} is already a Python module; the app would hide it", hint=hint)


def files(name: str) -> dict[str, str]:
    """The files of a new app ``name``, by path relative to its directory."""
    return {
        "README.md": README.format(name=name),
        "toren.toml": SETTINGS.format(name=name),
        "conftest.py": CONFTEST.format(name=name),
        f"{name}/__init__.py": f'"""The {name} app."""\n',
        f"{name}/app.py": APP.format(name=name),
        f"{name}/model.py": MODEL.format(name=name),
        f"tests/test_{name}.py": TEST.format(name=name),
    }


def write_app(name: str, parent: Path) -> Path:
    """Write the app ``name`` into ``parent/name``; returns that directory.

    Raises:
        ConfigError: the name is refused (see :func:`check_name`), or ``parent/name`` exists
            and is not an empty directory (nothing is written then).
    """
    check_name(name)  # first: a name is never a path
    target = parent / name
    if target.is_symlink() or (target.exists() and (not target.is_dir() or any(target.iterdir()))):
        raise ConfigError(
            f"{target} already exists and is not an empty directory; nothing was written",
            hint="Choose another name, or run `toren init` in another directory.",
        )
    for path, text in files(name).items():
        destination = target / path
        destination.parent.mkdir(parents=True, exist_ok=True)
        destination.write_text(text)
    return target


def register(main: click.Group) -> None:
    """Add ``toren init`` to the command line."""

    @main.command("init")
    @click.argument("name")
    def init(name: str) -> None:
        """Write NAME/, a small app to start from. One agent, one tool that asks for approval,
        its offline model script, its test and a settings file. Exit 2 if NAME is not a Python
        identifier or NAME/ exists and is not empty."""
        try:
            target = write_app(name, Path.cwd())
        except ConfigError as exc:
            print_error(exc)
            sys.exit(2)
        out.print(
            plain(f"wrote {target}/ (README.md says how to run and test it). Next:"), soft_wrap=True
        )
        out.print(
            f"  cd {name}\n"
            f"  toren dev --app {name}.app --model-script {name}.model:script\n"
            "  pytest                # after pip install pytest",
            highlight=False,
            soft_wrap=True,
        )
