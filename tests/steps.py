"""Scripted models by turn, for tests whose agents make a fixed series of tool calls: the k-th
request of a run is answered with the k-th step."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import pytest

from toren import Client
from toren._agent.model import ToolCall
from toren.runs import ENDED, run_status
from toren.testing import AnthropicServer, Reply

Step = Sequence[ToolCall] | str


def results(body: dict[str, Any]) -> list[str]:
    """Every tool result the conversation holds, in order."""
    out = []
    for message in body["messages"]:
        content = message["content"] if isinstance(message["content"], list) else []
        for b in content:
            if b.get("type") == "tool_result":
                c = b.get("content")
                if isinstance(c, list):
                    c = "".join(x.get("text", "") for x in c)
                out.append(str(c))
    return out


def script(steps: Sequence[Step]) -> Callable[[dict[str, Any], int], Reply]:
    """Answer the k-th request of a run with ``steps[k]`` (a turn of tool calls, or the final
    text); the final text may hold ``{results}``."""

    def answer(body: dict[str, Any], n: int) -> Reply:
        turn = sum(1 for m in body["messages"] if m["role"] == "assistant")
        step = steps[min(turn, len(steps) - 1)]
        if isinstance(step, str):
            return Reply(step.replace("{results}", "\n---\n".join(results(body))))
        return Reply(list(step))

    return answer


def bash(command: str, call_id: str) -> ToolCall:
    return ToolCall(id=call_id, name="bash", arguments={"command": command})


def tool(name: str, call_id: str, **arguments: Any) -> ToolCall:
    return ToolCall(id=call_id, name=name, arguments=arguments)


@contextlib.asynccontextmanager
async def model(
    steps: Sequence[Step], monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[AnthropicServer]:
    async with AnthropicServer(script(steps)) as server:
        for name, value in server.env().items():
            monkeypatch.setenv(name, value)
        yield server


async def settled(client: Client, run_id: str) -> str | None:
    status = await run_status(client, run_id)
    return status if status in ENDED else None
