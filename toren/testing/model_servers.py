"""Local, wire-compatible model servers for tests: Anthropic, OpenAI and Bedrock.

Each server is scripted with neutral steps (:class:`Reply`, :class:`Fail`, :class:`Disconnect`)
and renders them in its provider's own format, so that the provider's real SDK (and Toren's
adapters through it) can be pointed at it::

    async with AnthropicServer([Reply("hello")]) as server:
        client = anthropic.AsyncAnthropic(base_url=server.base_url, api_key="test")
        ...
        assert len(server.requests) == 1

Every request is counted (:attr:`ScriptedServer.requests`), a request can be held in flight
(:meth:`ScriptedServer.hold`), and :attr:`ScriptedServer.model_time` sums the scripted latency
served. The servers bind 127.0.0.1 only.

Each request's input tokens are estimated (:mod:`toren._agent.estimate`: four UTF-8 bytes of text
per token) and reported as its usage unless the step scripts usage. Given a ``window``, a server
refuses a request estimated over it with its provider's real error (the bodies are cited at each
``render_too_large``), so that what a run does on that failure is tested against the real thing.
"""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import Iterator
from typing import Any

from aiohttp import web

from toren._agent.model import ModelRequest, StopReason, Text, ToolCall, Usage
from toren.testing._scripted import (
    Disconnect,
    Fail,
    Hold,
    ReceivedRequest,
    Reply,
    ScriptedServer,
    Step,
    json_response,
    wire_json,
)
from toren.testing._wire_requests import anthropic_request, bedrock_request, openai_request

__all__ = [
    "AnthropicServer",
    "BedrockServer",
    "Disconnect",
    "Fail",
    "Hold",
    "OpenAIServer",
    "ReceivedRequest",
    "Reply",
    "ScriptedServer",
    "Step",
]


def _chunks(text: str, size: int = 16) -> Iterator[str]:
    """Split text the way a model streams it: a few pieces, never an empty one."""
    for start in range(0, len(text), size):
        yield text[start : start + size]


def _arguments_json(call: ToolCall) -> str:
    if call.arguments is None:
        return call.raw_arguments or ""
    return wire_json(call.arguments).decode()


async def _start_stream(request: web.Request) -> web.StreamResponse:
    response = web.StreamResponse(
        status=200, headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    )
    await response.prepare(request)
    return response


# -- Anthropic Messages API ----------------------------------------------------------------------

_ANTHROPIC_STOP: dict[StopReason, str] = {
    "end": "end_turn",
    "tool_use": "tool_use",
    "max_tokens": "max_tokens",
}
_ANTHROPIC_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    402: "billing_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    504: "timeout_error",
    529: "overloaded_error",
}


class AnthropicServer(ScriptedServer):
    """Speaks the Anthropic Messages API: ``POST /v1/messages``, plain JSON or SSE stream."""

    provider = "anthropic"
    counted_fields = ("system", "messages", "tools")

    def routes(self) -> list[web.RouteDef]:
        return [web.post("/v1/messages", self._handle)]

    def env(self) -> dict[str, str]:
        """``ANTHROPIC_BASE_URL`` and a test ``ANTHROPIC_API_KEY``."""
        return {"ANTHROPIC_BASE_URL": self.base_url, "ANTHROPIC_API_KEY": "test-anthropic-key"}

    def request_of(self, received: ReceivedRequest) -> ModelRequest:
        return anthropic_request(received.body)

    def render_fail(self, step: Fail) -> web.Response:
        error_type = _ANTHROPIC_ERROR_TYPES.get(
            step.status, "api_error" if step.status >= 500 else "invalid_request_error"
        )
        body = {"type": "error", "error": {"type": error_type, "message": step.message}}
        headers = {"request-id": f"req_{uuid.uuid4().hex[:24]}", **self.error_headers(step)}
        return json_response(body, status=step.status, headers=headers)

    def render_too_large(self, received: ReceivedRequest) -> web.Response:
        """400 ``invalid_request_error``, "prompt is too long: N tokens > W maximum", as the
        API sends it (quoted in RipperTs/claude-code-relay#23, boldsoftware/exe.dev#62)."""
        message = f"prompt is too long: {received.input_tokens} tokens > {self.window} maximum"
        return self.render_fail(Fail(status=400, message=message))

    @staticmethod
    def _block(block: Text | ToolCall) -> dict[str, Any]:
        if isinstance(block, Text):
            return {"type": "text", "text": block.text}
        arguments = block.arguments or {}
        return {"type": "tool_use", "id": block.id, "name": block.name, "input": arguments}

    async def render_reply(
        self, request: web.Request, received: ReceivedRequest, step: Reply
    ) -> web.StreamResponse:
        usage = step.usage_for(received.input_tokens)
        message: dict[str, Any] = {
            "id": f"msg_{uuid.uuid4().hex[:24]}",
            "type": "message",
            "role": "assistant",
            "model": received.body.get("model", "claude-scripted"),
            "content": [self._block(b) for b in step.content],
            "stop_reason": _ANTHROPIC_STOP[step.effective_stop_reason],
            "stop_sequence": None,
            "usage": {"input_tokens": usage.input_tokens, "output_tokens": usage.output_tokens},
        }
        if not received.body.get("stream"):
            return json_response(message)
        return await self._stream(request, message, step, usage)

    async def _stream(
        self, request: web.Request, message: dict[str, Any], step: Reply, usage: Usage
    ) -> web.StreamResponse:
        response = await _start_stream(request)

        async def send(event: str, data: dict[str, Any]) -> None:
            await response.write(b"event: " + event.encode() + b"\ndata: " + wire_json(data))
            await response.write(b"\n\n")

        start = dict(message, content=[], stop_reason=None)
        start["usage"] = {"input_tokens": usage.input_tokens, "output_tokens": 1}
        try:
            await send("message_start", {"type": "message_start", "message": start})
            await send("ping", {"type": "ping"})
            for index, block in enumerate(step.content):
                if isinstance(block, Text):
                    first: dict[str, Any] = {"type": "text", "text": ""}
                    deltas = [{"type": "text_delta", "text": t} for t in _chunks(block.text)]
                else:
                    first = {"type": "tool_use", "id": block.id, "name": block.name, "input": {}}
                    deltas = [
                        {"type": "input_json_delta", "partial_json": p}
                        for p in _chunks(_arguments_json(block))
                    ]
                await send(
                    "content_block_start",
                    {"type": "content_block_start", "index": index, "content_block": first},
                )
                for delta in deltas:
                    await send(
                        "content_block_delta",
                        {"type": "content_block_delta", "index": index, "delta": delta},
                    )
                await send("content_block_stop", {"type": "content_block_stop", "index": index})
            await send(
                "message_delta",
                {
                    "type": "message_delta",
                    "delta": {"stop_reason": message["stop_reason"], "stop_sequence": None},
                    "usage": {"output_tokens": usage.output_tokens},
                },
            )
            await send("message_stop", {"type": "message_stop"})
            await response.write_eof()
        except ConnectionResetError:
            pass  # the client went away mid-stream; nothing left to tell it
        return response


# -- OpenAI Chat Completions ---------------------------------------------------------------------

_OPENAI_FINISH: dict[StopReason, str] = {
    "end": "stop",
    "tool_use": "tool_calls",
    "max_tokens": "length",
}
_OPENAI_ERRORS: dict[int, tuple[str, str | None]] = {
    400: ("invalid_request_error", None),
    401: ("invalid_request_error", "invalid_api_key"),
    403: ("invalid_request_error", "unsupported_country_region_territory"),
    404: ("invalid_request_error", "model_not_found"),
    429: ("requests", "rate_limit_exceeded"),
}


class OpenAIServer(ScriptedServer):
    """Speaks OpenAI Chat Completions: ``POST /v1/chat/completions``, plain JSON or chunks."""

    provider = "openai"
    counted_fields = ("messages", "tools")

    def routes(self) -> list[web.RouteDef]:
        return [web.post("/v1/chat/completions", self._handle)]

    @property
    def base_url(self) -> str:
        """``http://127.0.0.1:<port>/v1``, as the openai SDK expects it."""
        return f"{self.url}/v1"

    def env(self) -> dict[str, str]:
        """``OPENAI_BASE_URL`` and a test ``OPENAI_API_KEY``."""
        return {"OPENAI_BASE_URL": self.base_url, "OPENAI_API_KEY": "test-openai-key"}

    def request_of(self, received: ReceivedRequest) -> ModelRequest:
        return openai_request(received.body)

    def render_fail(self, step: Fail) -> web.Response:
        error_type, code = _OPENAI_ERRORS.get(
            step.status, ("server_error" if step.status >= 500 else "invalid_request_error", None)
        )
        body = {"error": {"message": step.message, "type": error_type, "param": None, "code": code}}
        headers = {"x-request-id": f"req_{uuid.uuid4().hex}", **self.error_headers(step)}
        return json_response(body, status=step.status, headers=headers)

    def render_too_large(self, received: ReceivedRequest) -> web.Response:
        """400 ``context_length_exceeded`` as the API sends it (the body quoted in
        chathub-dev/chathub#126 and crewAIInc/crewAI-examples#121)."""
        message = (
            f"This model's maximum context length is {self.window} tokens. However, your "
            f"messages resulted in {received.input_tokens} tokens. Please reduce the length "
            "of the messages."
        )
        body = {
            "error": {
                "message": message,
                "type": "invalid_request_error",
                "param": "messages",
                "code": "context_length_exceeded",
            }
        }
        headers = {"x-request-id": f"req_{uuid.uuid4().hex}"}
        return json_response(body, status=400, headers=headers)

    @staticmethod
    def _usage(usage: Usage) -> dict[str, int]:
        return {
            "prompt_tokens": usage.input_tokens,
            "completion_tokens": usage.output_tokens,
            "total_tokens": usage.input_tokens + usage.output_tokens,
        }

    async def render_reply(
        self, request: web.Request, received: ReceivedRequest, step: Reply
    ) -> web.StreamResponse:
        text = "".join(b.text for b in step.content if isinstance(b, Text))
        calls = [b for b in step.content if isinstance(b, ToolCall)]
        head = {
            "id": f"chatcmpl-{uuid.uuid4().hex[:24]}",
            "created": int(time.time()),
            "model": received.body.get("model", "gpt-scripted"),
            "system_fingerprint": None,
        }
        finish = _OPENAI_FINISH[step.effective_stop_reason]
        if not received.body.get("stream"):
            message: dict[str, Any] = {
                "role": "assistant",
                "content": text if text or not calls else None,
                "refusal": None,
            }
            if calls:
                message["tool_calls"] = [
                    {
                        "id": c.id,
                        "type": "function",
                        "function": {"name": c.name, "arguments": _arguments_json(c)},
                    }
                    for c in calls
                ]
            body = {
                **head,
                "object": "chat.completion",
                "choices": [
                    {"index": 0, "message": message, "logprobs": None, "finish_reason": finish}
                ],
                "usage": self._usage(step.usage_for(received.input_tokens)),
            }
            return json_response(body)
        return await self._stream(request, received, head, text, calls, finish, step)

    async def _stream(
        self,
        request: web.Request,
        received: ReceivedRequest,
        head: dict[str, Any],
        text: str,
        calls: list[ToolCall],
        finish: str,
        step: Reply,
    ) -> web.StreamResponse:
        options = received.body.get("stream_options") or {}
        include_usage = bool(options.get("include_usage"))
        response = await _start_stream(request)

        async def send(delta: dict[str, Any], finish_reason: str | None = None) -> None:
            chunk: dict[str, Any] = {
                **head,
                "object": "chat.completion.chunk",
                "choices": [
                    {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
                ],
            }
            if include_usage:
                chunk["usage"] = None
            await response.write(b"data: " + wire_json(chunk) + b"\n\n")

        try:
            await send({"role": "assistant", "content": "", "refusal": None})
            for piece in _chunks(text):
                await send({"content": piece})
            for index, call in enumerate(calls):
                await send(
                    {
                        "tool_calls": [
                            {
                                "index": index,
                                "id": call.id,
                                "type": "function",
                                "function": {"name": call.name, "arguments": ""},
                            }
                        ]
                    }
                )
                for piece in _chunks(_arguments_json(call)):
                    await send({"tool_calls": [{"index": index, "function": {"arguments": piece}}]})
            await send({}, finish)
            if include_usage:
                last = {
                    **head,
                    "object": "chat.completion.chunk",
                    "choices": [],
                    "usage": self._usage(step.usage_for(received.input_tokens)),
                }
                await response.write(b"data: " + wire_json(last) + b"\n\n")
            await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
        except ConnectionResetError:
            pass  # the client went away mid-stream
        return response


# -- Bedrock Converse ----------------------------------------------------------------------------

_BEDROCK_STOP: dict[StopReason, str] = {
    "end": "end_turn",
    "tool_use": "tool_use",
    "max_tokens": "max_tokens",
}
_ANTHROPIC_MODEL = re.compile(r"(^|[./])anthropic\.")
_BEDROCK_ERRORS = {
    400: "ValidationException",
    403: "AccessDeniedException",
    404: "ResourceNotFoundException",
    408: "ModelTimeoutException",
    424: "ModelErrorException",
    429: "ThrottlingException",
    500: "InternalServerException",
    503: "ServiceUnavailableException",
}


def _model_id(received: ReceivedRequest) -> str:
    return received.path.removeprefix("/model/").removesuffix("/converse")


class BedrockServer(ScriptedServer):
    """Speaks Bedrock Runtime Converse: ``POST /model/{modelId}/converse`` (any SigV4 signature).

    The model id of each request is in its path (``server.received[i].path``); the recorded body
    is the Converse request as the SDK sent it.
    """

    provider = "bedrock"
    counted_fields = ("system", "messages", "toolConfig")

    def routes(self) -> list[web.RouteDef]:
        return [web.post(r"/model/{model_id:.+}/converse", self._handle)]

    def env(self) -> dict[str, str]:
        """``TOREN_BEDROCK_ENDPOINT_URL``, a region and static test credentials."""
        return {
            "TOREN_BEDROCK_ENDPOINT_URL": self.base_url,
            "AWS_REGION": "us-east-1",
            "AWS_ACCESS_KEY_ID": "AKIDTESTTESTTEST",
            "AWS_SECRET_ACCESS_KEY": "test-secret",
        }

    @property
    def model_ids(self) -> list[str]:
        """The model id each request named in its path, in arrival order."""
        return [_model_id(r) for r in self.received]

    def request_of(self, received: ReceivedRequest) -> ModelRequest:
        return bedrock_request(received.body, _model_id(received))

    def render_fail(self, step: Fail) -> web.Response:
        error_type = _BEDROCK_ERRORS.get(
            step.status,
            "InternalServerException" if step.status >= 500 else "ValidationException",
        )
        headers = {
            "x-amzn-ErrorType": f"{error_type}:http://internal.amazon.com/coral/com.amazon.bedrock/",
            "x-amzn-RequestId": str(uuid.uuid4()),
            **self.error_headers(step),
        }
        return json_response({"message": step.message}, status=step.status, headers=headers)

    def render_too_large(self, received: ReceivedRequest) -> web.Response:
        """400 ``ValidationException``. An Anthropic model's refusal comes in its own words,
        "The model returned the following errors: prompt is too long: N tokens > W maximum"
        (quoted in daisuke-awaji/moca#254); other models get Bedrock's "Input is too long for
        requested model." (aws-samples/bedrock-chat#95)."""
        if _ANTHROPIC_MODEL.search(_model_id(received)):
            message = (
                "The model returned the following errors: prompt is too long: "
                f"{received.input_tokens} tokens > {self.window} maximum"
            )
        else:
            message = "Input is too long for requested model."
        return self.render_fail(Fail(status=400, message=message))

    async def render_reply(
        self, request: web.Request, received: ReceivedRequest, step: Reply
    ) -> web.StreamResponse:
        content: list[dict[str, Any]] = []
        for block in step.content:
            if isinstance(block, Text):
                content.append({"text": block.text})
            else:
                arguments = block.arguments or {}
                tool_use = {"toolUseId": block.id, "name": block.name, "input": arguments}
                content.append({"toolUse": tool_use})
        usage = step.usage_for(received.input_tokens)
        body = {
            "output": {"message": {"role": "assistant", "content": content}},
            "stopReason": _BEDROCK_STOP[step.effective_stop_reason],
            "usage": {
                "inputTokens": usage.input_tokens,
                "outputTokens": usage.output_tokens,
                "totalTokens": usage.input_tokens + usage.output_tokens,
            },
            "metrics": {"latencyMs": round(step.latency * 1000)},
        }
        return json_response(body, headers={"x-amzn-RequestId": str(uuid.uuid4())})
