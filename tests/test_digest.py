"""Chained request digests."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from toren._agent.digest import GENESIS, canonical, chain
from toren._agent.model import Message, ModelRequest, Text, ToolCall, ToolResult, ToolSpec


def request(text: str, *, tools: bool = False, temperature: float | None = None) -> ModelRequest:
    return ModelRequest(
        model="claude-sonnet-4-6",
        system="be brief",
        messages=(
            Message(role="user", content=(Text(text=text),)),
            Message(
                role="assistant", content=(ToolCall(id="c1", name="t", arguments={"b": 1, "a": 2}),)
            ),
            Message(role="user", content=(ToolResult(tool_call_id="c1", content="ok"),)),
        ),
        tools=(ToolSpec(name="t", description="d", input_schema={"type": "object"}),)
        if tools
        else (),
        temperature=temperature,
    )


def test_canonical_form_sorts_keys() -> None:
    assert b'"arguments":{"a":2,"b":1}' in canonical(request("hi"))


@given(st.text(), st.text())
def test_digests_differ_exactly_when_requests_do(a: str, b: str) -> None:
    assert (chain(GENESIS, request(a)) == chain(GENESIS, request(b))) == (a == b)


def test_every_part_of_the_request_counts() -> None:
    base = chain(GENESIS, request("hi"))
    assert chain(GENESIS, request("hi", tools=True)) != base
    assert chain(GENESIS, request("hi", temperature=0.5)) != base


def test_the_chain_carries_history() -> None:
    first = chain(GENESIS, request("one"))
    other_first = chain(GENESIS, request("uno"))
    assert chain(first, request("two")) != chain(other_first, request("two"))
    assert chain(first, request("two")) == chain(first, request("two"))
