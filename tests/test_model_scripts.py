"""Model scripts in Toren's terms: one function from a ModelRequest to a Reply scripts all three
providers' servers, through the providers' real SDKs; a broken script says so; MODULE:FN is
loaded with clear errors."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT
from toren import ConfigError
from toren.providers import ProviderError, RetryPolicy, provider_for
from toren.runs import ToolSpec
from toren.testing import (
    AnthropicServer,
    BedrockServer,
    Message,
    ModelRequest,
    OpenAIServer,
    Reply,
    ScriptedModel,
    ScriptedServer,
    Text,
    ToolCall,
    ToolResult,
    latest_results,
    latest_text,
    load_script,
    turns,
)
from toren.testing._wire_requests import anthropic_request

pytestmark = pytest.mark.anyio

SCHEMA = {"type": "object", "properties": {"order_id": {"type": "string"}}}
REQUEST = ModelRequest(
    model="claude-sonnet-4-6",
    system="You are a support agent.",
    messages=(
        Message(role="user", content=(Text(text="Where is order A-17?"),)),
        Message(
            role="assistant",
            content=(
                Text(text="Looking it up."),
                ToolCall(id="c1", name="lookup", arguments={"order_id": "A-17"}),
                ToolCall(id="c2", name="lookup", arguments={"order_id": "B-2"}),
            ),
        ),
        Message(
            role="user",
            content=(
                ToolResult(tool_call_id="c1", content="shipped"),
                ToolResult(tool_call_id="c2", content="no such order", is_error=True),
                Text(text="And B-2?"),
            ),
        ),
    ),
    tools=(ToolSpec(name="lookup", description="Look an order up.", input_schema=SCHEMA),),
    max_tokens=1000,
)


@pytest.mark.parametrize(
    ("server_type", "model"),
    [
        (AnthropicServer, "anthropic/claude-sonnet-4-6"),
        (OpenAIServer, "openai/gpt-4o"),
        (BedrockServer, "bedrock/anthropic.claude-sonnet-4-6"),
    ],
)
async def test_one_script_reads_the_same_conversation_from_every_provider(
    server_type: type[ScriptedServer], model: str
) -> None:
    seen: list[ModelRequest] = []

    def script(request: ModelRequest) -> Reply:
        seen.append(request)
        return Reply(f"turn {turns(request)}: {latest_text(request)}")

    async with (
        server_type(ScriptedModel(script)) as server,
        provider_for(model, env=server.env(), retry=RetryPolicy(attempts=1)) as provider,
    ):
        response = await provider.call(REQUEST)
    assert [b.text for b in response.content if isinstance(b, Text)] == ["turn 1: And B-2?"]
    [request] = seen
    assert request.model == REQUEST.model  # the request's own (Bedrock: from the path)
    assert request.system == REQUEST.system
    assert request.tools == REQUEST.tools
    assert request.max_tokens == 1000
    assert request.messages[:2] == REQUEST.messages[:2]
    results = latest_results(request)
    assert [r.tool_call_id for r in results] == ["c1", "c2"]
    assert results[0] == ToolResult(tool_call_id="c1", content="shipped")
    if server_type is OpenAIServer:  # Chat Completions has no error flag: said in the content
        assert results[1] == ToolResult(tool_call_id="c2", content="Error: no such order")
    else:
        assert results[1] == REQUEST.messages[2].content[1]
        assert request.messages == REQUEST.messages


async def test_an_async_script_answers_with_tool_calls() -> None:
    async def script(request: ModelRequest) -> Reply:
        return Reply([ToolCall(id="t1", name="lookup", arguments={"order_id": "A-17"})])

    async with (
        AnthropicServer(ScriptedModel(script)) as server,
        provider_for("anthropic/claude-sonnet-4-6", env=server.env()) as provider,
    ):
        response = await provider.call(REQUEST)
    assert response.tool_calls == [ToolCall(id="t1", name="lookup", arguments={"order_id": "A-17"})]
    assert response.stop_reason == "tool_use"


async def test_a_plain_script_that_blocks_holds_no_event_loop() -> None:
    """A plain function runs in a thread, one call at a time: while it blocks, the loop that
    serves it (and, in toren dev, the worker's) goes on."""
    import threading

    import anyio

    entered, release = threading.Event(), threading.Event()
    inside: list[int] = []

    def script(request: ModelRequest) -> Reply:
        inside.append(1)
        entered.set()
        assert release.wait(30), "the test never released the script"
        concurrent = len(inside)
        inside.pop()
        return Reply(f"at once: {concurrent}")

    async with (
        AnthropicServer(ScriptedModel(script)) as server,
        provider_for("anthropic/claude-sonnet-4-6", env=server.env()) as provider,
    ):
        answers: list[str] = []

        async def call() -> None:
            response = await provider.call(REQUEST)
            answers.extend(b.text for b in response.content if isinstance(b, Text))

        async with anyio.create_task_group() as tg:
            tg.start_soon(call)
            tg.start_soon(call)
            # The loop runs while the script blocks: the test's own tasks go on.
            with anyio.fail_after(20):
                while not entered.is_set():
                    await anyio.sleep(0.01)
            release.set()
    assert answers == ["at once: 1", "at once: 1"]


@pytest.mark.parametrize(
    ("script", "needle"),
    [
        (lambda request: 1 / 0, "raised ZeroDivisionError: division by zero"),
        (lambda request: 42, "returned int; return a Reply"),
        (lambda request: sys.exit(3), "raised SystemExit: 3"),
    ],
)
async def test_a_broken_script_is_a_clear_error_that_is_not_retried(
    script: object, needle: str
) -> None:
    async with (
        OpenAIServer(ScriptedModel(script, name="shop.model:script")) as server,  # type: ignore[arg-type]
        provider_for("openai/gpt-4o", env=server.env()) as provider,
    ):
        with pytest.raises(ProviderError) as caught:
            await provider.call(REQUEST)
    assert caught.value.status == 400
    assert not caught.value.retryable
    assert "the model script shop.model:script" in caught.value.message
    assert needle in caught.value.message
    assert len(server.requests) == 1


def test_a_body_that_is_not_a_conversation_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="role is 'system'"):
        anthropic_request({"messages": [{"role": "system", "content": "x"}]})
    with pytest.raises(ValueError, match="messages is not a list of objects"):
        anthropic_request({"messages": "hello"})


@pytest.mark.parametrize(
    ("server_type", "path", "body"),
    [
        (AnthropicServer, "/v1/messages", b"[1, 2]"),
        (AnthropicServer, "/v1/messages", b'{"messages": [], "tools": [{"input_schema": 5}]}'),
        (
            OpenAIServer,
            "/v1/chat/completions",
            b'{"messages": [{"role": "assistant", "tool_calls": [{"function": "x"}]}]}',
        ),
        (OpenAIServer, "/v1/chat/completions", b'{"messages": [], "tools": [{"function": 1}]}'),
        (
            BedrockServer,
            "/model/m/converse",
            b'{"messages": [{"role": "user", "content": [{"toolUse": "x"}]}]}',
        ),
        (BedrockServer, "/model/m/converse", b'{"messages": [], "toolConfig": [1]}'),
        (BedrockServer, "/model/m/converse", b'{"messages": [], "inferenceConfig": "x"}'),
    ],
)
async def test_a_hostile_body_is_refused_in_the_providers_format_without_asking_the_script(
    server_type: type[ScriptedServer], path: str, body: bytes
) -> None:
    import aiohttp

    asked: list[ModelRequest] = []
    async with (
        server_type(ScriptedModel(lambda r: asked.append(r) or "ok", name="m:s")) as server,
        aiohttp.ClientSession() as http,
        http.post(server.url + path, data=body, headers={"Content-Type": "application/json"}) as r,
    ):
        assert r.status == 400, await r.text()
        assert "the model script m:s was not asked" in await r.text()
    assert asked == []


def test_a_script_that_is_not_callable_is_refused() -> None:
    with pytest.raises(TypeError, match="must be callable"):
        ScriptedModel("not a function")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("spec", "needle"),
    [
        ("scriptmod", "is not MODULE:FN"),
        ("scriptmod:", "is not MODULE:FN"),
        ("no_such_module_here:script", "cannot import model script module"),
        ("scriptmod:missing", "has no 'missing'"),
        ("scriptmod:VALUE", "is a int, not a function"),
        ("brokenmod:script", "failed to import: RuntimeError: boom"),
        ("exitmod:script", r"called sys.exit\(4\) while it was imported"),
    ],
)
def test_load_script_says_what_is_wrong(
    spec: str, needle: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "scriptmod.py").write_text("VALUE = 3\n\ndef script(request):\n    return 'hi'\n")
    (tmp_path / "brokenmod.py").write_text("raise RuntimeError('boom')\n")
    (tmp_path / "exitmod.py").write_text("import sys\n\nsys.exit(4)\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [str(tmp_path), *sys.path])
    for name in ("scriptmod", "brokenmod", "exitmod"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    with pytest.raises(ConfigError, match=needle):
        load_script(spec)


def test_load_script_finds_a_function_in_the_current_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "goodscript.py").write_text("def script(request):\n    return 'hi'\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p != str(tmp_path)])
    monkeypatch.delitem(sys.modules, "goodscript", raising=False)
    scripted = load_script("goodscript:script")
    assert scripted.name == "goodscript:script"
    assert scripted.fn.__module__ == "goodscript"  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (("--app", "toren.demo", "--model-script", "no_such_module_here:fn"), "cannot import"),
        (("--app", "toren.demo", "--model-script", "toren.demo"), "is not MODULE:FN"),
        (("--model-script", "toren.demo:demo_model"), "add --app"),
    ],
)
def test_dev_with_a_bad_model_script_exits_2_before_starting_anything(
    args: tuple[str, ...], needle: str, tmp_path: Path
) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOREN_")}
    env.update({"TOREN_HOME": str(tmp_path / "home"), "PYTHONPATH": str(ROOT)})
    result = subprocess.run(
        [sys.executable, "-m", "toren", "dev", "--port", "0", *args],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 2, result
    assert needle in result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "home" / "pgdata").exists()  # nothing was started
