"""Provider adapters through the real SDKs (anthropic, openai, aioboto3) against local servers."""

from __future__ import annotations

import contextlib
import logging
import re
import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

import anyio
import attrs
import genai_prices
import pytest
from genai_prices import data_snapshot

from toren import ConfigError
from toren._agent.estimate import estimate_tokens
from toren._agent.model import (
    Message,
    ModelRequest,
    Text,
    ToolCall,
    ToolResult,
    ToolSpec,
    Usage,
)
from toren.providers import (
    ModelProvider,
    ProviderError,
    RetryingProvider,
    RetryPolicy,
    context_window,
    parse_model,
    price,
    provider_for,
)
from toren.providers._base import parse_retry_after, redact_text, redact_url
from toren.providers.pricing import bedrock_model_refs, linear_rates
from toren.testing import (
    AnthropicServer,
    BedrockServer,
    Disconnect,
    Fail,
    OpenAIServer,
    Reply,
    ScriptedServer,
    Step,
)

pytestmark = pytest.mark.anyio

FAST = RetryPolicy(base=0.001, cap=0.01)
SERVERS: dict[str, type[ScriptedServer]] = {
    "anthropic": AnthropicServer,
    "openai": OpenAIServer,
    "bedrock": BedrockServer,
}
MODELS = {
    "anthropic": "claude-sonnet-4-6",
    "openai": "gpt-4o",
    "bedrock": "anthropic.claude-sonnet-4-6-v1:0",
}
KINDS = list(SERVERS)

WEATHER = ToolSpec(
    name="weather",
    description="Weather for a city",
    input_schema={"type": "object", "properties": {"city": {"type": "string"}}},
)


def ask(kind: str, text: str = "What is the weather in Oslo?", **fields: Any) -> ModelRequest:
    return ModelRequest(
        model=MODELS[kind],
        system="You are terse.",
        messages=(Message(role="user", content=(Text(text=text),)),),
        tools=(WEATHER,),
        **fields,
    )


@contextlib.asynccontextmanager
async def served(
    kind: str,
    script: list[Step],
    retry: RetryPolicy = FAST,
    *,
    window: int | None = None,
    model: str | None = None,
) -> AsyncIterator[tuple[Any, RetryingProvider]]:
    async with SERVERS[kind](script, window=window) as server:
        name = f"{kind}/{model or MODELS[kind]}"
        async with provider_for(name, env=server.env(), retry=retry) as provider:
            yield server, provider


# -- replies -------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
async def test_text_reply(kind: str) -> None:
    reply = Reply("It is sunny.", usage=Usage(input_tokens=30, output_tokens=4))
    async with served(kind, [reply]) as (server, provider):
        response = await provider.call(ask(kind, temperature=0.2, max_tokens=300))
    assert isinstance(provider, ModelProvider)
    assert response.content == (Text(text="It is sunny."),)
    assert response.stop_reason == "end"
    assert response.usage == Usage(input_tokens=30, output_tokens=4)
    assert response.model == MODELS[kind]
    assert response.response_id
    assert len(server.requests) == 1


@pytest.mark.parametrize("kind", KINDS)
async def test_text_and_two_tool_calls_in_one_reply(kind: str) -> None:
    content = [
        Text(text="Checking both."),
        ToolCall(id="call_a", name="weather", arguments={"city": "Oslo"}),
        ToolCall(id="call_b", name="weather", arguments={"city": "Lima", "days": [1, 2]}),
    ]
    async with served(kind, [Reply(content)]) as (_, provider):
        response = await provider.call(ask(kind))
    assert response.content == tuple(content)
    assert response.stop_reason == "tool_use"


@pytest.mark.parametrize("kind", KINDS)
async def test_max_tokens_stop(kind: str) -> None:
    async with served(kind, [Reply("It is su", stop_reason="max_tokens")]) as (_, provider):
        response = await provider.call(ask(kind, max_tokens=5))
    assert response.stop_reason == "max_tokens"
    assert response.content == (Text(text="It is su"),)


# -- request wire shapes -------------------------------------------------------------------------


def with_tool_results(kind: str) -> ModelRequest:
    return ModelRequest(
        model=MODELS[kind],
        system="You are terse.",
        messages=(
            Message(role="user", content=(Text(text="Weather in Oslo and Lima?"),)),
            Message(
                role="assistant",
                content=(
                    Text(text="Checking."),
                    ToolCall(id="c1", name="weather", arguments={"city": "Oslo"}),
                    ToolCall(id="c2", name="weather", arguments={"city": "Lima"}),
                ),
            ),
            Message(
                role="user",
                content=(
                    ToolResult(tool_call_id="c1", content="sunny"),
                    ToolResult(tool_call_id="c2", content="no such city", is_error=True),
                ),
            ),
        ),
        tools=(WEATHER,),
        max_tokens=256,
        temperature=0.5,
    )


async def test_anthropic_request_carries_tool_use_and_tool_result_blocks() -> None:
    async with served("anthropic", [Reply("Oslo is sunny.")]) as (server, provider):
        await provider.call(with_tool_results("anthropic"))
    body = server.requests[0]
    assert body["model"] == "claude-sonnet-4-6"
    assert body["system"] == "You are terse."
    assert body["max_tokens"] == 256
    assert "temperature" not in body  # API 2026-10-21 refuses sampling parameters
    assert body["tools"] == [
        {
            "name": "weather",
            "description": "Weather for a city",
            "input_schema": WEATHER.input_schema,
        }
    ]
    assert body["messages"] == [
        {"role": "user", "content": [{"type": "text", "text": "Weather in Oslo and Lima?"}]},
        {
            "role": "assistant",
            "content": [
                {"type": "text", "text": "Checking."},
                {"type": "tool_use", "id": "c1", "name": "weather", "input": {"city": "Oslo"}},
                {"type": "tool_use", "id": "c2", "name": "weather", "input": {"city": "Lima"}},
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "c1", "content": "sunny"},
                {
                    "type": "tool_result",
                    "tool_use_id": "c2",
                    "content": "no such city",
                    "is_error": True,
                },
            ],
        },
    ]


async def test_openai_request_carries_tool_calls_and_tool_messages() -> None:
    async with served("openai", [Reply("Oslo is sunny.")]) as (server, provider):
        await provider.call(with_tool_results("openai"))
    body = server.requests[0]
    assert body["model"] == "gpt-4o"
    assert body["max_completion_tokens"] == 256
    assert body["temperature"] == 0.5
    assert body["tools"] == [
        {
            "type": "function",
            "function": {
                "name": "weather",
                "description": "Weather for a city",
                "parameters": WEATHER.input_schema,
            },
        }
    ]
    assert body["messages"] == [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Weather in Oslo and Lima?"},
        {
            "role": "assistant",
            "content": "Checking.",
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "weather", "arguments": '{"city": "Oslo"}'},
                },
                {
                    "id": "c2",
                    "type": "function",
                    "function": {"name": "weather", "arguments": '{"city": "Lima"}'},
                },
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "c2", "content": "Error: no such city"},
    ]


async def test_bedrock_request_carries_tool_use_tool_result_and_tool_config() -> None:
    async with served("bedrock", [Reply("Oslo is sunny.")]) as (server, provider):
        await provider.call(with_tool_results("bedrock"))
    body = server.requests[0]
    assert server.model_ids == ["anthropic.claude-sonnet-4-6-v1:0"]
    assert body["system"] == [{"text": "You are terse."}]
    assert body["inferenceConfig"] == {"maxTokens": 256, "temperature": 0.5}
    assert body["toolConfig"] == {
        "tools": [
            {
                "toolSpec": {
                    "name": "weather",
                    "description": "Weather for a city",
                    "inputSchema": {"json": WEATHER.input_schema},
                }
            }
        ]
    }
    assert body["messages"] == [
        {"role": "user", "content": [{"text": "Weather in Oslo and Lima?"}]},
        {
            "role": "assistant",
            "content": [
                {"text": "Checking."},
                {"toolUse": {"toolUseId": "c1", "name": "weather", "input": {"city": "Oslo"}}},
                {"toolUse": {"toolUseId": "c2", "name": "weather", "input": {"city": "Lima"}}},
            ],
        },
        {
            "role": "user",
            "content": [
                {
                    "toolResult": {
                        "toolUseId": "c1",
                        "content": [{"text": "sunny"}],
                        "status": "success",
                    }
                },
                {
                    "toolResult": {
                        "toolUseId": "c2",
                        "content": [{"text": "no such city"}],
                        "status": "error",
                    }
                },
            ],
        },
    ]


async def test_openai_malformed_tool_arguments_come_back_raw() -> None:
    calls = [
        ToolCall(id="c1", name="weather", arguments=None, raw_arguments='{"city": "Os'),
        ToolCall(id="c2", name="weather", arguments=None, raw_arguments="[1, 2]"),
    ]
    async with served("openai", [Reply(calls)]) as (_, provider):
        response = await provider.call(ask("openai"))
    assert response.content == (
        ToolCall(id="c1", name="weather", arguments=None, raw_arguments='{"city": "Os'),
        ToolCall(id="c2", name="weather", arguments=None, raw_arguments="[1, 2]"),
    )
    assert response.stop_reason == "tool_use"


# -- errors and retries --------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
async def test_429_waits_the_retry_after_then_succeeds(kind: str) -> None:
    script: list[Step] = [Fail(status=429, message="slow down", retry_after=0.2), Reply("ok")]
    async with served(kind, script) as (server, provider):
        started = time.monotonic()
        response = await provider.call(ask(kind))
        elapsed = time.monotonic() - started
    assert response.content == (Text(text="ok"),)
    assert len(server.requests) == 2
    assert elapsed >= 0.2  # the backoff alone (<= 0.001 s) would not wait this long


@pytest.mark.parametrize("kind", KINDS)
async def test_500_then_success(kind: str) -> None:
    async with served(kind, [Fail(status=500, message="boom"), Reply("ok")]) as (server, provider):
        response = await provider.call(ask(kind))
    assert response.content == (Text(text="ok"),)
    assert len(server.requests) == 2


@pytest.mark.parametrize("kind", KINDS)
async def test_connection_reset_is_retried(kind: str) -> None:
    async with served(kind, [Disconnect(), Reply("ok")]) as (server, provider):
        response = await provider.call(ask(kind))
    assert response.content == (Text(text="ok"),)
    assert len(server.requests) == 2


@pytest.mark.parametrize("kind", KINDS)
async def test_400_is_not_retried(kind: str) -> None:
    script: list[Step] = [Fail(status=400, message="messages: field required"), Reply("never")]
    async with served(kind, script) as (server, provider):
        with pytest.raises(ProviderError) as caught:
            await provider.call(ask(kind))
    error = caught.value
    assert (error.provider, error.status, error.retryable) == (kind, 400, False)
    assert error.message == "messages: field required"
    assert "messages: field required" in str(error)
    assert not error.too_large
    assert "context window" not in str(error)
    assert len(server.requests) == 1


@pytest.mark.parametrize("kind", KINDS)
async def test_exhausted_retries_raise_the_last_error(kind: str) -> None:
    script: list[Step] = [
        Fail(status=500, message="first"),
        Fail(status=503, message="second"),
        Fail(status=429, message="third"),
        Reply("too late"),
    ]
    async with served(kind, script, RetryPolicy(attempts=3, base=0.001, cap=0.01)) as (
        server,
        provider,
    ):
        with pytest.raises(ProviderError) as caught:
            await provider.call(ask(kind))
    assert (caught.value.status, caught.value.message) == (429, "third")
    assert caught.value.retryable
    assert len(server.requests) == 3


async def test_a_retry_after_beyond_the_policy_stops_at_once() -> None:
    policy = RetryPolicy(base=0.001, cap=0.01, max_retry_after=1.0)
    script: list[Step] = [Fail(status=429, message="come back later", retry_after=60), Reply("x")]
    async with served("openai", script, policy) as (server, provider):
        with pytest.raises(ProviderError) as caught:
            await provider.call(ask("openai"))
    assert caught.value.retryable
    assert caught.value.retry_after == 60
    assert len(server.requests) == 1


async def test_an_attempt_past_its_timeout_is_retried() -> None:
    policy = RetryPolicy(base=0.001, cap=0.01, attempt_timeout=0.3)
    script: list[Step] = [Reply("slow", latency=30), Reply("fast")]
    async with served("anthropic", script, policy) as (server, provider):
        with anyio.fail_after(10):
            response = await provider.call(ask("anthropic"))
    assert response.content == (Text(text="fast"),)
    assert len(server.requests) == 2
    assert server.model_time == 0.0  # the slow answer was never served


async def test_retryable_failures_are_logged_without_secrets(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG, logger="toren")
    async with AnthropicServer([Fail(status=503, message="overloaded"), Reply("ok")]) as server:
        env = dict(server.env(), ANTHROPIC_API_KEY="sk-ant-very-secret")
        async with provider_for("anthropic/claude-sonnet-4-6", env=env, retry=FAST) as provider:
            await provider.call(ask("anthropic"))
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    message = warnings[0].getMessage()
    assert "anthropic" in message
    assert "503" in message
    assert "retrying in" in message
    assert "sk-ant-very-secret" not in caplog.text


@pytest.mark.parametrize("kind", KINDS)
async def test_a_held_request_finishes_on_release(kind: str) -> None:
    async with served(kind, [Reply("first"), Reply("second")]) as (server, provider):
        hold = server.hold(2)
        answers: list[Any] = [await provider.call(ask(kind))]
        async with anyio.create_task_group() as tg:

            async def second() -> None:
                answers.append(await provider.call(ask(kind)))

            tg.start_soon(second)
            with anyio.fail_after(5):
                await hold.arrived.wait()
            assert len(server.requests) == 2
            assert len(answers) == 1  # request 2 is in flight, held
            server.release()
    assert [a.content for a in answers] == [(Text(text="first"),), (Text(text="second"),)]


@contextlib.asynccontextmanager
async def raw_server(answer: bytes) -> AsyncIterator[int]:
    """A TCP server on a free port that answers every connection with ``answer`` (not
    necessarily HTTP) and closes it; yields the port."""

    async def serve(stream: anyio.abc.SocketStream) -> None:
        async with stream:
            with contextlib.suppress(anyio.EndOfStream, anyio.BrokenResourceError):
                head = b""
                while b"\r\n\r\n" not in head:
                    head += await stream.receive()
                await stream.send(answer)

    listener = await anyio.create_tcp_listener(local_host="127.0.0.1")
    async with listener, anyio.create_task_group() as tg:
        tg.start_soon(listener.serve, serve)
        yield listener.extra(anyio.abc.SocketAttribute.local_port)
        tg.cancel_scope.cancel()


def at_port(kind: str, port: int) -> dict[str, str]:
    if kind == "anthropic":
        return {"ANTHROPIC_API_KEY": "k", "ANTHROPIC_BASE_URL": f"http://127.0.0.1:{port}"}
    return {"OPENAI_API_KEY": "k", "OPENAI_BASE_URL": f"http://127.0.0.1:{port}/v1"}


ONCE = RetryPolicy(attempts=1)
# The SDK's own words for a connection that failed: "Connection error." (httpx, older SDKs) or
# "Connection to HOST:PORT failed: ..." (anthropic 2.17 over aiohttp). Never a timeout.
CONNECTION_FAILED = re.compile(r"Connection error|Connection to \S+ failed")


@pytest.mark.parametrize("kind", ["anthropic", "openai"])
async def test_a_refused_connection_is_a_connection_error_not_a_timeout(kind: str) -> None:
    # A wrong base URL is refused at once: saying "timed out" sends the operator the wrong way.
    async with raw_server(b"") as port:
        pass  # closed: nothing listens on the port any more
    async with provider_for(f"{kind}/{MODELS[kind]}", env=at_port(kind, port), retry=ONCE) as p:
        with pytest.raises(ProviderError) as caught:
            await p.call(ask(kind))
    error = caught.value
    assert (error.status, error.retryable, error.answered) == (None, True, False)
    assert CONNECTION_FAILED.search(error.message), error.message
    assert "timed out" not in error.message


@pytest.mark.parametrize(
    "answer",
    [
        b"HTTP/1.1 2x0 WHAT\r\n\r\n",  # a status line that is not one
        b"SSH-2.0-OpenSSH_9.2\r\n",  # not HTTP at all
    ],
)
@pytest.mark.parametrize("kind", ["anthropic", "openai"])
async def test_an_answer_that_is_not_http_is_a_connection_error_retried(
    kind: str, answer: bytes
) -> None:
    # What a gateway restarting or a wrong port answers: no model answered, so the call is
    # tried again, as it was with httpx (never taken for a paid answer that cannot be read).
    policy = RetryPolicy(attempts=2, base=0.001, cap=0.01)
    async with (
        raw_server(answer) as port,
        provider_for(f"{kind}/{MODELS[kind]}", env=at_port(kind, port), retry=policy) as provider,
    ):
        with pytest.raises(ProviderError) as caught:
            await provider.call(ask(kind))
    error = caught.value
    assert (error.status, error.retryable, error.answered) == (None, True, False), error.message
    assert CONNECTION_FAILED.search(error.message), error.message


# -- configuration -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kind", "variable"),
    [("anthropic", "ANTHROPIC_BASE_URL"), ("openai", "OPENAI_BASE_URL"), ("bedrock", None)],
)
async def test_base_url_comes_from_the_environment(
    kind: str, variable: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with SERVERS[kind]([Reply("from env")]) as server:
        for name, value in server.env().items():
            monkeypatch.setenv(name, value)
        if variable is not None:
            monkeypatch.setenv(variable, server.base_url)
        async with provider_for(f"{kind}/{MODELS[kind]}", retry=FAST) as provider:
            response = await provider.call(ask(kind))
    assert response.content == (Text(text="from env"),)
    assert len(server.requests) == 1


async def test_bedrock_endpoint_and_region_come_from_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async with BedrockServer([Reply("hi")]) as server:
        monkeypatch.setenv("TOREN_BEDROCK_ENDPOINT_URL", server.base_url)
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIDEXAMPLE")
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "secret")
        monkeypatch.delenv("AWS_REGION", raising=False)
        monkeypatch.setenv("AWS_DEFAULT_REGION", "eu-west-3")
        async with provider_for("bedrock/amazon.nova-pro-v1:0", retry=FAST) as provider:
            await provider.call(ask("bedrock"))
    authorization = server.received[0].headers["Authorization"]
    assert "/eu-west-3/bedrock/aws4_request" in authorization


@pytest.mark.parametrize(
    ("kind", "variable"),
    [("anthropic", "ANTHROPIC_API_KEY"), ("openai", "OPENAI_API_KEY")],
)
async def test_a_missing_key_is_a_config_error_on_first_use(kind: str, variable: str) -> None:
    async with SERVERS[kind]([Reply("never")]) as server:
        env = {k: v for k, v in server.env().items() if k != variable}
        provider = provider_for(f"{kind}/{MODELS[kind]}", env=env, retry=FAST)  # no error yet
        async with provider:
            with pytest.raises(ConfigError, match=variable):
                await provider.call(ask(kind))
    assert server.requests == []


async def test_bedrock_without_credentials_is_a_config_error(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    # keep botocore's credential chain on this machine: no files, no instance metadata service
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "credentials"))
    async with BedrockServer([Reply("never")]) as server:
        env = {"TOREN_BEDROCK_ENDPOINT_URL": server.base_url}
        async with provider_for("bedrock/x", env=env, retry=FAST) as provider:
            with pytest.raises(ConfigError, match="AWS_ACCESS_KEY_ID"):
                await provider.call(ask("bedrock"))
    assert server.requests == []


def test_an_unknown_prefix_names_the_three_providers() -> None:
    with pytest.raises(ConfigError) as caught:
        provider_for("mistral/large")
    assert all(name in str(caught.value) for name in ("anthropic", "openai", "bedrock"))
    with pytest.raises(ConfigError):
        provider_for("claude-sonnet-4-6")
    assert parse_model("bedrock/us.anthropic.claude-sonnet-4-6") == (
        "bedrock",
        "us.anthropic.claude-sonnet-4-6",
    )


def test_retry_delays_double_with_jitter_up_to_the_cap_and_honour_retry_after() -> None:
    policy = RetryPolicy(base=0.5, cap=4.0, jitter=0.5)
    for failures, full in [(1, 0.5), (2, 1.0), (3, 2.0), (4, 4.0), (9, 4.0)]:
        for _ in range(20):
            assert full * 0.5 <= policy.delay(failures) <= full
    assert policy.delay(1, retry_after=7.0) == 7.0


def test_retry_after_headers_are_parsed() -> None:
    assert parse_retry_after({"Retry-After": "2"}) == 2.0
    assert parse_retry_after({"retry-after-ms": "250", "retry-after": "9"}) == 0.25
    assert parse_retry_after({"x": "y"}) is None
    assert parse_retry_after({"Retry-After": "soon"}) is None
    future = time.strftime("%a, %d %b %Y %H:%M:%S GMT", time.gmtime(time.time() + 30))
    assert 25 <= (parse_retry_after({"Retry-After": future}) or 0) <= 31


def test_urls_are_redacted() -> None:
    assert redact_url("https://user:pw@host/v1?api_key=abc&model=x") == (
        "https://user:***@host/v1?api_key=***&model=x"
    )
    assert redact_url("http://127.0.0.1:8000/v1") == "http://127.0.0.1:8000/v1"
    text = redact_text('failed: "https://gw.example/v1?token=s3cret" refused')
    assert "s3cret" not in text
    assert "token=***" in text
    error = ProviderError(
        provider="openai", status=None, message="no route to http://h/?key=k3y", retryable=True
    )
    assert "k3y" not in str(error)


# -- pricing -------------------------------------------------------------------------------------


def test_pricing_a_known_model() -> None:
    usage = Usage(input_tokens=1000, output_tokens=100)
    amount = price("anthropic", "claude-sonnet-4-6", usage)
    assert amount is not None
    assert amount > 0
    assert isinstance(amount, Decimal)
    assert (price("openai", "gpt-4o", usage) or 0) > 0


def test_an_unknown_model_is_unpriced_not_free() -> None:
    usage = Usage(input_tokens=1000, output_tokens=100)
    assert price("openai", "llama3.2-local-finetune", usage) is None
    assert price("bedrock", "acme.unknown-model-v1:0", usage) is None
    assert price("nobody", "x", usage) is None


def test_every_model_is_priced_as_the_library_prices_it_to_the_digit() -> None:
    # price() computes a plain per-token price itself (the library's calculation costs about a
    # hundred times as much); for every model the library knows, the two agree, value and
    # digits (a receipt records the amount as text).
    snapshot = data_snapshot.get_snapshot()
    usages = [(0, 0), (1, 0), (0, 1), (1234, 56), (250_001, 64_000), (3_000_000, 7)]
    ours = {"anthropic": "anthropic", "openai": "openai", "aws": "bedrock"}
    linear = 0
    for vendor in snapshot.providers:
        if vendor.id not in ours:
            continue
        for model in vendor.models:
            for i, o in usages:
                try:
                    expected = genai_prices.calc_price(
                        genai_prices.Usage(input_tokens=i, output_tokens=o),
                        model_ref=model.id,
                        provider_id=vendor.id,
                    ).total_price
                except LookupError:  # an id the library does not find by itself
                    break
                got = price(ours[vendor.id], model.id, Usage(input_tokens=i, output_tokens=o))
                assert (got, str(got)) == (expected, str(expected)), (vendor.id, model.id, i, o)
            now = datetime.now(UTC)
            linear += linear_rates(model.get_prices(now)) is not None
    assert linear > 50  # most are priced without the library's calculation


def test_bedrock_model_ids_are_priced_through_a_mapping() -> None:
    usage = Usage(input_tokens=1000, output_tokens=100)
    for model in (
        "anthropic.claude-sonnet-4-6-v1:0",
        "us.anthropic.claude-sonnet-4-6-v1:0",
        "arn:aws:bedrock:us-east-1:123456789012:inference-profile/eu.anthropic.claude-sonnet-4-6",
    ):
        assert (price("bedrock", model, usage) or 0) > 0, model
    assert bedrock_model_refs("eu.anthropic.claude-sonnet-4-6-v1:0") == [
        ("aws", "eu.anthropic.claude-sonnet-4-6-v1:0"),
        ("aws", "anthropic.claude-sonnet-4-6-v1:0"),
        ("anthropic", "claude-sonnet-4-6"),
    ]


def test_context_windows_of_known_models_come_from_the_price_library() -> None:
    assert context_window("anthropic", "claude-3-5-sonnet-20240620") == 200_000
    assert context_window("openai", "gpt-4o") == 128_000
    # A Bedrock id is matched as price() matches it.
    assert context_window("bedrock", "anthropic.claude-3-5-sonnet-20240620-v1:0") == 200_000


def test_an_unknown_model_or_provider_has_no_known_window() -> None:
    assert context_window("openai", "llama3.2-local-finetune") is None
    assert context_window("bedrock", "acme.unknown-model-v1:0") is None
    assert context_window("nobody", "gpt-4o") is None


# -- usage is the servers' estimate -------------------------------------------------------------

# The fields of each wire format that hold the prompt: system, messages and tools.
PROMPT_FIELDS = {
    "anthropic": ("system", "messages", "tools"),
    "openai": ("messages", "tools"),
    "bedrock": ("system", "messages", "toolConfig"),
}


@pytest.mark.parametrize("kind", KINDS)
async def test_usage_reported_is_the_servers_estimate_of_the_request(kind: str) -> None:
    reply = Reply([Text(text="Looking it up."), ToolCall(id="c1", name="weather", arguments={})])
    async with served(kind, [reply]) as (server, provider):
        response = await provider.call(ask(kind))
    body = server.received[0].body
    expected = estimate_tokens([body[f] for f in PROMPT_FIELDS[kind] if f in body])
    assert expected > 0
    assert server.received[0].input_tokens == expected
    output = estimate_tokens(["Looking it up.", "weather"])
    assert response.usage == Usage(input_tokens=expected, output_tokens=output)


# -- a request over the model's window ------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
async def test_a_request_over_the_window_is_too_large_and_not_retried(kind: str) -> None:
    async with served(kind, [Reply("after compaction")], window=10) as (server, provider):
        with pytest.raises(ProviderError) as caught:
            await provider.call(ask(kind))
        error = caught.value
        assert (error.provider, error.status) == (kind, 400)
        assert error.too_large
        assert not error.retryable
        assert "over the model's context window" in str(error)
        assert len(server.received) == 1  # refused once, never asked again
        assert server.received[0].refused
        # No step was consumed: the same server, with room, answers from the script.
        server.window = None
        response = await provider.call(ask(kind))
    assert response.content == (Text(text="after compaction"),)
    assert [r.refused for r in server.received] == [True, False]


@pytest.mark.parametrize(
    ("model", "message"),
    [
        (
            "us.anthropic.claude-sonnet-4-6-v1:0",
            "The model returned the following errors: prompt is too long: {n} tokens > 5 maximum",
        ),
        ("amazon.nova-pro-v1:0", "Input is too long for requested model."),
    ],
)
async def test_bedrock_too_long_is_a_validation_exception_in_the_models_words(
    model: str, message: str
) -> None:
    async with served("bedrock", [], window=5, model=model) as (server, provider):
        with pytest.raises(ProviderError) as caught:
            await provider.call(attrs.evolve(ask("bedrock"), model=model))
    assert caught.value.too_large
    assert caught.value.message == message.format(n=server.received[0].input_tokens)
    assert server.model_ids == [model]


async def test_anthropic_413_request_too_large_is_too_large() -> None:
    script: list[Step] = [Fail(status=413, message="Request exceeds the maximum size")]
    async with served("anthropic", script) as (_, provider):
        with pytest.raises(ProviderError) as caught:
            await provider.call(ask("anthropic"))
    assert caught.value.too_large
    assert not caught.value.retryable


async def test_a_gateway_saying_maximum_context_length_without_the_code_is_too_large() -> None:
    message = (
        "This model's maximum context length is 4097 tokens. However, your messages resulted "
        "in 4294 tokens. Please reduce the length of the messages."
    )
    async with served("openai", [Fail(status=400, message=message)]) as (_, provider):
        with pytest.raises(ProviderError) as caught:
            await provider.call(ask("openai"))
    assert caught.value.too_large


def test_too_large_is_never_retryable() -> None:
    error = ProviderError(
        provider="anthropic", status=413, message="too big", retryable=True, too_large=True
    )
    assert not error.retryable
    assert "over the model's context window" in str(error)
