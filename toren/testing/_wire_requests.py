"""Requests as the providers' wire formats carry them, read back into Toren's vocabulary.

The inverse of each adapter's ``to_wire`` (:mod:`toren.providers`), for the scripted servers: a
:class:`~toren.testing.ScriptedModel` sees a :class:`~toren.runs.ModelRequest` whichever SDK sent
it. What a format cannot say is documented where it is lost: Chat Completions has no error flag
on a tool result (Toren's adapter writes ``Error: `` before its content, which is kept).

Each reader raises :class:`ValueError` on a body that is not a conversation (a role that is not
``user`` or ``assistant``, a message that is not an object); the server answers it with a 400.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from toren._agent.model import Block, Message, ModelRequest, Text, ToolCall, ToolResult, ToolSpec

__all__ = ["anthropic_request", "bedrock_request", "openai_request"]


def _objects(value: Any, what: str) -> list[Mapping[str, Any]]:
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(v, Mapping) for v in value):
        raise ValueError(f"{what} is not a list of objects")
    return value


def _object(value: Any, what: str) -> Mapping[str, Any]:
    """``value`` if it is an object (``{}`` for none)."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ValueError(f"{what} is not an object")  # noqa: TRY004  (the readers raise ValueError)
    return value


def _schema(value: Any) -> dict[str, Any]:
    return dict(_object(value, "a tool's input schema"))


def _body(body: Mapping[str, Any]) -> Mapping[str, Any]:
    """The request body, which must be a JSON object (the server keeps anything else under
    ``_unparsed``)."""
    if "_unparsed" in body:
        raise ValueError("the body is not a JSON object")
    return body


def _role(message: Mapping[str, Any]) -> str:
    role = message.get("role")
    if role not in ("user", "assistant"):
        raise ValueError(f"a message's role is {role!r}, not 'user' or 'assistant'")
    return str(role)


def _call(call_id: Any, name: Any, arguments: Any) -> ToolCall:
    if isinstance(arguments, dict):
        return ToolCall(id=str(call_id), name=str(name), arguments=arguments)
    raw = arguments if isinstance(arguments, str) else json.dumps(arguments)
    return ToolCall(id=str(call_id), name=str(name), arguments=None, raw_arguments=raw)


def _texts(value: Any) -> str:
    """A string, or the text of a list of ``{"text": ...}`` blocks."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        return "".join(str(b.get("text", "")) for b in value if isinstance(b, Mapping))
    return "" if value is None else json.dumps(value)


def _max_tokens(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 4096


def _temperature(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) else None


# -- Anthropic Messages ---------------------------------------------------------------------------


def _anthropic_block(block: Mapping[str, Any]) -> Block | None:
    kind = block.get("type")
    if kind == "text":
        return Text(text=str(block.get("text", "")))
    if kind == "tool_use":
        return _call(block.get("id"), block.get("name"), block.get("input"))
    if kind == "tool_result":
        return ToolResult(
            tool_call_id=str(block.get("tool_use_id")),
            content=_texts(block.get("content")),
            is_error=bool(block.get("is_error")),
        )
    return None  # images, thinking and other kinds Toren does not send


def anthropic_request(body: Mapping[str, Any]) -> ModelRequest:
    """The request a Messages API body (``POST /v1/messages``) carries."""
    messages = []
    body = _body(body)
    for message in _objects(body.get("messages"), "messages"):
        content = message.get("content")
        if isinstance(content, str):
            blocks: list[Block] = [Text(text=content)]
        else:
            found = (_anthropic_block(b) for b in _objects(content, "a message's content"))
            blocks = [b for b in found if b is not None]
        messages.append(Message(role=_role(message), content=tuple(blocks)))  # type: ignore[arg-type]
    tools = tuple(
        ToolSpec(
            name=str(t.get("name", "")),
            description=str(t.get("description", "")),
            input_schema=_schema(t.get("input_schema")),
        )
        for t in _objects(body.get("tools"), "tools")
    )
    return ModelRequest(
        model=str(body.get("model", "")),
        system=_texts(body.get("system")),
        messages=tuple(messages),
        tools=tools,
        max_tokens=_max_tokens(body.get("max_tokens")),
        temperature=_temperature(body.get("temperature")),
    )


# -- OpenAI Chat Completions ----------------------------------------------------------------------


def _openai_calls(message: Mapping[str, Any]) -> list[Block]:
    calls: list[Block] = []
    for call in _objects(message.get("tool_calls"), "tool_calls"):
        function = _object(call.get("function"), "a tool call's function")
        raw = function.get("arguments")
        try:
            arguments = json.loads(raw) if isinstance(raw, str) else raw
        except ValueError:
            arguments = raw
        calls.append(_call(call.get("id"), function.get("name"), arguments))
    return calls


def openai_request(body: Mapping[str, Any]) -> ModelRequest:
    """The request a Chat Completions body carries: ``system`` messages make the system
    prompt, ``tool`` messages become tool results in the user turn they lead."""
    system: list[str] = []
    messages: list[Message] = []
    pending: list[Block] = []  # the user turn being read (tool results, then text)
    body = _body(body)

    def close_user_turn() -> None:
        if pending:
            messages.append(Message(role="user", content=tuple(pending)))
            pending.clear()

    for message in _objects(body.get("messages"), "messages"):
        role = message.get("role")
        if role in ("system", "developer"):
            system.append(_texts(message.get("content")))
        elif role == "tool":
            content = _texts(message.get("content"))
            pending.append(
                ToolResult(tool_call_id=str(message.get("tool_call_id")), content=content)
            )
        elif role == "user":
            pending.append(Text(text=_texts(message.get("content"))))
        elif role == "assistant":
            close_user_turn()
            text = _texts(message.get("content"))
            blocks: list[Block] = [Text(text=text)] if text else []
            blocks.extend(_openai_calls(message))
            messages.append(Message(role="assistant", content=tuple(blocks)))
        else:
            raise ValueError(f"a message's role is {role!r}")
    close_user_turn()
    tools = []
    for tool in _objects(body.get("tools"), "tools"):
        function = _object(tool.get("function"), "a tool's function")
        tools.append(
            ToolSpec(
                name=str(function.get("name", "")),
                description=str(function.get("description", "")),
                input_schema=_schema(function.get("parameters")),
            )
        )
    return ModelRequest(
        model=str(body.get("model", "")),
        system="\n".join(system),
        messages=tuple(messages),
        tools=tuple(tools),
        max_tokens=_max_tokens(body.get("max_completion_tokens", body.get("max_tokens"))),
        temperature=_temperature(body.get("temperature")),
    )


# -- Bedrock Converse -----------------------------------------------------------------------------


def _bedrock_block(block: Mapping[str, Any]) -> Block | None:
    if "text" in block:
        return Text(text=str(block["text"]))
    if "toolUse" in block:
        use = _object(block["toolUse"], "a toolUse")
        return _call(use.get("toolUseId"), use.get("name"), use.get("input"))
    if "toolResult" in block:
        result = _object(block["toolResult"], "a toolResult")
        parts = [
            p["text"] if "text" in p else json.dumps(p.get("json"))
            for p in _objects(result.get("content"), "a tool result's content")
        ]
        return ToolResult(
            tool_call_id=str(result.get("toolUseId")),
            content="".join(parts),
            is_error=result.get("status") == "error",
        )
    return None


def bedrock_request(body: Mapping[str, Any], model_id: str) -> ModelRequest:
    """The request a Converse body carries (the model id is in the request's path)."""
    messages = []
    body = _body(body)
    for message in _objects(body.get("messages"), "messages"):
        found = (_bedrock_block(b) for b in _objects(message.get("content"), "content"))
        blocks = tuple(b for b in found if b is not None)
        messages.append(Message(role=_role(message), content=blocks))  # type: ignore[arg-type]
    tools = []
    for tool in _objects(_object(body.get("toolConfig"), "toolConfig").get("tools"), "tools"):
        spec = _object(tool.get("toolSpec"), "a toolSpec")
        tools.append(
            ToolSpec(
                name=str(spec.get("name", "")),
                description=str(spec.get("description", "")),
                input_schema=_schema(_object(spec.get("inputSchema"), "inputSchema").get("json")),
            )
        )
    inference = _object(body.get("inferenceConfig"), "inferenceConfig")
    return ModelRequest(
        model=model_id,
        system=_texts(body.get("system")),
        messages=tuple(messages),
        tools=tuple(tools),
        max_tokens=_max_tokens(inference.get("maxTokens")),
        temperature=_temperature(inference.get("temperature")),
    )
