"""What untrusted data becomes before a run records it: caps with visible markers, plain call ids,
arguments that JSON can hold.

Model responses and tool results are input from outside, as hostile as an HTTP body. The run
actor records them through these functions, which never raise: text past a cap is cut with a
marker the model sees; a tool call whose arguments cannot be recorded (nested too deeply, or
over the cap) keeps its place with a note instead, so the model gets an error result for it; a
call id that is not a plain id, or that repeats an earlier one of the run, is replaced by one
derived from the step (ids go into timer names and back to the provider). What these return is
recorded as is, so a replay folds exactly what the live run saw.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Container
from typing import Any

import attrs
import orjson

from toren.kernel import json_text, utf8_size
from toren.runs import ModelResponse, Text, ToolCall

_PLAIN_ID = re.compile(r"[A-Za-z0-9_.:-]{1,128}")
_SHOWN = 200  # characters of a hostile name or raw value quoted in an error
_NAME_CAP = 256


def cut(text: str, cap: int, marker: str) -> tuple[str, int | None]:
    """``text`` within ``cap`` bytes: as is, or cut and ended with ``marker`` (the marker
    included in the cap, unless the cap is smaller than the marker).

    Returns:
        The text, and its original size in bytes if it was cut (else ``None``).
    """
    size = utf8_size(text)
    if size <= cap:
        return text, None
    budget = max(0, cap - utf8_size(marker))
    kept = text[:budget]  # at most `budget` characters, so at most 4 * budget bytes
    while (over := utf8_size(kept) - budget) > 0:
        kept = kept[: len(kept) - max(1, over // 4)]
    return kept + marker, size


def cut_result(text: str, cap: int) -> tuple[str, int | None]:
    """A tool result within ``cap`` bytes, cut with a marker the model reads."""
    size = utf8_size(text)
    return cut(text, cap, f"\n[Toren cut this tool result at {cap} bytes: it was {size} bytes]")


def shown(value: object) -> str:
    """A short quotation of an untrusted value for an error text."""
    text = value if isinstance(value, str) else repr(value)
    return repr(text[:_SHOWN]) + ("..." if len(text) > _SHOWN else "")


def error_text(exc: BaseException) -> str:
    """``Type: message`` of an exception a tool raised (whose ``__str__`` may itself raise)."""
    try:
        return f"{type(exc).__name__}: {exc}"
    except Exception:  # noqa: BLE001
        return f"{type(exc).__name__} (its message cannot be shown)"


def as_text(result: Any) -> str:
    """A tool's return value as the text the model gets (JSON when it can be); never raises,
    whatever the value's ``__str__`` or ``__repr__`` do."""
    if isinstance(result, str):
        return result
    try:
        return orjson.dumps(result, default=str).decode()
    except Exception:  # noqa: BLE001, S110  (orjson refused it, or a hostile __str__: next way)
        pass
    try:  # lone surrogates, big integers, special floats: the standard library writes them
        return json.dumps(result, default=str, ensure_ascii=False, separators=(",", ":"))
    except Exception:  # noqa: BLE001, S110
        pass
    try:
        return repr(result)
    except Exception as exc:  # noqa: BLE001  (a hostile __repr__ is the tool's to answer for)
        return f"<a {type(result).__name__} that cannot be shown: {type(exc).__name__}>"


def _arguments_size(arguments: dict[str, Any] | None) -> int:
    """Bytes of the arguments as recorded.

    Raises:
        TypeError: JSON cannot hold them.
    """
    return 0 if arguments is None else utf8_size(json_text(arguments))


def _size(block: Text | ToolCall) -> int | None:
    """Bytes a block takes when recorded; ``None`` if it cannot be recorded as is."""
    if isinstance(block, Text):
        return utf8_size(block.text)
    try:
        arguments = _arguments_size(block.arguments)
    except TypeError:
        return None
    return utf8_size(block.name) + utf8_size(block.raw_arguments or "") + arguments


def _fine(response: ModelResponse, cap: int, earlier: Container[str]) -> bool:
    sizes = [_size(block) for block in response.content]
    if None in sizes or sum(s or 0 for s in sizes) > cap:
        return False
    ids = [b.id for b in response.content if isinstance(b, ToolCall)]
    return (
        len(set(ids)) == len(ids)
        and not any(i in earlier for i in ids)
        and all(
            _PLAIN_ID.fullmatch(b.id) and utf8_size(b.name) <= _NAME_CAP
            for b in response.content
            if isinstance(b, ToolCall)
        )
    )


def _typed(response: ModelResponse) -> ModelResponse:
    """``response`` with every field of the type it is declared with: an SDK builds responses
    without validating them, so a gateway's ``null`` name or numeric id reaches here as is."""
    fine = (
        isinstance(response.model, str)
        and isinstance(response.response_id, str)
        and isinstance(response.usage.input_tokens, int)
        and isinstance(response.usage.output_tokens, int)
        and all(
            isinstance(b.text, str)
            if isinstance(b, Text)
            else isinstance(b, ToolCall)
            and isinstance(b.id, str)
            and isinstance(b.name, str)
            and (b.arguments is None or isinstance(b.arguments, dict))
            and (b.raw_arguments is None or isinstance(b.raw_arguments, str))
            for b in response.content
        )
    )
    if fine:
        return response
    content: list[Text | ToolCall] = []
    for block in response.content:
        if isinstance(block, Text):
            content.append(Text(text=_as_str(block.text)))
        elif isinstance(block, ToolCall):
            arguments = block.arguments if isinstance(block.arguments, dict) else None
            raw = block.raw_arguments
            if arguments is None and block.arguments is not None:
                raw = shown(block.arguments)
            content.append(
                ToolCall(
                    id=block.id if isinstance(block.id, str) else "",
                    name=_as_str(block.name),
                    arguments=arguments,
                    raw_arguments=None if raw is None else _as_str(raw),
                )
            )
    usage = response.usage
    return attrs.evolve(
        response,
        content=tuple(content),
        model=_as_str(response.model),
        response_id=_as_str(response.response_id),
        usage=attrs.evolve(
            usage,
            input_tokens=_count(usage.input_tokens),
            output_tokens=_count(usage.output_tokens),
        ),
    )


def _as_str(value: object) -> str:
    return value if isinstance(value, str) else as_text(value)


def _count(value: object) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0


def bounded_response(
    response: ModelResponse, *, cap: int, step: int, earlier_ids: Container[str]
) -> ModelResponse:
    """``response`` as it can be recorded: every field of its declared type, within ``cap``
    bytes, with unique plain call ids (none of ``earlier_ids``) and arguments JSON can hold.
    The same object when it already is."""
    response = _typed(response)
    if _fine(response, cap, earlier_ids):
        return response
    given: set[str] = set()  # ids this response's calls keep or are given

    def taken(call_id: str) -> bool:
        return call_id in given or call_id in earlier_ids

    total = sum(s or 0 for s in (_size(b) for b in response.content))
    over = f"the response was {total} bytes, over the {cap}-byte cap"
    budget = cap
    content: list[Text | ToolCall] = []
    for index, block in enumerate(response.content):
        if isinstance(block, Text):
            text, _ = cut(block.text, max(budget, 0), f"\n[Toren cut this response: {over}]")
            budget -= utf8_size(text)
            content.append(Text(text=text))
            continue
        call_id = block.id
        if taken(call_id) or not _PLAIN_ID.fullmatch(call_id):
            call_id = _fresh_id(step, index, taken)
        given.add(call_id)
        name, _ = cut(block.name, _NAME_CAP, "...")
        arguments, raw = block.arguments, block.raw_arguments
        try:
            size = _arguments_size(arguments)
        except TypeError as exc:
            arguments, raw, size = None, f"<arguments that cannot be recorded: {exc}>", 0
        if size > budget:
            arguments, raw, size = None, f"<arguments of {size} bytes dropped: {over}>", 0
        if raw is not None:
            raw, _ = cut(raw, max(1024, budget), f"\n[cut: {over}]")
        budget -= utf8_size(name) + utf8_size(raw or "") + size
        content.append(ToolCall(id=call_id, name=name, arguments=arguments, raw_arguments=raw))
    return attrs.evolve(response, content=tuple(content))


def _fresh_id(step: int, index: int, taken: Callable[[str], bool]) -> str:
    candidate = f"toren_{step}_{index}"
    n = 0
    while taken(candidate):
        n += 1
        candidate = f"toren_{step}_{index}_{n}"
    return candidate
