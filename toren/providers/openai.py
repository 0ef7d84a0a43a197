"""OpenAI Chat Completions through the official ``openai`` SDK (its retries off).

Chat Completions is also what Ollama, vLLM and most gateways speak: point ``OPENAI_BASE_URL`` at
them. Environment: ``OPENAI_API_KEY`` (required; any value for a gateway that needs none),
``OPENAI_BASE_URL`` (optional; the SDK's own setting, honoured as is).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from typing import Any

import aiohttp
import openai
from openai.types.chat import (
    ChatCompletion,
    ChatCompletionAssistantMessageParam,
    ChatCompletionFunctionToolParam,
    ChatCompletionMessageFunctionToolCallParam,
    ChatCompletionMessageParam,
)

from toren._agent.model import (
    Message,
    ModelRequest,
    ModelResponse,
    StopReason,
    Text,
    ToolCall,
    ToolResult,
    Usage,
)
from toren.providers._base import (
    ProviderError,
    RetryingProvider,
    RetryPolicy,
    _first_line,
    parse_retry_after,
    redact_url,
    require_env,
    retryable_status,
)

logger = logging.getLogger("toren.providers")

_FINISH: dict[str, StopReason] = {
    "stop": "end",
    "content_filter": "end",
    "tool_calls": "tool_use",
    "function_call": "tool_use",
    "length": "max_tokens",
}


def _arguments(call: ToolCall) -> str:
    if call.arguments is not None:
        return json.dumps(call.arguments, ensure_ascii=False)
    return call.raw_arguments or "{}"


def _messages(message: Message) -> list[ChatCompletionMessageParam]:
    """One neutral turn as Chat Completions messages (tool results become ``tool`` messages)."""
    text = "".join(b.text for b in message.content if isinstance(b, Text))
    if message.role == "assistant":
        calls: list[ChatCompletionMessageFunctionToolCallParam] = [
            {
                "id": b.id,
                "type": "function",
                "function": {"name": b.name, "arguments": _arguments(b)},
            }
            for b in message.content
            if isinstance(b, ToolCall)
        ]
        assistant: ChatCompletionAssistantMessageParam = {
            "role": "assistant",
            "content": text or None,
        }
        if calls:
            assistant["tool_calls"] = calls
        return [assistant]
    out: list[ChatCompletionMessageParam] = []
    for block in message.content:
        if isinstance(block, ToolResult):
            # Chat Completions has no error flag on tool results; say it in the content.
            content = f"Error: {block.content}" if block.is_error else block.content
            out.append({"role": "tool", "tool_call_id": block.tool_call_id, "content": content})
    if text:
        out.append({"role": "user", "content": text})
    return out


def to_wire(request: ModelRequest) -> dict[str, Any]:
    """The keyword arguments of ``chat.completions.create`` for ``request``."""
    messages: list[ChatCompletionMessageParam] = []
    if request.system:
        messages.append({"role": "system", "content": request.system})
    for message in request.messages:
        messages.extend(_messages(message))
    kwargs: dict[str, Any] = {
        "model": request.model,
        "messages": messages,
        "max_completion_tokens": request.max_tokens,
    }
    if request.temperature is not None:
        kwargs["temperature"] = request.temperature
    if request.tools:
        tools: list[ChatCompletionFunctionToolParam] = [
            {
                "type": "function",
                "function": {
                    "name": t.name,
                    "description": t.description,
                    "parameters": t.input_schema,
                },
            }
            for t in request.tools
        ]
        kwargs["tools"] = tools
    return kwargs


def parse_arguments(raw: str) -> dict[str, Any] | None:
    """The JSON object in ``raw``, or ``None`` when it is not one (never raises)."""
    try:
        value = json.loads(raw)
    except (ValueError, TypeError, RecursionError):  # not JSON, not text, nested too deeply
        return None
    return value if isinstance(value, dict) else None


def from_wire(completion: ChatCompletion) -> ModelResponse:
    """The neutral response for the first choice of a ``ChatCompletion``."""
    content: list[Text | ToolCall] = []
    finish = "stop"
    if completion.choices:
        choice = completion.choices[0]
        finish = choice.finish_reason
        if choice.message.content:
            content.append(Text(text=choice.message.content))
        for call in choice.message.tool_calls or ():
            if call.type != "function":
                continue
            raw = call.function.arguments
            arguments = parse_arguments(raw)
            content.append(
                ToolCall(
                    id=call.id,
                    name=call.function.name,
                    arguments=arguments,
                    raw_arguments=None if arguments is not None else raw,
                )
            )
    usage = completion.usage
    return ModelResponse(
        content=tuple(content),
        stop_reason=_FINISH.get(finish, "end"),
        usage=Usage(
            input_tokens=usage.prompt_tokens if usage else 0,
            output_tokens=usage.completion_tokens if usage else 0,
        ),
        model=completion.model,
        response_id=completion.id,
    )


def too_large(exc: openai.APIStatusError, message: str) -> bool:
    """Whether an OpenAI error says the request is over the model's context window.

    OpenAI answers 400 with ``"code": "context_length_exceeded"`` and a message "This model's
    maximum context length is 8192 tokens. However, your messages resulted in 8227 tokens. ..."
    (quoted in crewAIInc/crewAI-examples#121 and chathub-dev/chathub#126); gateways that copy the
    message but not the code are recognised by it.
    """
    if exc.status_code != 400:
        return False
    return exc.code == "context_length_exceeded" or "maximum context length" in message.lower()


def _error_message(exc: openai.APIStatusError) -> str:
    body = exc.body
    if isinstance(body, dict):
        message = body.get("message")
        if isinstance(message, str) and message:
            return message
    return exc.message


class OpenAIProvider(RetryingProvider):
    """Calls ``chat.completions.create`` with the SDK's retries turned off."""

    name = "openai"

    def __init__(self, *, model: str, env: Mapping[str, str], retry: RetryPolicy) -> None:
        super().__init__(model=model, env=env, retry=retry)
        self._client: openai.AsyncOpenAI | None = None

    def _sdk(self) -> openai.AsyncOpenAI:
        if self._client is None:
            api_key = require_env(
                self._env,
                "OPENAI_API_KEY",
                "the openai provider",
                hint="export OPENAI_API_KEY=... (any value for a local gateway that needs no key)",
            )
            base_url = self._env.get("OPENAI_BASE_URL")  # None: the SDK's own default
            if base_url:
                logger.debug("openai base URL: %s", redact_url(base_url))
            self._client = openai.AsyncOpenAI(
                api_key=api_key,
                base_url=base_url,
                max_retries=0,
                # As for Anthropic: the SDK's aiohttp transport (see anthropic.py).
                http_client=openai.DefaultAioHttpClient(),
            )
        return self._client

    async def _send(self, request: ModelRequest) -> ModelResponse:
        client = self._sdk()
        completion = await client.chat.completions.create(
            **to_wire(request), timeout=self.retry.attempt_timeout
        )
        return from_wire(completion)

    def _classify(self, exc: Exception) -> ProviderError | None:
        if isinstance(exc, openai.APIResponseValidationError):
            return ProviderError(
                provider=self.name,
                status=exc.status_code,
                message=f"the answer does not fit the API: {exc.message}",
                retryable=False,
                answered=True,
            )
        if isinstance(exc, openai.APIStatusError):
            message = _error_message(exc)
            return ProviderError(
                provider=self.name,
                status=exc.status_code,
                message=message,
                retryable=retryable_status(exc.status_code),
                retry_after=parse_retry_after(exc.response.headers),
                too_large=too_large(exc, message),
            )
        failed = _connection_failure(exc)
        if failed is not None:
            # The SDK's aiohttp transport reports a connection that failed (refused, closed
            # without an answer) as a connect timeout, and leaves an answer it cannot parse (a
            # status line that is none, a server that does not speak HTTP) unwrapped: no model
            # answered either way, a connection error to retry, as it was over httpx.
            return ProviderError(
                provider=self.name,
                status=None,
                message=f"Connection error. ({_first_line(failed)})",
                retryable=True,
            )
        if isinstance(exc, openai.APITimeoutError):
            return ProviderError(
                provider=self.name, status=None, message="request timed out", retryable=True
            )
        if isinstance(exc, openai.APIConnectionError):
            cause = exc.__cause__
            detail = f"{exc.message} ({cause})" if cause is not None else exc.message
            return ProviderError(provider=self.name, status=None, message=detail, retryable=True)
        if isinstance(exc, openai.OpenAIError):
            return ProviderError(provider=self.name, status=None, message=str(exc), retryable=False)
        return None

    async def aclose(self) -> None:
        """Close the SDK client's connections."""
        if self._client is not None:
            await self._client.close()
            self._client = None


def _connection_failure(exc: BaseException) -> aiohttp.ClientError | None:
    """The aiohttp error behind ``exc`` (itself, or in its chain of causes) if it is a
    connection's failure and not a timeout; ``None`` otherwise."""
    seen: BaseException | None = exc
    for _ in range(8):  # the SDK's error, httpx's, aiohttp's: a chain this short
        if seen is None:
            break
        if isinstance(seen, aiohttp.ClientError) and not isinstance(seen, TimeoutError):
            return seen
        seen = seen.__cause__
    return None
