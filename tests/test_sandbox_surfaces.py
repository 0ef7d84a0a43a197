"""What the CLI, the API and the console show of sandboxes, without Docker: ``toren sandboxes
list | reap``, the sandboxed calls of ``toren jobs show``, a sandboxed command's approval and
result on the console.

The journals are written here as the actors write them: the real events, encoded by the
project's codec, one row per event, and each actor's summary set from its real fold and
summary function (the kernel's step statement needs a lease and a message in hand, and the
surfaces only read rows)."""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path
from typing import Any

import anyio
import pytest

from tests.test_api import api, session
from tests.test_cli import toren
from tests.test_console import (  # noqa: F401  (chromium: a fixture)
    ARTIFACTS,
    _launch,
    _signed_in,
    chromium,
)
from toren import Client
from toren._agent.model import ModelResponse, StopReason, Text, ToolCall, Usage
from toren._core.codec import encode
from toren._core.journal import replay
from toren._surfaces.tokens import SCOPES, create_token
from toren.runs import (
    RUN_KIND,
    ApprovalDecided,
    ApprovalRequested,
    ModelCalled,
    RunCompleted,
    RunFailed,
    RunStarted,
    SandboxNoted,
    SandboxRequested,
    ToolIntended,
    ToolResulted,
    read_run,
)
from toren.runs import summary as run_summary
from toren.sandboxes import (
    DEFAULT_IMAGE,
    SANDBOX_KIND,
    SANDBOX_ROUTE,
    Checkpointed,
    CommandFinished,
    CommandIntended,
    SandboxCreated,
    SandboxReaped,
    SandboxState,
    SandboxStopped,
    fold,
    sandbox_address,
)
from toren.sandboxes import summary as sandbox_summary
from toren.sandboxes.listing import sandboxed_calls

pytestmark = pytest.mark.anyio

MODEL = "anthropic/claude-sonnet-4-6"
CHECKPOINT = "9f2c4e1a7b3d" + "0" * 52
HOSTILE = "<img src=x onerror=window.__owned=1><script>window.__owned=2</script>\x00NUL\u202eRTL\n"
LONG = "".join(f"<b>line {i}</b> " + "x" * 90 + "\n" for i in range(1000))  # ~110 KB


# --- journals as the actors write them --------------------------------------------------------


async def write(client: Client, actor_id: str, events: list[Any]) -> None:
    """Append ``events`` to ``actor_id``'s journal, as its steps would."""
    last = await client.pool.fetchval(
        "SELECT coalesce(max(seq), 0) FROM toren.journal WHERE actor_id = $1", actor_id
    )
    await client.pool.executemany(
        "INSERT INTO toren.journal (actor_id, seq, epoch, type, data) VALUES ($1, $2, 1, $3, $4)",
        [(actor_id, last + i, *encode(e)) for i, e in enumerate(events, 1)],
    )


def new_id() -> str:
    return f"run/{uuid.uuid4()}"


async def new_run(client: Client, run_id: str, agent: str, events: list[Any]) -> str:
    """Run ``run_id`` of ``agent`` whose journal holds ``events``, its row's summary from its
    fold."""
    await client.spawn(RUN_KIND, run_id, {"agent": agent}, route=f"agent:{agent}")
    await write(client, run_id, [RunStarted(agent=agent, input="build it", at=time.time())])
    await write(client, run_id, events)
    summary = run_summary(await read_run(client, run_id))
    await client.pool.execute(
        "UPDATE toren.actors SET summary = $2 WHERE actor_id = $1", run_id, summary
    )
    return run_id


async def new_sandbox(client: Client, run_id: str, events: list[Any]) -> str:
    """The run's sandbox actor (spawned by the run, as the run does), with ``events``."""
    sandbox_id = sandbox_address(run_id)
    await client.spawn(
        SANDBOX_KIND,
        sandbox_id,
        {"run": run_id, "settings": {}},
        parent=run_id,
        route=SANDBOX_ROUTE,
    )
    await write(client, sandbox_id, events)
    state = (await replay(client.pool, sandbox_id, SandboxState(), fold)).state
    await client.pool.execute(
        "UPDATE toren.actors SET summary = $2 WHERE actor_id = $1",
        sandbox_id,
        sandbox_summary(state) | {"run": run_id},
    )
    return sandbox_id


def called(step: int, *blocks: ToolCall | Text) -> ModelCalled:
    stop: StopReason = "tool_use" if any(isinstance(b, ToolCall) for b in blocks) else "end"
    return ModelCalled(
        step=step,
        digest=f"d{step}",
        model=MODEL,
        response=ModelResponse(
            content=blocks,
            stop_reason=stop,
            usage=Usage(input_tokens=10, output_tokens=5),
            model="claude-sonnet-4-6",
        ),
        cost_usd="0.000105",
        latency_ms=5,
    )


def bash(call_id: str, command: str) -> ToolCall:
    return ToolCall(id=call_id, name="bash", arguments={"command": command})


def result(command: str, end: str, output: str) -> str:
    """A command's result as the sandbox writes it."""
    return f"$ {command}\n[in /workspace; {end}]\n{output}"


def ran(run_id: str, call: ToolCall, content: str, *, is_error: bool = False) -> list[Any]:
    """The run's events of a sandboxed call sent to its sandbox and answered."""
    return [
        ToolIntended(
            call_id=call.id, name=call.name, arguments=call.arguments or {}, idempotency_key=call.id
        ),
        SandboxRequested(call_id=call.id, sandbox=sandbox_address(run_id), at=time.time()),
        ToolResulted(call_id=call.id, content=content, is_error=is_error, checkpoint=CHECKPOINT),
    ]


def executed(call: ToolCall, exit_code: int | None, content: str, seconds: float) -> list[Any]:
    """The sandbox's events of a command it ran."""
    return [
        CommandIntended(
            call_id=call.id, tool=call.name, arguments=call.arguments or {}, marker="m" + call.id
        ),
        CommandFinished(
            call_id=call.id,
            state="finished",
            exit_code=exit_code,
            content=content,
            is_error=False,
            output_bytes=len(content),
            checkpoint=CHECKPOINT,
            seconds=seconds,
            at=time.time(),
        ),
    ]


def asked(call: ToolCall, approved: bool) -> list[Any]:
    return [
        ApprovalRequested(
            call_id=call.id, name=call.name, arguments=call.arguments or {}, cwd="/workspace"
        ),
        ApprovalDecided(call_id=call.id, approved=approved, who="alice", reason="", channel="cli"),
    ]


LS, EVIL, RM = bash("c1", "ls -la"), bash("c2", "cat evil.txt"), bash("c3", "rm -rf /")
READ = ToolCall(id="c4", name="read_file", arguments={"path": "notes.txt"})
LS_OUT = "total 0\n-rw-r--r-- 1 sandbox sandbox 5 notes.txt\n"
EVIL_OUT = HOSTILE + LONG


async def coder_run(client: Client) -> str:
    """A completed run of a sandboxed agent: a command, a hostile one approved (exit 3, 110 KB
    of markup and a NUL), one denied, a file read, and a container made again."""
    run_id = new_id()
    await new_run(
        client,
        run_id,
        "coder",
        [
            called(1, LS),
            *ran(run_id, LS, result("ls -la", "exit 0", LS_OUT)),
            called(2, EVIL),
            *asked(EVIL, True),
            *ran(run_id, EVIL, result("cat evil.txt", "exit 3", EVIL_OUT)),
            called(3, RM),
            *asked(RM, False),
            ToolResulted(call_id="c3", content="denied by alice", is_error=True, denied=True),
            SandboxNoted(
                text="sandbox container started anew; workspace restored from "
                "checkpoint 9f2c4e1a7b3d (1 files)",
                at=time.time(),
            ),
            called(4, READ),
            *ran(run_id, READ, "hello"),
            called(5, Text(text="Done.")),
            RunCompleted(output="Done."),
        ],
    )
    await new_sandbox(
        client,
        run_id,
        [
            SandboxCreated(container_id="c0ffee" * 10, name="toren-coder-1", image=DEFAULT_IMAGE),
            *executed(LS, 0, result("ls -la", "exit 0", LS_OUT), 0.25),
            Checkpointed(
                checkpoint=CHECKPOINT, files=1, bytes=5, uploaded_bytes=2048, blobs_uploaded=1
            ),
            *executed(EVIL, 3, result("cat evil.txt", "exit 3", EVIL_OUT), 1.5),
            *executed(READ, None, "hello", 0.01),
        ],
    )
    return run_id


async def sandboxed(client: Client, status: str, sandbox: list[Any]) -> str:
    """A run that ended with ``status`` (or still runs) and has a sandbox with ``sandbox``."""
    endings: dict[str, list[Any]] = {
        "completed": [RunCompleted(output="ok")],
        "failed": [RunFailed(error_class="tool", message="boom")],
        "cancelled": [RunFailed(error_class="cancelled", message="cancelled by ana")],
        "running": [],
    }
    ends = endings[status]
    run_id = new_id()
    await new_run(client, run_id, "coder", [called(1, LS), *ran(run_id, LS, "$ ls"), *ends])
    await new_sandbox(client, run_id, sandbox)
    return run_id


CREATED = SandboxCreated(container_id="ab" * 32, name="toren-x", image=DEFAULT_IMAGE)


async def fleet(client: Client) -> dict[str, str]:
    """Runs in every case a reap tells apart, by name."""
    return {
        "completed": await sandboxed(client, "completed", [CREATED]),
        "failed": await sandboxed(client, "failed", [CREATED, SandboxStopped(reason="idle")]),
        "cancelled": await sandboxed(client, "cancelled", [CREATED]),
        "running": await sandboxed(client, "running", [CREATED]),
        "reaped": await sandboxed(client, "completed", [CREATED, SandboxReaped()]),
        "bare": await new_run(client, new_id(), "plain", [RunCompleted(output="ok")]),
    }


async def cli(db_url: str, *args: str) -> Any:
    return await anyio.to_thread.run_sync(lambda: toren(*args, db_url=db_url))


async def reaps(client: Client) -> list[str]:
    rows = await client.pool.fetch(
        "SELECT actor_id FROM toren.mailbox WHERE kind = 'sandbox.reap' ORDER BY id"
    )
    return [r["actor_id"] for r in rows]


# --- toren sandboxes list ---------------------------------------------------------------------


async def test_list_shows_the_sandboxes_whose_container_may_exist(
    client: Client, db_url: str
) -> None:
    runs = await fleet(client)
    listed = await cli(db_url, "sandboxes", "list", "--json")
    assert listed.returncode == 0, listed.stderr
    items = json.loads(listed.stdout)
    assert {i["run"] for i in items} == {
        runs["completed"],
        runs["failed"],
        runs["cancelled"],
        runs["running"],
    }
    [failed] = [i for i in items if i["run"] == runs["failed"]]
    assert (failed["id"], failed["agent"], failed["run_status"], failed["status"]) == (
        sandbox_address(runs["failed"]),
        "coder",
        "failed",
        "stopped",
    )
    assert (failed["name"], failed["live"]) == ("toren-x", True)
    everything = json.loads((await cli(db_url, "sandboxes", "list", "--all", "--json")).stdout)
    assert {i["run"] for i in everything} == {runs[k] for k in runs if k != "bare"}


async def test_list_prints_a_table_with_commands_checkpoint_and_uploads(
    client: Client, db_url: str
) -> None:
    run_id = await coder_run(client)
    table = await cli(db_url, "sandboxes", "list")
    assert table.returncode == 0, table.stderr
    assert "1 sandbox(es) whose container may exist" in table.stdout
    [row] = [line for line in table.stdout.splitlines() if run_id in line]
    for shown in ("coder", "completed", "running", "toren-coder-1", "9f2c4e1a7b3d", "2.0 KiB"):
        assert shown in row
    assert CHECKPOINT not in row  # short


# --- toren sandboxes reap ---------------------------------------------------------------------


async def test_reap_sends_to_the_unreaped_sandboxes_of_ended_runs_only(
    client: Client, db_url: str
) -> None:
    runs = await fleet(client)
    reaped = await cli(db_url, "sandboxes", "reap")
    assert reaped.returncode == 0, reaped.stderr
    assert sorted(await reaps(client)) == sorted(
        sandbox_address(runs[k]) for k in ("completed", "failed", "cancelled")
    )
    assert f"sent reap to {sandbox_address(runs['completed'])}" in reaped.stdout
    assert "3 sandbox(es) told to reap" in reaped.stdout


async def test_a_reap_queued_already_is_not_sent_again(client: Client, db_url: str) -> None:
    runs = await fleet(client)
    await cli(db_url, "sandboxes", "reap")  # no worker with Docker takes them
    again = await cli(db_url, "sandboxes", "reap")
    assert again.returncode == 0, again.stderr
    assert len(await reaps(client)) == 3
    assert f"{sandbox_address(runs['failed'])} (run {runs['failed']}) has a reap queued" in (
        again.stdout
    )
    assert "nothing to reap" in again.stdout
    listed = await cli(db_url, "sandboxes", "list")
    [row] = [line for line in listed.stdout.splitlines() if runs["failed"] in line]
    assert "stopped (reap queued)" in row


async def test_reap_dry_run_sends_nothing(client: Client, db_url: str) -> None:
    runs = await fleet(client)
    dry = await cli(db_url, "sandboxes", "reap", "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert f"would send reap to {sandbox_address(runs['failed'])}" in dry.stdout
    assert await reaps(client) == []


async def test_reap_of_a_named_running_run_is_forced_and_says_so(
    client: Client, db_url: str
) -> None:
    runs = await fleet(client)
    forced = await cli(db_url, "sandboxes", "reap", runs["running"].removeprefix("run/"))
    assert forced.returncode == 0, forced.stderr
    assert await reaps(client) == [sandbox_address(runs["running"])]
    assert "forced: the run has not ended" in forced.stdout


async def test_reap_of_a_run_without_a_sandbox_names_it_and_sends_nothing(
    client: Client, db_url: str
) -> None:
    runs = await fleet(client)
    unknown = f"run/{uuid.uuid4()}"
    refused = await cli(db_url, "sandboxes", "reap", runs["completed"], runs["bare"], unknown)
    assert refused.returncode == 1
    assert f"{runs['bare']} has no sandbox" in refused.stderr
    assert f"no run {unknown!r}" in refused.stderr
    assert await reaps(client) == []  # not even the completed run's: nothing was sent


# --- toren jobs show --------------------------------------------------------------------------


async def test_jobs_show_lists_the_sandboxed_calls_with_their_output_cut_and_escaped(
    client: Client, db_url: str
) -> None:
    run_id = await coder_run(client)
    shown = await cli(db_url, "jobs", "show", run_id)
    assert shown.returncode == 0, shown.stderr
    text = shown.stdout
    assert f"sandbox {sandbox_address(run_id)}: running, toren-coder-1, 3 command(s)" in text
    assert "c1  bash  $ ls -la  (in /workspace; exit 0; 0.25 s)" in text
    assert "      | -rw-r--r-- 1 sandbox sandbox 5 notes.txt" in text
    assert "c2  bash  $ cat evil.txt  (in /workspace; exit 3; 1.50 s)" in text
    assert "| <img src=x onerror=window.__owned=1>" in text  # as characters, inert
    assert "\\x00NUL\\u202eRTL" in text  # controls written as escapes
    assert "\x00" not in text
    assert "\u202e" not in text
    assert "... 996 more line(s)" in text  # 5 of 1001 lines shown
    assert "c3  bash  $ rm -rf /  (in /workspace; denied)" in text
    assert "c4  read_file  notes.txt  (in /workspace; done; 0.01 s)" in text
    assert "sandbox: sandbox container started anew" in text  # the note, on the timeline
    assert "receipt: 5 calls made" in text  # the rest as before


async def test_jobs_show_json_has_every_command_with_its_whole_output(
    client: Client, db_url: str
) -> None:
    run_id = await coder_run(client)
    shown = await cli(db_url, "jobs", "show", run_id, "--json")
    assert shown.returncode == 0, shown.stderr
    record = json.loads(shown.stdout)
    assert (record["status"], record["calls_made"]) == ("completed", 5)  # as before
    commands = {c["call_id"]: c for c in record["commands"]}
    assert list(commands) == ["c1", "c2", "c3", "c4"]
    evil = commands["c2"]
    assert (evil["tool"], evil["command"], evil["cwd"]) == ("bash", "cat evil.txt", "/workspace")
    assert (evil["state"], evil["exit_code"], evil["seconds"], evil["outcome"]) == (
        "finished",
        3,
        1.5,
        "exit 3",
    )
    assert evil["output"] == EVIL_OUT  # whole, NUL and all
    assert evil["checkpoint"] == CHECKPOINT
    assert (commands["c3"]["state"], commands["c3"]["exit_code"]) == ("denied", None)
    assert (commands["c4"]["path"], commands["c4"]["output"]) == ("notes.txt", "hello")
    assert record["sandbox"]["name"] == "toren-coder-1"
    assert record["sandbox"]["uploaded_bytes"] == 2048


def test_an_interrupted_command_is_shown_with_what_is_known() -> None:
    command = bash("c9", "make")
    content = (
        "$ make\n[in /workspace; interrupted: the worker running it stopped before it "
        "finished. Exit status unknown]\n[output before the interruption]\ncc -c a.c\n"
    )
    [call] = sandboxed_calls(
        list(map(encode, ran("run/x", command, content, is_error=True))),
        [
            encode(CommandIntended(call_id="c9", tool="bash", arguments={}, marker="m")),
            encode(
                CommandFinished(
                    call_id="c9", state="interrupted", exit_code=None, content="", is_error=True
                )
            ),
        ],
    )
    assert (call.state, call.exit_code, call.outcome) == ("interrupted", None, "interrupted")
    assert call.output == "[output before the interruption]\ncc -c a.c\n"


# --- the API and the console ------------------------------------------------------------------


async def parked_run(client: Client) -> str:
    """A run parked on a sandboxed command with shell control syntax."""
    call = bash("p1", "echo <b>hi</b>; rm -rf /tmp/x")
    return await new_run(
        client,
        new_id(),
        "careful",
        [
            called(1, call),
            ApprovalRequested(
                call_id="p1", name="bash", arguments=call.arguments or {}, cwd="/workspace"
            ),
        ],
    )


async def test_the_api_shows_where_a_waiting_command_would_run(client: Client, db_url: str) -> None:
    run_id = await parked_run(client)
    _, token = await create_token(client.pool, "alice", scopes=SCOPES)
    path = f"/runs/{run_id.removeprefix('run/')}"
    async with api(db_url) as base, session(token) as http, http.get(base + path) as r:
        assert r.status == 200
        page = await r.json()
    assert page["waiting_on"] == [
        {
            "call_id": "p1",
            "tool": "bash",
            "arguments": {"command": "echo <b>hi</b>; rm -rf /tmp/x"},
            "run": run_id,
            "agent": "careful",
            "cwd": "/workspace",
        }
    ]


async def test_the_console_shows_commands_and_their_output_escaped(
    client: Client,
    db_url: str,
    chromium: Path,  # noqa: F811  (the fixture imported above)
) -> None:
    from playwright.async_api import async_playwright

    run_id = await coder_run(client)
    parked = await parked_run(client)
    _, token = await create_token(client.pool, "alice", scopes=SCOPES)
    async with api(db_url) as base, async_playwright() as pw:
        browser = await _launch(pw, chromium)
        try:
            page = await _signed_in(browser, base, token)
            await page.wait_for_selector("#runs-body tr")
            await page.goto(f"{base}/#/runs/{run_id.removeprefix('run/')}")
            await page.wait_for_selector("#events-body >> text=run.completed")
            heads = await page.locator("#events-body .command-head").all_inner_texts()
            assert heads[0].startswith("$ ls -la in /workspace · exit 0")
            assert heads[1].startswith("$ cat evil.txt in /workspace · exit 3")
            assert heads[2] == "$ rm -rf / in /workspace · denied"
            assert heads[3] == "read_file notes.txt · done"
            outputs = page.locator("#events-body pre.output")
            assert await outputs.nth(0).text_content() == LS_OUT
            evil = await outputs.nth(1).text_content()
            assert (evil or "").startswith("<img src=x onerror=window.__owned=1>")
            assert "\\x00NUL\\u202eRTL" in (evil or "")
            assert len(evil or "") > 100_000
            # The long output is folded; nothing in it became markup or ran.
            assert await page.locator("#events-body details:not([open]) pre.output").count() == 1
            assert (
                await page.locator("#events-body img, #events-body script, #events-body b").count()
                == 0
            )
            assert await page.evaluate("window.__owned") is None
            note = await page.locator("#events-body .note").inner_text()
            assert note.startswith("sandbox: sandbox container started anew")
            asked = await page.locator("#events-body .command").nth(1).inner_text()
            assert asked == "approval asked for $ cat evil.txt in /workspace"
            titles = await page.eval_on_selector_all(
                "#timeline title", "(ts) => ts.map((t) => t.textContent)"
            )
            assert "$ ls -la" in titles  # the command's bar says which command
            ARTIFACTS.mkdir(parents=True, exist_ok=True)
            await page.screenshot(path=str(ARTIFACTS / "console-sandbox.png"), full_page=True)
            # An approval shows the exact command and where it runs.
            await page.goto(f"{base}/#/runs/{parked.removeprefix('run/')}")
            await page.wait_for_selector("#decision:not([hidden])")
            what = page.locator("#decision-what")
            assert await what.locator("pre").text_content() == "$ echo <b>hi</b>; rm -rf /tmp/x"
            assert "bash in /workspace" in await what.inner_text()
            assert await page.locator("#decision-what b").count() == 0
            await page.screenshot(path=str(ARTIFACTS / "console-sandbox-approval.png"))
        finally:
            await browser.close()
