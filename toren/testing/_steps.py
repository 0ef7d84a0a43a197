"""The steps a scripted model server answers with: a reply, an error, a dropped connection."""

from __future__ import annotations

from collections.abc import Iterable

import attrs

from toren._agent.estimate import estimate_tokens
from toren._agent.model import StopReason, Text, ToolCall, Usage


def _content(value: str | Iterable[str | Text | ToolCall]) -> tuple[Text | ToolCall, ...]:
    if isinstance(value, str):
        return (Text(text=value),)
    blocks = tuple(Text(text=b) if isinstance(b, str) else b for b in value)
    for block in blocks:
        if not isinstance(block, Text | ToolCall):
            raise TypeError(f"a Reply holds strings, Text and ToolCall blocks, not {block!r}")
    return blocks


@attrs.frozen
class Reply:
    """A model answer, rendered in the provider's own response format.

    ``content`` is a string (one text block) or text blocks (or strings) and tool calls, in
    order.

    Raises:
        TypeError: ``content`` holds something else.
    ``stop_reason`` defaults to ``"tool_use"`` when the content holds a tool call, else ``"end"``.
    ``usage`` is reported as scripted; ``None`` (the default) reports the estimate: the request's
    estimated input tokens, and the reply's own estimated tokens (its text, tool names and
    arguments; at least 1) as output.
    ``latency`` is the model time the server waits before answering; it is added to
    :attr:`ScriptedServer.model_time` once the answer was served.
    """

    content: tuple[Text | ToolCall, ...] = attrs.field(converter=_content)
    stop_reason: StopReason | None = attrs.field(default=None, kw_only=True)
    usage: Usage | None = attrs.field(default=None, kw_only=True)
    latency: float = attrs.field(default=0.0, kw_only=True)

    @property
    def output_tokens(self) -> int:
        """The estimated tokens of the reply's content (at least 1)."""
        generated = [
            b.text if isinstance(b, Text) else [b.name, b.arguments, b.raw_arguments]
            for b in self.content
        ]
        return max(1, estimate_tokens(generated))

    def usage_for(self, input_tokens: int) -> Usage:
        """The usage to report for this reply to a request of ``input_tokens`` (estimated)."""
        if self.usage is not None:
            return self.usage
        return Usage(input_tokens=input_tokens, output_tokens=self.output_tokens)

    @property
    def effective_stop_reason(self) -> StopReason:
        """The stop reason to send: the scripted one, or one inferred from the content."""
        if self.stop_reason is not None:
            return self.stop_reason
        return "tool_use" if any(isinstance(b, ToolCall) for b in self.content) else "end"


@attrs.frozen(kw_only=True)
class Fail:
    """An error answer: the provider's own error body, status code and ``Retry-After`` header."""

    status: int = 500
    message: str = "scripted failure"
    retry_after: float | None = None


@attrs.frozen(kw_only=True)
class Disconnect:
    """Close the connection without answering (a connection reset, as the client sees it)."""


Step = Reply | Fail | Disconnect
