"""Anthropic Messages API through the official ``anthropic`` SDK (its retries off).

``ModelRequest.temperature`` is not sent: the current API version refuses sampling parameters.

Environment: ``ANTHROPIC_API_KEY`` (required), ``ANTHROPIC_BASE_URL`` (optional; the SDK's own
setting, honoured as is).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from typing import Any

import anthropic
from anthropic.types import (
    AssistantMessageParam,
    ContentBlockParam,
    MessageParam,
    TextBlockParam,
    ToolParam,
    ToolResultBlockParam,
    ToolUseBlockParam,
    UserMessageParam,
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
    parse_retry_after,
    redact_url,
    require_env,
    retryable_status,
)

logger = logging.getLogger("toren.providers")

_STOP: dict[str, StopReason] = {
    "end_turn": "end",
    "stop_sequence": "end",
    "pause_turn": "end",
    "refusal": "end",
    "tool_use": "tool_use",
    "max_tokens": "max_tokens",
    "model_context_window_exceeded": "max_tokens",
}


# Anthropic refuses a prompt over the model's window with a 400 invalid_request_error whose
# message reads "prompt is too long: 200082 tokens > 200000 maximum" (quoted in
# RipperTs/claude-code-relay#23 and boldsoftware/exe.dev#62), and a request over its byte limit
# with a 413: {"type": "request_too_large", "message": "Request exceeds the maximum size"}
# (anthropics/anthropic-sdk-python#938), or an invalid_request_error "Request size exceeds model
# context window" (anthropics/claude-code#6380).
_TOO_LONG = re.compile(r"prompt is too long|exceeds model context window", re.I)
_PAYLOAD_TOO_LARGE = 413


def too_large(status: int, message: str) -> bool:
    """Whether an Anthropic error says the request is over the model's window or size limit."""
    return status == _PAYLOAD_TOO_LARGE or (status == 400 and bool(_TOO_LONG.search(message)))


def _user_content(message: Message) -> list[ContentBlockParam]:
    # Anthropic wants the tool results of a user turn before any text in it.
    results: list[ContentBlockParam] = []
    texts: list[ContentBlockParam] = []
    for block in message.content:
        if isinstance(block, ToolResult):
            result: ToolResultBlockParam = {
                "type": "tool_result",
                "tool_use_id": block.tool_call_id,
                "content": block.content,
            }
            if block.is_error:
                result["is_error"] = True
            results.append(result)
        elif isinstance(block, Text):
            text: TextBlockParam = {"type": "text", "text": block.text}
            texts.append(text)
    return results + texts


def _assistant_content(message: Message) -> list[ContentBlockParam]:
    content: list[ContentBlockParam] = []
    for block in message.content:
        if isinstance(block, Text):
            text: TextBlockParam = {"type": "text", "text": block.text}
            content.append(text)
        elif isinstance(block, ToolCall):
            tool_use: ToolUseBlockParam = {
                "type": "tool_use",
                "id": block.id,
                "name": block.name,
                "input": block.arguments if block.arguments is not None else {},
            }
            content.append(tool_use)
    return content


def to_wire(request: ModelRequest) -> dict[str, Any]:
    """The keyword arguments of ``messages.create`` for ``request``."""
    messages: list[MessageParam] = []
    for m in request.messages:
        if m.role == "user":
            user: UserMessageParam = {"role": "user", "content": _user_content(m)}
            messages.append(user)
        else:
            assistant: AssistantMessageParam = {
                "role": "assistant",
                "content": _assistant_content(m),
            }
            messages.append(assistant)
    kwargs: dict[str, Any] = {
        "model": request.model,
        "max_tokens": request.max_tokens,
        "messages": messages,
    }
    if request.system:
        kwargs["system"] = request.system
    # No temperature: API version 2026-10-21 (the SDK 2.x default) refuses sampling parameters
    # with a 400, and the SDK no longer accepts them.
    if request.tools:
        tools: list[ToolParam] = [
            {"name": t.name, "description": t.description, "input_schema": t.input_schema}
            for t in request.tools
        ]
        kwargs["tools"] = tools
    return kwargs


def from_wire(message: anthropic.types.Message) -> ModelResponse:
    """The neutral response for an Anthropic ``Message`` (other block kinds are dropped)."""
    content: list[Text | ToolCall] = []
    for block in message.content:
        if block.type == "text":
            content.append(Text(text=block.text))
        elif block.type == "tool_use":
            arguments = block.input if isinstance(block.input, dict) else None
            raw = None if arguments is not None else repr(block.input)
            content.append(
                ToolCall(id=block.id, name=block.name, arguments=arguments, raw_arguments=raw)
            )
    usage = message.usage
    # Cached prompt tokens are reported apart; the prompt's size is their sum.
    input_tokens = (
        usage.input_tokens
        + (usage.cache_creation_input_tokens or 0)
        + (usage.cache_read_input_tokens or 0)
    )
    return ModelResponse(
        content=tuple(content),
        stop_reason=_STOP.get(message.stop_reason or "end_turn", "end"),
        usage=Usage(input_tokens=input_tokens, output_tokens=usage.output_tokens),
        model=message.model,
        response_id=message.id,
    )


class AnthropicProvider(RetryingProvider):
    """Calls ``messages.create`` (non-streaming) with the SDK's retries turned off."""

    name = "anthropic"

    def __init__(self, *, model: str, env: Mapping[str, str], retry: RetryPolicy) -> None:
        super().__init__(model=model, env=env, retry=retry)
        self._client: anthropic.AsyncAnthropic | None = None
        self._warned_temperature = False

    def _sdk(self) -> anthropic.AsyncAnthropic:
        if self._client is None:
            api_key = require_env(self._env, "ANTHROPIC_API_KEY", "the anthropic provider")
            base_url = self._env.get("ANTHROPIC_BASE_URL")  # None: the SDK's own default
            if base_url:
                logger.debug("anthropic base URL: %s", redact_url(base_url))
            self._client = anthropic.AsyncAnthropic(
                api_key=api_key,
                base_url=base_url,
                max_retries=0,
                # The SDK's aiohttp transport (its documented option for concurrency): with
                # httpx's pool, every request probed each idle connection of the pool (two
                # system calls and a dict apiece), a tenth of a worker's time at 50 runs in
                # flight, growing with the runs in flight.
                http_client=anthropic.DefaultAioHttpClient(),
            )
        return self._client

    async def _send(self, request: ModelRequest) -> ModelResponse:
        client = self._sdk()
        if request.temperature is not None and not self._warned_temperature:
            self._warned_temperature = True
            logger.warning(
                "anthropic: temperature=%g is not sent; the Messages API no longer accepts "
                "sampling parameters",
                request.temperature,
            )
        # An explicit timeout also lifts the SDK's refusal of large non-streaming max_tokens;
        # the attempt's own deadline is the cancel scope around this call.
        message = await client.messages.create(
            **to_wire(request), timeout=self.retry.attempt_timeout
        )
        return from_wire(message)

    def _classify(self, exc: Exception) -> ProviderError | None:
        if isinstance(exc, anthropic.APIResponseValidationError):
            return ProviderError(
                provider=self.name,
                status=exc.status_code,
                message=f"the answer does not fit the API: {exc.message}",
                retryable=False,
                answered=True,
            )
        if isinstance(exc, anthropic.APIStatusError):
            message = exc.api_message or exc.message
            return ProviderError(
                provider=self.name,
                status=exc.status_code,
                message=message,
                retryable=retryable_status(exc.status_code),
                retry_after=parse_retry_after(exc.response.headers),
                too_large=too_large(exc.status_code, message),
            )
        if isinstance(exc, anthropic.APITimeoutError):
            return ProviderError(
                provider=self.name, status=None, message="request timed out", retryable=True
            )
        if isinstance(exc, anthropic.APIConnectionError):
            cause = exc.__cause__
            detail = f"{exc.message} ({cause})" if cause is not None else exc.message
            return ProviderError(provider=self.name, status=None, message=detail, retryable=True)
        if isinstance(exc, anthropic.AnthropicError):
            return ProviderError(provider=self.name, status=None, message=str(exc), retryable=False)
        return None

    async def aclose(self) -> None:
        """Close the SDK client's connections."""
        if self._client is not None:
            await self._client.close()
            self._client = None
