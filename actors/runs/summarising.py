"""The hard tier of compaction: a summary of the earlier conversation, written by the model.

Everything before the run's latest turns is rendered as text (tool output cut to a few hundred
characters) and summarised with one model call through the agent's own provider, recorded and
priced like any call. The human messages and the task are not summarised: :func:`pinned` finds
them, and the new prefix carries them verbatim.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from decimal import Decimal

import attrs

from toren import ConfigError, Context
from toren.actors.runs import models
from toren.actors.runs.bounds import bounded_response
from toren.kernel import kill_point
from toren.providers import ProviderError, parse_model
from toren.runs import (
    GENESIS,
    Agent,
    Message,
    ModelRequest,
    ModelResponse,
    ModelUnreadable,
    RunFailed,
    RunState,
    Text,
    ToolCall,
    canonical,
    chain,
    final_text,
)

RENDER_CUT = 400  # characters of a tool result (or call's arguments) the summariser is shown
SUMMARY_MAX_TOKENS = 1024
SUMMARY_MARK = "[Summary of the earlier conversation, written by Toren's compaction]\n"
SUMMARISER = (
    "You compact the conversation of an AI agent so that it can go on within its context "
    "window. Summarise the conversation you are given for the agent itself: the task and how "
    "far it got, what it decided and why, the facts and figures from tool results it still "
    "needs, what failed, and what remains to do. Keep identifiers, numbers, names, paths and "
    "quoted values exactly. The human messages and the task are kept verbatim elsewhere: do "
    "not repeat them. Write only the summary, as plain text."
)


def tool_names(messages: Iterable[Message]) -> dict[str, str]:
    return {
        b.id: b.name
        for m in messages
        if m.role == "assistant"
        for b in m.content
        if isinstance(b, ToolCall)
    }


def pinned(state: RunState, head: Sequence[Message]) -> list[Text]:
    """The human messages in ``head`` (text blocks of user turns that are neither the task nor a
    summary), in order: a hard compaction carries them verbatim."""
    found: list[Text] = []
    for i, message in enumerate(head):
        if message.role != "user":
            continue
        for k, block in enumerate(message.content):
            if not isinstance(block, Text) or block.text.startswith(SUMMARY_MARK):
                continue
            if i == 0 and k == 0 and block.text == state.input:
                continue  # the task, which leads every prefix
            found.append(block)
    return found


def render(head: Sequence[Message], budget: int) -> str:
    """The turns of ``head`` as text for the summariser, tool output cut to a few hundred
    characters, at most ``budget`` characters (the middle left out past it)."""
    names = tool_names(head)
    lines: list[str] = []
    for message in head:
        for block in message.content:
            if isinstance(block, Text):
                if message.role == "assistant":
                    lines.append(f"Assistant: {block.text}")
                elif block.text.startswith(SUMMARY_MARK):
                    lines.append(f"Summary of what came before: {block.text[len(SUMMARY_MARK) :]}")
                else:
                    lines.append(f"User: {block.text}")
            elif isinstance(block, ToolCall):
                arguments = (
                    canonical(block.arguments)
                    if block.arguments is not None
                    else repr(block.raw_arguments)
                )
                lines.append(
                    f"Assistant called {block.name} (call {block.id}) with {_cut(arguments)}"
                )
            else:
                name = names.get(block.tool_call_id, "a tool")
                error = " (an error)" if block.is_error else ""
                lines.append(
                    f"Result of {name} (call {block.tool_call_id}){error}: {_cut(block.content)}"
                )
    text = "\n\n".join(lines)
    if len(text) <= budget:
        return text
    # The beginning (the task, the first steps) and as much of the latest as fits.
    left = len(text) - budget + 80
    start = budget // 4
    note = f"\n\n[... {left} characters of the conversation left out here ...]\n\n"
    return text[:start] + note + text[start + left :]


def _cut(text: str) -> str:
    return text if len(text) <= RENDER_CUT else text[:RENDER_CUT] + f"... ({len(text)} chars)"


def summary_request(agent: Agent, head: Sequence[Message], budget: int) -> ModelRequest:
    """The request that summarises ``head``: the summariser's own system prompt, one user turn,
    no tools, at most :data:`SUMMARY_MAX_TOKENS` output tokens."""
    _, model_id = parse_model(agent.model)
    text = (
        "Summarise this earlier part of the conversation (the agent keeps its latest turns "
        "as they are):\n\n" + render(head, budget)
    )
    return ModelRequest(
        model=model_id,
        system=SUMMARISER,
        messages=(Message(role="user", content=(Text(text=text),)),),
        max_tokens=min(agent.max_tokens, SUMMARY_MAX_TOKENS),
    )


@attrs.frozen
class Summary:
    """A summary call's outcome: the text, the response as recorded, its price and latency."""

    text: str
    response: ModelResponse
    cost: Decimal | None
    latency_ms: int


async def summarise(ctx: Context[RunState], agent: Agent, request: ModelRequest) -> Summary | None:
    """Make the summary call; ``None`` when it failed (the failure is handled: recorded, the
    run failed, or the step to be tried again)."""
    provider_name, model_id = parse_model(agent.model)
    state = ctx.state
    started = time.monotonic()
    try:
        provider = await models.provider(ctx, agent.model)
        started = time.monotonic()
        kill_point("compaction.summarising")
        response = await provider.call(request, before_attempt=ctx.ensure_lease)
        kill_point("compaction.summarised")
    except ProviderError as exc:
        latency = int((time.monotonic() - started) * 1000)
        if exc.answered:  # paid for and unreadable: counted, never asked again by itself
            ctx.emit(
                ModelUnreadable(
                    step=len(state.calls) + 1,
                    digest=chain(GENESIS, request),
                    model=agent.model,
                    error=exc.message,
                    latency_ms=latency,
                )
            )
            ctx.emit(RunFailed(error_class="provider", message=f"compaction: {exc}"))
            return None
        models.failed_attempt(ctx, agent, exc)
        return None
    except ConfigError as exc:
        ctx.emit(RunFailed(error_class="config", message=str(exc)))
        return None
    latency = int((time.monotonic() - started) * 1000)
    response = bounded_response(
        response, cap=agent.max_response_bytes, step=len(state.calls) + 1, earlier_ids=()
    )
    text = final_text(response).strip() or "(the summariser wrote nothing)"
    return Summary(text, response, models.price(provider_name, model_id, response), latency)
