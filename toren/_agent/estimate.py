"""The token estimator Toren and its local model servers share.

A provider counts tokens with its own tokenizer, which Toren does not have. Where Toren needs a
count before the provider gives one (how big the next request will be, how much a compaction
saves) it estimates: **one token per four UTF-8 bytes of text**, counting every string value in
the request (the system prompt, text blocks, tool-call arguments, tool results, tool names,
descriptions and schemas), rounded up. Keys and punctuation are not counted. English prose runs
at about four bytes per token in the providers' tokenizers, so the estimate is of the right
size; compaction corrects it by the ratio between the tokens the provider reported for the last
call and the estimate of that call's request.

The local model servers of :mod:`toren.testing` report this estimate as the input tokens of
every request, and refuse a request whose estimate is over the model's window.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

BYTES_PER_TOKEN = 4


def text_bytes(value: Any) -> int:
    """The UTF-8 size of every string value in ``value`` (mappings, sequences and attrs
    instances are walked; other values count nothing)."""
    total = 0
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            total += len(item.encode("utf-8", "surrogatepass"))
        elif isinstance(item, Mapping):
            stack.extend(item.values())
        elif isinstance(item, list | tuple):
            stack.extend(item)
        elif attrs.has(type(item)):
            stack.extend(getattr(item, a.name) for a in attrs.fields(type(item)))
    return total


def estimate_tokens(value: Any) -> int:
    """Estimated tokens of ``value``: its text's UTF-8 bytes divided by four, rounded up."""
    return -(-text_bytes(value) // BYTES_PER_TOKEN)
