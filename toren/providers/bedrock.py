"""Amazon Bedrock's Converse API through ``aioboto3`` (botocore's retries off).

Environment: ``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY`` (and ``AWS_SESSION_TOKEN``), or
else botocore's usual chain (``AWS_PROFILE``, shared files, container and instance roles);
``AWS_REGION`` or ``AWS_DEFAULT_REGION`` (default ``us-east-1``); ``TOREN_BEDROCK_ENDPOINT_URL``
to talk to another endpoint (a VPC endpoint, a proxy, a local test server).
"""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import Mapping
from typing import Any

import aioboto3  # type: ignore[import-untyped]
import anyio
import botocore.exceptions  # type: ignore[import-untyped]
from aiobotocore.config import AioConfig  # type: ignore[import-untyped]

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
from toren._core.errors import ConfigError
from toren.providers._base import (
    ProviderError,
    RetryingProvider,
    RetryPolicy,
    parse_retry_after,
    redact_url,
    retryable_status,
)

logger = logging.getLogger("toren.providers")

DEFAULT_REGION = "us-east-1"
_REQUEST_TIMEOUT = 408  # Bedrock's ModelTimeoutException: a timeout, so worth another attempt

# Bedrock refuses a request over the model's window with a 400 ValidationException: "Input is
# too long for requested model." (aws-samples/bedrock-chat#95), or, for Anthropic models, the
# model's own words: "The model returned the following errors: prompt is too long: 200049
# tokens > 200000 maximum" (daisuke-awaji/moca#254).
_TOO_LONG = re.compile(r"input is too long|prompt is too long", re.I)


def too_large(status: int | None, code: str, message: str) -> bool:
    """Whether a Bedrock error says the request is over the model's context window."""
    return status == 400 and code == "ValidationException" and bool(_TOO_LONG.search(message))


_STOP: dict[str, StopReason] = {
    "end_turn": "end",
    "stop_sequence": "end",
    "guardrail_intervened": "end",
    "content_filtered": "end",
    "malformed_model_output": "end",
    "malformed_tool_use": "end",
    "tool_use": "tool_use",
    "max_tokens": "max_tokens",
    "model_context_window_exceeded": "max_tokens",
}


def _content(message: Message) -> list[dict[str, Any]]:
    content: list[dict[str, Any]] = []
    results = [b for b in message.content if isinstance(b, ToolResult)]
    others = [b for b in message.content if not isinstance(b, ToolResult)]
    for block in [*results, *others]:  # tool results lead their turn, as Anthropic models want
        if isinstance(block, Text):
            content.append({"text": block.text})
        elif isinstance(block, ToolCall):
            arguments = block.arguments if block.arguments is not None else {}
            content.append(
                {"toolUse": {"toolUseId": block.id, "name": block.name, "input": arguments}}
            )
        else:
            content.append(
                {
                    "toolResult": {
                        "toolUseId": block.tool_call_id,
                        "content": [{"text": block.content}],
                        "status": "error" if block.is_error else "success",
                    }
                }
            )
    return content


def to_wire(request: ModelRequest) -> dict[str, Any]:
    """The keyword arguments of ``converse`` for ``request``."""
    inference: dict[str, Any] = {"maxTokens": request.max_tokens}
    if request.temperature is not None:
        inference["temperature"] = request.temperature
    kwargs: dict[str, Any] = {
        "modelId": request.model,
        "messages": [{"role": m.role, "content": _content(m)} for m in request.messages],
        "inferenceConfig": inference,
    }
    if request.system:
        kwargs["system"] = [{"text": request.system}]
    if request.tools:
        kwargs["toolConfig"] = {
            "tools": [
                {
                    "toolSpec": {
                        "name": t.name,
                        "description": t.description,
                        "inputSchema": {"json": t.input_schema},
                    }
                }
                for t in request.tools
            ]
        }
    return kwargs


def from_wire(model: str, response: Mapping[str, Any]) -> ModelResponse:
    """The neutral response for a Converse response (other block kinds are dropped)."""
    message = response.get("output", {}).get("message", {})
    content: list[Text | ToolCall] = []
    for block in message.get("content", []):
        if "text" in block:
            content.append(Text(text=block["text"]))
        elif "toolUse" in block:
            use = block["toolUse"]
            arguments = use.get("input")
            content.append(
                ToolCall(
                    id=use["toolUseId"],
                    name=use["name"],
                    arguments=arguments if isinstance(arguments, dict) else None,
                    raw_arguments=None if isinstance(arguments, dict) else repr(arguments),
                )
            )
    usage = response.get("usage", {})
    # Cached prompt tokens are reported apart; the prompt's size is their sum.
    input_tokens = (
        usage.get("inputTokens", 0)
        + usage.get("cacheReadInputTokens", 0)
        + usage.get("cacheWriteInputTokens", 0)
    )
    return ModelResponse(
        content=tuple(content),
        stop_reason=_STOP.get(response.get("stopReason", "end_turn"), "end"),
        usage=Usage(input_tokens=input_tokens, output_tokens=usage.get("outputTokens", 0)),
        model=model,
        response_id=response.get("ResponseMetadata", {}).get("RequestId", ""),
    )


class BedrockProvider(RetryingProvider):
    """Calls Bedrock Runtime ``converse`` with botocore's retries turned off."""

    name = "bedrock"

    def __init__(self, *, model: str, env: Mapping[str, str], retry: RetryPolicy) -> None:
        super().__init__(model=model, env=env, retry=retry)
        self._stack = contextlib.AsyncExitStack()
        self._client: Any = None
        self._lock = anyio.Lock()

    def _session(self) -> Any:
        env = self._env
        region = env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION") or DEFAULT_REGION
        key_id, secret = env.get("AWS_ACCESS_KEY_ID"), env.get("AWS_SECRET_ACCESS_KEY")
        if key_id and secret:
            return aioboto3.Session(
                aws_access_key_id=key_id,
                aws_secret_access_key=secret,
                aws_session_token=env.get("AWS_SESSION_TOKEN") or None,
                region_name=region,
            )
        if key_id or secret:
            missing = "AWS_SECRET_ACCESS_KEY" if key_id else "AWS_ACCESS_KEY_ID"
            raise ConfigError(
                f"the bedrock provider needs {missing} alongside "
                f"{'AWS_ACCESS_KEY_ID' if key_id else 'AWS_SECRET_ACCESS_KEY'}, which is set",
                hint="set both, or neither to use AWS_PROFILE or an instance role",
            )
        return aioboto3.Session(profile_name=env.get("AWS_PROFILE") or None, region_name=region)

    async def _sdk(self) -> Any:
        async with self._lock:
            if self._client is None:
                endpoint = self._env.get("TOREN_BEDROCK_ENDPOINT_URL") or None
                if endpoint:
                    logger.debug("bedrock endpoint: %s", redact_url(endpoint))
                config = AioConfig(
                    retries={"total_max_attempts": 1, "mode": "standard"},
                    connect_timeout=10,
                    read_timeout=self.retry.attempt_timeout,
                )
                self._client = await self._stack.enter_async_context(
                    self._session().client("bedrock-runtime", endpoint_url=endpoint, config=config)
                )
            return self._client

    async def _send(self, request: ModelRequest) -> ModelResponse:
        client = await self._sdk()
        try:
            response = await client.converse(**to_wire(request))
        except botocore.exceptions.NoCredentialsError as exc:
            raise ConfigError(
                "the bedrock provider found no AWS credentials",
                hint=(
                    "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE, "
                    "or run with an instance or task role)"
                ),
            ) from exc
        return from_wire(request.model, response)

    def _classify(self, exc: Exception) -> ProviderError | None:
        if isinstance(exc, botocore.exceptions.ClientError):
            response: Mapping[str, Any] = exc.response
            meta = response.get("ResponseMetadata", {})
            status = int(meta.get("HTTPStatusCode", 0)) or None
            error = response.get("Error", {})
            code = error.get("Code") or ""
            message = error.get("Message") or code or str(exc)
            return ProviderError(
                provider=self.name,
                status=status,
                message=message,
                retryable=status is not None
                and (retryable_status(status) or status == _REQUEST_TIMEOUT),
                retry_after=parse_retry_after(meta.get("HTTPHeaders")),
                too_large=too_large(status, code, message),
            )
        if isinstance(exc, botocore.exceptions.HTTPClientError):
            # Connection refused or reset, read or connect timeouts: no answer came.
            return ProviderError(provider=self.name, status=None, message=str(exc), retryable=True)
        if isinstance(exc, botocore.exceptions.BotoCoreError):
            return ProviderError(provider=self.name, status=None, message=str(exc), retryable=False)
        return None

    async def aclose(self) -> None:
        """Close the botocore client's connections."""
        self._client = None
        await self._stack.aclose()
