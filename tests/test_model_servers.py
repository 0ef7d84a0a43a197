"""The scripted model servers of toren.testing, exercised through the providers' real SDKs."""

from __future__ import annotations

from typing import Any

import anthropic
import anyio
import openai
import pytest

import toren.testing
from toren._agent.estimate import estimate_tokens
from toren._agent.model import Text, ToolCall, Usage
from toren.testing import (
    AnthropicServer,
    BedrockServer,
    Disconnect,
    Fail,
    OpenAIServer,
    Reply,
)

pytestmark = pytest.mark.anyio

MODEL = "claude-sonnet-4-6"
TWO_CALLS = Reply(
    [
        Text(text="Let me look both up, then compare them for you."),
        ToolCall(id="toolu_1", name="weather", arguments={"city": "Oslo", "days": [1, 2]}),
        ToolCall(id="toolu_2", name="weather", arguments={"city": "Lima"}),
    ],
    usage=Usage(input_tokens=42, output_tokens=17),
)


def test_testing_exports_are_pinned() -> None:
    assert toren.testing.__all__ == [
        "AnthropicServer",
        "BedrockServer",
        "Disconnect",
        "Fail",
        "Harness",
        "Hold",
        "Message",
        "ModelRequest",
        "ModelScript",
        "OpenAIServer",
        "ReceivedRequest",
        "Reply",
        "RunEnded",
        "ScriptedModel",
        "ScriptedServer",
        "Step",
        "Text",
        "ToolCall",
        "ToolResult",
        "Usage",
        "harness",
        "latest_results",
        "latest_text",
        "load_script",
        "turns",
    ]


def test_reply_infers_its_stop_reason() -> None:
    assert Reply("hi").effective_stop_reason == "end"
    assert TWO_CALLS.effective_stop_reason == "tool_use"
    assert Reply("cut", stop_reason="max_tokens").effective_stop_reason == "max_tokens"


def _anthropic(server: AnthropicServer) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(base_url=server.base_url, api_key="test", max_retries=0)


def _openai(server: OpenAIServer) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.base_url, api_key="test", max_retries=0)


async def test_anthropic_stream_through_messages_stream() -> None:
    async with AnthropicServer([TWO_CALLS]) as server:
        client = _anthropic(server)
        async with client.messages.stream(
            model=MODEL, max_tokens=100, messages=[{"role": "user", "content": "weather?"}]
        ) as stream:
            texts = [t async for t in stream.text_stream]
            final = await stream.get_final_message()
        await client.close()
    assert "".join(texts) == "Let me look both up, then compare them for you."
    assert len(texts) > 1  # really streamed in pieces
    assert [b.type for b in final.content] == ["text", "tool_use", "tool_use"]
    assert final.content[1].input == {"city": "Oslo", "days": [1, 2]}  # type: ignore[union-attr]
    assert final.content[2].id == "toolu_2"  # type: ignore[union-attr]
    assert final.stop_reason == "tool_use"
    assert (final.usage.input_tokens, final.usage.output_tokens) == (42, 17)
    assert server.requests[0]["stream"] is True


async def test_anthropic_raw_stream_sends_events_in_protocol_order() -> None:
    async with AnthropicServer([Reply("hi")]) as server:
        client = _anthropic(server)
        stream = await client.messages.create(
            model=MODEL, max_tokens=10, messages=[{"role": "user", "content": "x"}], stream=True
        )
        kinds = [event.type async for event in stream]
        await client.close()
    assert kinds == [
        "message_start",
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]


async def test_openai_stream_with_usage_in_final_chunk() -> None:
    async with OpenAIServer([TWO_CALLS]) as server:
        client = _openai(server)
        stream = await client.chat.completions.create(
            model="gpt-4o",
            messages=[{"role": "user", "content": "weather?"}],
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = [chunk async for chunk in stream]
        await client.close()
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "Let me look both up, then compare them for you."
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "tool_calls"
    assert chunks[-1].choices == []
    assert chunks[-1].usage is not None
    assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == (42, 17)


async def test_openai_stream_helper_accumulates_tool_calls() -> None:
    async with OpenAIServer([TWO_CALLS]) as server:
        client = _openai(server)
        async with client.chat.completions.stream(
            model="gpt-4o", messages=[{"role": "user", "content": "weather?"}]
        ) as stream:
            completion = await stream.get_final_completion()
        await client.close()
    message = completion.choices[0].message
    calls = message.tool_calls or []
    assert [c.id for c in calls] == ["toolu_1", "toolu_2"]
    assert [c.function.arguments for c in calls] == [  # type: ignore[union-attr]
        '{"city":"Oslo","days":[1,2]}',
        '{"city":"Lima"}',
    ]
    assert completion.choices[0].finish_reason == "tool_calls"
    assert "stream_options" not in server.requests[0] or server.requests[0]["stream"] is True


async def test_a_request_beyond_the_script_gets_a_clear_500_and_is_recorded() -> None:
    async with AnthropicServer([Reply("only one")]) as server:
        client = _anthropic(server)
        await client.messages.create(
            model=MODEL, max_tokens=10, messages=[{"role": "user", "content": "1"}]
        )
        with pytest.raises(anthropic.InternalServerError) as caught:
            await client.messages.create(
                model=MODEL, max_tokens=10, messages=[{"role": "user", "content": "2"}]
            )
        await client.close()
    assert "script ran out at request 2 (1 steps were scripted)" in str(caught.value)
    assert len(server.requests) == 2
    assert server.requests[1]["messages"] == [{"role": "user", "content": "2"}]


async def test_a_callable_script_sees_each_request_and_its_number() -> None:
    seen: list[tuple[str, int]] = []

    def script(body: dict[str, Any], n: int) -> Reply:
        seen.append((body["messages"][-1]["content"], n))
        return Reply(f"answer {n}")

    async with OpenAIServer(script) as server:
        client = _openai(server)
        for question in ("a", "b"):
            completion = await client.chat.completions.create(
                model="gpt-4o", messages=[{"role": "user", "content": question}]
            )
        await client.close()
    assert seen == [("a", 1), ("b", 2)]
    assert completion.choices[0].message.content == "answer 2"
    assert len(server.requests) == 2


async def test_model_time_sums_the_latency_served() -> None:
    async with OpenAIServer([Reply("a", latency=0.05), Reply("b", latency=0.1)]) as server:
        client = _openai(server)
        for _ in range(2):
            await client.chat.completions.create(
                model="gpt-4o", messages=[{"role": "user", "content": "x"}]
            )
        await client.close()
    assert server.model_time == pytest.approx(0.15)


async def test_hold_keeps_request_n_in_flight_until_release() -> None:
    async with OpenAIServer([Reply("first"), Reply("second")]) as server:
        client = _openai(server)
        hold = server.hold(2)
        answers: list[str] = []

        async def ask() -> None:
            completion = await client.chat.completions.create(
                model="gpt-4o", messages=[{"role": "user", "content": "x"}]
            )
            answers.append(completion.choices[0].message.content or "")

        await ask()
        async with anyio.create_task_group() as tg:
            tg.start_soon(ask)
            with anyio.fail_after(5):
                await hold.arrived.wait()
            assert len(server.requests) == 2  # recorded before it waits
            await anyio.sleep(0.05)
            assert answers == ["first"]  # still held
            server.release()
        await client.close()
    assert answers == ["first", "second"]
    assert hold.released


async def test_arrived_reports_any_request_and_a_late_hold_is_refused() -> None:
    async with AnthropicServer([Reply("a")]) as server:
        client = _anthropic(server)
        await client.messages.create(
            model=MODEL, max_tokens=10, messages=[{"role": "user", "content": "x"}]
        )
        await client.close()
        assert server.arrived(1).is_set()
        assert not server.arrived(2).is_set()
        with pytest.raises(ValueError, match="already arrived"):
            server.hold(1)


async def test_stopping_the_server_ends_a_held_request() -> None:
    client: openai.AsyncOpenAI | None = None
    errors: list[BaseException] = []
    async with anyio.create_task_group() as tg, OpenAIServer([Reply("never")]) as server:
        client = _openai(server)
        hold = server.hold(1)

        async def ask() -> None:
            assert client is not None
            try:
                await client.chat.completions.create(
                    model="gpt-4o", messages=[{"role": "user", "content": "x"}]
                )
            except openai.APIError as exc:
                errors.append(exc)

        tg.start_soon(ask)
        with anyio.fail_after(5):
            await hold.arrived.wait()
    assert client is not None
    await client.close()
    assert len(errors) == 1
    assert server.model_time == 0.0


async def test_fail_renders_each_providers_error_body_and_retry_after() -> None:
    async with AnthropicServer([Fail(status=429, message="slow down", retry_after=1.5)]) as server:
        client = _anthropic(server)
        with pytest.raises(anthropic.RateLimitError) as caught:
            await client.messages.create(
                model=MODEL, max_tokens=10, messages=[{"role": "user", "content": "x"}]
            )
        await client.close()
    assert caught.value.body == {
        "type": "error",
        "error": {"type": "rate_limit_error", "message": "slow down"},
    }
    assert caught.value.response.headers["retry-after"] == "1.5"

    async with OpenAIServer([Fail(status=400, message="bad thing")]) as oserver:
        oclient = _openai(oserver)
        with pytest.raises(openai.BadRequestError) as ocaught:
            await oclient.chat.completions.create(
                model="gpt-4o", messages=[{"role": "user", "content": "x"}]
            )
        await oclient.close()
    assert ocaught.value.body == {
        "message": "bad thing",
        "type": "invalid_request_error",
        "param": None,
        "code": None,
    }


async def test_disconnect_drops_the_connection_without_an_answer() -> None:
    async with AnthropicServer([Disconnect()]) as server:
        client = _anthropic(server)
        with pytest.raises(anthropic.APIConnectionError):
            await client.messages.create(
                model=MODEL, max_tokens=10, messages=[{"role": "user", "content": "x"}]
            )
        await client.close()
    assert len(server.requests) == 1


async def test_servers_listen_on_loopback_with_distinct_ports() -> None:
    async with AnthropicServer() as a, OpenAIServer() as o, BedrockServer() as b:
        urls = [a.url, o.url, b.url]
        assert all(u.startswith("http://127.0.0.1:") for u in urls)
        assert len(set(urls)) == 3
        assert o.base_url.endswith("/v1")
    with pytest.raises(RuntimeError, match="not running"):
        _ = a.url


# -- the estimate and the window -----------------------------------------------------------------


async def test_scripted_usage_is_kept_and_an_empty_reply_costs_one_output_token() -> None:
    scripted = Reply("ok", usage=Usage(input_tokens=7, output_tokens=3))
    async with OpenAIServer([scripted, Reply("")]) as server:
        client = _openai(server)
        answers = [
            await client.chat.completions.create(
                model="gpt-4o", messages=[{"role": "user", "content": "x"}]
            )
            for _ in range(2)
        ]
        await client.close()
    usages = [(a.usage.prompt_tokens, a.usage.completion_tokens) for a in answers if a.usage]
    assert usages == [(7, 3), (server.received[1].input_tokens, 1)]


async def test_the_estimate_grows_by_a_token_per_four_bytes_of_prompt() -> None:
    async with AnthropicServer([Reply("a"), Reply("b")]) as server:
        client = _anthropic(server)
        for text in ("x" * 40, "x" * 4040):
            await client.messages.create(
                model=MODEL, max_tokens=10, messages=[{"role": "user", "content": text}]
            )
        await client.close()
    small, large = (r.input_tokens for r in server.received)
    assert large - small == 1000
    assert small == estimate_tokens(server.requests[0]["messages"])


async def test_anthropic_refuses_a_prompt_over_the_window_with_its_own_body() -> None:
    async with AnthropicServer([], window=5) as server:
        client = _anthropic(server)
        with pytest.raises(anthropic.BadRequestError) as caught:
            await client.messages.create(
                model=MODEL,
                max_tokens=10,
                messages=[{"role": "user", "content": "a question of forty bytes, more or less"}],
            )
        await client.close()
    tokens = server.received[0].input_tokens
    assert tokens > 5
    assert caught.value.body == {
        "type": "error",
        "error": {
            "type": "invalid_request_error",
            "message": f"prompt is too long: {tokens} tokens > 5 maximum",
        },
    }


async def test_openai_refuses_a_prompt_over_the_window_with_its_own_body() -> None:
    async with OpenAIServer([], window=5) as server:
        client = _openai(server)
        with pytest.raises(openai.BadRequestError) as caught:
            await client.chat.completions.create(
                model="gpt-4o",
                messages=[{"role": "user", "content": "a question of forty bytes, more or less"}],
            )
        await client.close()
    tokens = server.received[0].input_tokens
    assert caught.value.code == "context_length_exceeded"
    assert caught.value.body == {
        "message": (
            "This model's maximum context length is 5 tokens. However, your messages resulted "
            f"in {tokens} tokens. Please reduce the length of the messages."
        ),
        "type": "invalid_request_error",
        "param": "messages",
        "code": "context_length_exceeded",
    }


async def test_a_refused_request_never_reaches_the_script_callable() -> None:
    seen: list[int] = []

    def script(body: dict[str, Any], n: int) -> Reply:
        seen.append(n)
        return Reply(f"answer {n}")

    async with OpenAIServer(script, window=30) as server:
        client = _openai(server)
        await client.chat.completions.create(
            model="gpt-4o", messages=[{"role": "user", "content": "short"}]
        )
        with pytest.raises(openai.BadRequestError):
            await client.chat.completions.create(
                model="gpt-4o", messages=[{"role": "user", "content": "long " * 100}]
            )
        third = await client.chat.completions.create(
            model="gpt-4o", messages=[{"role": "user", "content": "short again"}]
        )
        await client.close()
    assert seen == [1, 3]  # numbered over all requests; the refused one was not scripted
    assert third.choices[0].message.content == "answer 3"
    assert [r.n for r in server.served] == [1, 3]
    assert [r.n for r in server.refused] == [2]
    assert server.max_input_tokens <= 30
    assert server.received[1].input_tokens > 30


async def test_a_prompt_exactly_at_the_window_is_served() -> None:
    async with AnthropicServer([Reply("a"), Reply("b")]) as server:
        client = _anthropic(server)
        for _ in range(2):
            await client.messages.create(
                model=MODEL, max_tokens=5, messages=[{"role": "user", "content": "hi"}]
            )
            server.window = server.received[0].input_tokens
        await client.close()
    assert not server.refused
    assert server.max_input_tokens == server.window


def test_a_window_must_be_positive() -> None:
    with pytest.raises(ValueError, match="positive"):
        OpenAIServer(window=0)
