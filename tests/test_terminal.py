"""Run text printed by the CLI is inert: terminal escapes, bidi overrides and rich markup in
model output, inputs, messages, errors and names print as visible text, never as effects (and
never crash the command)."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import unicodedata
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import pytest
from hypothesis import given
from hypothesis import strategies as st
from rich.console import Console
from rich.table import Table

from tests import app
from tests.conftest import ROOT, WorkerFactory, wait_for, worker_registered
from tests.test_cli import toren
from toren import Client
from toren._agent.model import ToolCall
from toren._cli.common import print_error
from toren._core.errors import ConfigError
from toren._core.terminal import plain, printable
from toren.runs import read_run, start_run
from toren.testing import AnthropicServer, Reply

pytestmark = pytest.mark.anyio

# Each sequence is what an attacker's text would do to the terminal printing it.
SGR = "\x1b[31m"  # red from here on
OSC8 = "\x1b]8;;http://evil\x1b\\"  # a hidden hyperlink
OSC0 = "\x1b]0;pwned\x07"  # the window title
CSI_C1 = "\x9b2J"  # clear the screen, with the one-byte C1 introducer
RLO = "\u202e"  # right-to-left override
LINK = "[link=http://evil]x[/link]"  # rich markup: a hidden hyperlink
CLOSE = "[/oops]"  # rich markup that does not parse: MarkupError


def hostile(word: str) -> str:
    """Text carrying every attack, marked with ``word`` to say where it came from."""
    return f"{SGR}{word} {OSC8}{word} {OSC0} {CSI_C1} {RLO}{word} {LINK} {CLOSE} [bold red]{word}"


def assert_inert(printed: str, *words: str) -> None:
    """No control character reached the terminal; the text is all there, escaped."""
    for raw in ("\x1b", "\x07", "\x9b", RLO):
        assert raw not in printed, (raw, printed)
    for word in words:
        assert rf"\x1b[31m{word}" in printed, printed
        assert rf"\x1b]8;;http://evil\x1b\{word}" in printed, printed
        assert rf"\u202e{word}" in printed, printed
    assert r"\x1b]0;pwned\x07" in printed
    assert r"\x9b2J" in printed
    assert LINK in printed
    assert CLOSE in printed
    assert "[bold red]" in printed


# The escaping function.


@pytest.mark.parametrize(
    ("raw", "shown"),
    [
        ("\x1b", r"\x1b"),
        ("\x00", r"\x00"),
        ("\x07", r"\x07"),
        ("\x08", r"\x08"),
        ("\r", r"\x0d"),
        ("\x7f", r"\x7f"),
        ("\x85", r"\x85"),
        ("\x9b", r"\x9b"),
        ("\x9f", r"\x9f"),
    ],
)
def test_control_characters_are_shown_as_hex_escapes(raw: str, shown: str) -> None:
    assert printable(f"a{raw}b") == f"a{shown}b"


@pytest.mark.parametrize("code", [*range(0x202A, 0x202F), *range(0x2066, 0x206A)])
def test_bidi_overrides_and_isolates_are_shown_as_unicode_escapes(code: int) -> None:
    assert printable(f"a{chr(code)}b") == f"a\\u{code:04x}b"


def test_lone_surrogates_are_shown_as_escapes() -> None:
    shown = printable("a\ud800b\udfff")
    assert shown == r"a\ud800b\udfff"
    shown.encode()  # printable means encodable, too


def test_newlines_tabs_and_ordinary_text_are_kept_as_they_are() -> None:
    text = "line one\n\tline two: caf\u00e9, \u6f22\u5b57, \U0001f600, C:\\path, [b]x[/b], \xa0"
    assert printable(text) is text


@given(st.text(alphabet=st.characters(exclude_categories=())))  # surrogates too
def test_printable_text_holds_no_control_character_but_newline_and_tab(text: str) -> None:
    shown = printable(text)
    shown.encode()
    assert printable(shown) == shown  # escaping twice is escaping once
    for char in shown:
        assert char in "\n\t" or unicodedata.category(char) not in ("Cc", "Cs"), repr(char)
        assert not 0x202A <= ord(char) <= 0x202E, repr(char)
        assert not 0x2066 <= ord(char) <= 0x2069, repr(char)


def _print(renderable: object) -> str:
    buffer = io.StringIO()
    Console(file=buffer, width=200, color_system=None).print(renderable)
    return buffer.getvalue()


def test_plain_text_is_never_read_as_markup() -> None:
    text = f"{CLOSE} {LINK} [bold red]x :smile:"
    assert _print(plain(text)) == text + "\n"


def test_plain_text_in_a_table_cell_prints_inert() -> None:
    table = Table()
    table.add_column("error")
    table.add_row(plain(hostile("CELL")))
    assert_inert(_print(table), "CELL")


# End to end: the commands that print run text.


@pytest.fixture
async def model(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[AnthropicServer]:
    """The scripted model for run workers started after it (add its replies first)."""
    async with AnthropicServer() as server:
        for name, value in server.env().items():
            monkeypatch.setenv(name, value)
        yield server


async def _status(client: Client, run_id: str, status: str) -> bool:
    return (await read_run(client, run_id)).status == status


async def _parked_hostile_run(client: Client, db_url: str) -> str:
    """A run of ``support`` with hostile input, parked on an approval, with a hostile message
    queued: approving it lets the run read the message and answer with hostile output."""
    started = await anyio.to_thread.run_sync(
        lambda: toren("run", "support", hostile("IN"), db_url=db_url)
    )
    assert started.returncode == 0, started.stderr
    run_id = started.stdout.split()[0]
    await wait_for(lambda: _status(client, run_id, "parked"), what="parked")
    sent = await anyio.to_thread.run_sync(
        lambda: toren("jobs", "send", run_id, hostile("MSG"), db_url=db_url)
    )
    assert sent.returncode == 0, sent.stderr
    return run_id


def _script_hostile_run(model: AnthropicServer) -> None:
    model.add(
        Reply([ToolCall(id="r1", name="refund", arguments={"amount": 250})]),
        Reply(hostile("OUT")),
    )


async def test_run_wait_prints_hostile_output_inert(
    client: Client, db_url: str, workers: WorkerFactory, model: AnthropicServer
) -> None:
    model.add(Reply(hostile("OUT")))
    workers(app="tests.run_app")
    result = await anyio.to_thread.run_sync(
        lambda: toren("run", "support", hostile("IN"), "--wait", db_url=db_url)
    )
    assert result.returncode == 0, result.stderr
    assert "completed: " in result.stdout
    assert_inert(result.stdout, "OUT")


async def test_jobs_show_prints_hostile_input_message_and_output_inert(
    client: Client, db_url: str, workers: WorkerFactory, model: AnthropicServer
) -> None:
    _script_hostile_run(model)
    workers(app="tests.run_app")
    run_id = await _parked_hostile_run(client, db_url)
    approved = await anyio.to_thread.run_sync(
        lambda: toren("jobs", "approve", run_id, db_url=db_url)
    )
    assert approved.returncode == 0, approved.stderr
    await wait_for(lambda: _status(client, run_id, "completed"), what="completed")
    shown = await anyio.to_thread.run_sync(lambda: toren("jobs", "show", run_id, db_url=db_url))
    assert shown.returncode == 0, shown.stderr
    assert "message from " in shown.stdout
    assert_inert(shown.stdout, "IN", "MSG", "OUT")
    # The JSON form keeps the text exactly (JSON escapes are inert themselves).
    as_json = await anyio.to_thread.run_sync(
        lambda: toren("jobs", "show", run_id, "--json", db_url=db_url)
    )
    assert as_json.returncode == 0, as_json.stderr
    assert "\x1b" not in as_json.stdout
    record = json.loads(as_json.stdout)
    assert (record["input"], record["output"]) == (hostile("IN"), hostile("OUT"))


async def test_jobs_tail_follows_a_run_and_prints_hostile_text_inert(
    client: Client, db_url: str, workers: WorkerFactory, model: AnthropicServer, tmp_path: Path
) -> None:
    _script_hostile_run(model)
    workers(app="tests.run_app")
    run_id = await _parked_hostile_run(client, db_url)
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOREN_")}
    env.update({"PYTHONPATH": str(ROOT), "TOREN_DATABASE_URL": db_url})
    printed = tmp_path / "tail.out"
    with printed.open("w") as stdout:
        tail = subprocess.Popen(
            [sys.executable, "-m", "toren", "jobs", "tail", run_id],
            env=env,
            cwd=ROOT,
            stdout=stdout,
            stderr=subprocess.PIPE,
            text=True,
        )
    try:

        async def following() -> bool:
            assert tail.poll() is None, tail.stderr.read() if tail.stderr else ""
            return "approval requested" in printed.read_text()

        await wait_for(following, what="the tail to print the parked run")
        approved = await anyio.to_thread.run_sync(
            lambda: toren("jobs", "approve", run_id, db_url=db_url)
        )
        assert approved.returncode == 0, approved.stderr
        _, errors = await anyio.to_thread.run_sync(lambda: tail.communicate(timeout=60))
    finally:
        if tail.poll() is None:
            tail.kill()
            tail.wait(10)
    assert tail.returncode == 0, errors
    assert "completed: " in printed.read_text()
    assert_inert(printed.read_text(), "IN", "MSG", "OUT")


async def test_jobs_list_prints_a_hostile_agent_name_inert(client: Client, db_url: str) -> None:
    run_id = await start_run(client, "support", "hi")
    # A run recorded before agent names were checked: its route names the agent.
    agent = f"{CLOSE}{SGR}{RLO}agent"
    await client.pool.execute(
        "UPDATE toren.actors SET route = 'agent:' || $1 WHERE actor_id = $2", agent, run_id
    )
    listed = await anyio.to_thread.run_sync(lambda: toren("jobs", "list", db_url=db_url))
    assert listed.returncode == 0, listed.stderr
    assert rf"{CLOSE}\x1b[31m\u202eagent" in listed.stdout
    assert "\x1b" not in listed.stdout


async def test_an_error_naming_hostile_text_prints_it_inert(db_url: str) -> None:
    shown = await anyio.to_thread.run_sync(
        lambda: toren("jobs", "show", f"run/{CLOSE}{LINK}{OSC0}", db_url=db_url)
    )
    assert shown.returncode == 2, shown.stderr  # no such run: a configuration error
    assert "Traceback" not in shown.stderr
    assert f"error: no run 'run/{CLOSE}{LINK}" in shown.stderr
    assert "\x1b" not in shown.stderr


def test_print_error_prints_the_message_inert(capsys: pytest.CaptureFixture[str]) -> None:
    print_error(ConfigError(hostile("ERR")))
    assert_inert(capsys.readouterr().err, "ERR")


async def test_tokens_create_and_list_print_a_name_with_markup_inert(db_url: str) -> None:
    name = f"{CLOSE} {LINK} [bold red]ci"  # printable, so a valid name
    created = await anyio.to_thread.run_sync(lambda: toren("tokens", "create", name, db_url=db_url))
    assert created.returncode == 0, created.stderr
    assert created.stdout.startswith("trn_")  # the secret is shown, once
    assert f"({name})" in created.stderr
    listed = await anyio.to_thread.run_sync(lambda: toren("tokens", "list", db_url=db_url))
    assert listed.returncode == 0, listed.stderr
    assert LINK in listed.stdout
    assert CLOSE in listed.stdout


async def test_workers_prints_a_hostile_worker_name_inert(
    client: Client, db_url: str, workers: WorkerFactory
) -> None:
    w = workers(worker_name=f"{CLOSE}{SGR}w")
    await wait_for(lambda: worker_registered(client, w.pid), what="the worker")
    table = await anyio.to_thread.run_sync(lambda: toren("workers", db_url=db_url))
    assert table.returncode == 0, table.stderr
    assert rf"{CLOSE}\x1b[31mw" in table.stdout
    assert "\x1b" not in table.stdout


async def test_deadletters_print_a_hostile_error_inert(
    client: Client, db_url: str, workers: WorkerFactory
) -> None:
    await client.spawn(app.Fragile, "fragile/hostile")
    await client.send("fragile/hostile", app.Boom(tag=f"{CLOSE}{SGR}x"))
    workers()
    await wait_for(lambda: client.deadletters(), what="the dead letter")
    table = await anyio.to_thread.run_sync(lambda: toren("deadletters", db_url=db_url))
    assert table.returncode == 0, table.stderr
    assert rf"cannot handle {CLOSE}\x1b[31mx" in table.stdout
    assert "\x1b" not in table.stdout
    as_json = await anyio.to_thread.run_sync(lambda: toren("deadletters", "--json", db_url=db_url))
    assert as_json.returncode == 0, as_json.stderr
    [item] = json.loads(as_json.stdout)
    assert item["error"].endswith(f"cannot handle {CLOSE}{SGR}x")


# The JSON forms: escaped (inert), and the exact text once parsed.

RAW_CONTROLS = ("\x1b", "\x07", "\x9b", RLO)


async def test_workers_json_escapes_a_hostile_worker_name(
    client: Client, db_url: str, workers: WorkerFactory
) -> None:
    name = f"{CLOSE}{SGR}{CSI_C1}{RLO}w"
    w = workers(worker_name=name)
    await wait_for(lambda: worker_registered(client, w.pid), what="the worker")
    as_json = await anyio.to_thread.run_sync(lambda: toren("workers", "--json", db_url=db_url))
    assert as_json.returncode == 0, as_json.stderr
    for raw in RAW_CONTROLS:
        assert raw not in as_json.stdout, (raw, as_json.stdout)
    [item] = [i for i in json.loads(as_json.stdout) if i["pid"] == w.pid]
    assert item["name"] == name


async def test_deadletters_json_escapes_a_hostile_error(
    client: Client, db_url: str, workers: WorkerFactory
) -> None:
    tag = f"{CLOSE}{SGR}{CSI_C1}{RLO}{OSC0}x"
    await client.spawn(app.Fragile, "fragile/hostile")
    await client.send("fragile/hostile", app.Boom(tag=tag))
    workers()
    await wait_for(lambda: client.deadletters(), what="the dead letter")
    as_json = await anyio.to_thread.run_sync(lambda: toren("deadletters", "--json", db_url=db_url))
    assert as_json.returncode == 0, as_json.stderr
    for raw in RAW_CONTROLS:
        assert raw not in as_json.stdout, (raw, as_json.stdout)
    [item] = json.loads(as_json.stdout)
    assert item["error"].endswith(f"cannot handle {tag}")
    assert item["body"]["tag"] == tag


@pytest.mark.parametrize(
    ("raw", "shown"),
    [
        ("\u2028", "\\u2028"),  # a line separator: a fake line break
        ("\u200b", "\\u200b"),  # a zero-width space
        ("\ufeff", "\\ufeff"),
        ("\U000e0041", "\\U000e0041"),  # a tag letter: invisible text
    ],
)
def test_invisible_characters_that_break_a_line_or_hide_text_are_shown_as_escapes(
    raw: str, shown: str
) -> None:
    assert printable(f"a{raw}b") == f"a{shown}b"
    assert printable("a\u200db \U0001f468\u200d\U0001f469") == "a\u200db \U0001f468\u200d\U0001f469"
