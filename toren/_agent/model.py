"""The model-call vocabulary shared by every provider: requests, responses, content blocks, usage.

A run talks to models only in these terms; each provider adapter maps them to its wire format
(Anthropic Messages, OpenAI Chat Completions, Bedrock Converse) and back. They are plain frozen
attrs classes so that a request has one canonical form (the base of its digest) and a response
can be journaled and replayed by value.
"""

from __future__ import annotations

from typing import Any, Literal

import attrs

StopReason = Literal["end", "tool_use", "max_tokens"]
Role = Literal["user", "assistant"]


@attrs.frozen(kw_only=True)
class Text:
    """A text block."""

    text: str


@attrs.frozen(kw_only=True)
class ToolCall:
    """The model asks for a tool to run.

    ``arguments`` is the parsed JSON object, or ``None`` when the model produced arguments that
    are not a JSON object; ``raw_arguments`` then keeps what it sent, so the error can go back.
    """

    id: str
    name: str
    arguments: dict[str, Any] | None
    raw_arguments: str | None = None


@attrs.frozen(kw_only=True)
class ToolResult:
    """The result of a tool call, sent back to the model in the next user turn."""

    tool_call_id: str
    content: str
    is_error: bool = False


Block = Text | ToolCall | ToolResult


@attrs.frozen(kw_only=True)
class Message:
    """One turn: ``user`` turns carry text and tool results, ``assistant`` turns text and calls."""

    role: Role
    content: tuple[Block, ...]


@attrs.frozen(kw_only=True)
class ToolSpec:
    """A tool as the model sees it: a name, a description, a JSON schema for its arguments."""

    name: str
    description: str
    input_schema: dict[str, Any]


@attrs.frozen(kw_only=True)
class ModelRequest:
    """Everything that decides a model call. Its canonical JSON is what the digest covers."""

    model: str  # the provider's model id, without the "provider/" prefix
    system: str
    messages: tuple[Message, ...]
    tools: tuple[ToolSpec, ...] = ()
    max_tokens: int = 4096
    temperature: float | None = None


@attrs.frozen(kw_only=True)
class Usage:
    """Tokens as the provider reported them."""

    input_tokens: int
    output_tokens: int


@attrs.frozen(kw_only=True)
class ModelResponse:
    """What the model answered."""

    content: tuple[Text | ToolCall, ...]
    stop_reason: StopReason
    usage: Usage
    model: str  # as reported by the provider
    response_id: str = ""

    @property
    def tool_calls(self) -> list[ToolCall]:
        """The tool calls the model asked for, in order."""
        return [b for b in self.content if isinstance(b, ToolCall)]
