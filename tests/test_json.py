"""Lossless JSON for Postgres (``toren._core.json_text``): what ``jsonb`` refuses or cannot hold
(NUL, lone
surrogates, integers past 64 bits, strings that start with the tag mark) is written so that
Postgres accepts it and read back exactly, alone and through a real ``jsonb`` column."""

from __future__ import annotations

import os
from typing import Any

import asyncpg
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from toren import Client
from toren._core.json_text import MARK, dumps, loads, safe_text, utf8_size

pytestmark = pytest.mark.anyio

CI = os.environ.get("CI") == "true"
LOCAL = settings(max_examples=200, derandomize=CI, deadline=None)
# Every example is a round trip to Postgres: fewer of them, on the test's own connection pool.
POSTGRES = settings(
    max_examples=60,
    derandomize=CI,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)

# What the tagging must get right, mixed into otherwise arbitrary text.
TRICKY = ["\x00", MARK, "\\", "\\0", "\\u", "\ud800", "\udfff", "\ud83d", "\ude00", "s", "i", "0"]
EDGE_INTS = [2**63 - 1, 2**63, 2**64 - 1, 2**64, -(2**63), -(2**63) - 1, 2**70, -(2**70)]

any_char = st.characters(exclude_categories=())  # surrogates and NUL included
text = st.one_of(
    st.text(any_char),
    st.lists(st.one_of(any_char, st.sampled_from(TRICKY))).map("".join),
    st.text(any_char).map(lambda s: MARK + s),
    st.text(any_char).map(lambda s: MARK + "s" + s),
    st.integers().map(lambda i: f"{MARK}i{i}"),  # looks like a tagged integer, is text
)
integers = st.one_of(st.integers(), st.sampled_from(EDGE_INTS))
floats = st.floats(allow_nan=False, allow_infinity=False)


def json_values(floats: st.SearchStrategy[float]) -> st.SearchStrategy[Any]:
    scalars = st.one_of(st.none(), st.booleans(), integers, floats, text)
    return st.recursive(
        scalars,
        lambda inner: st.lists(inner, max_size=4) | st.dictionaries(text, inner, max_size=4),
        max_leaves=25,
    )


values = json_values(floats)

# Values orjson writes on its own and jsonb accepts: no NUL, no surrogate, no string that starts
# with the mark (in the middle is fine), integers within 64 bits.
plain_char = st.characters(exclude_categories=["Cs"], exclude_characters="\x00")
plain_text = (
    st.lists(st.one_of(plain_char, st.sampled_from(["\\", "\\u0000", "\\0", MARK])))
    .map("".join)
    .filter(lambda s: not s.startswith(MARK))
)
plain_values = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(min_value=-(2**63), max_value=2**64 - 1),
        # Floats from 1e16 to 2**64 are tagged: jsonb would read them back as integers.
        st.floats(allow_nan=False, allow_infinity=False).filter(
            lambda x: abs(x) < 1e16 or abs(x) >= 2**64
        ),
        plain_text,
    ),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(plain_text, inner, max_size=4),
    max_leaves=25,
)


def assert_same(got: Any, want: Any) -> None:
    """``got == want`` with types checked as well (``True == 1`` and ``1 == 1.0`` hide loss)."""
    assert got == want
    assert type(got) is type(want), (got, want)
    if isinstance(want, dict):
        for key, value in want.items():
            assert_same(got[key], value)
    elif isinstance(want, list):
        for g, w in zip(got, want, strict=True):
            assert_same(g, w)


def reorder(value: Any) -> Any:
    """The same value with every dict's keys in reverse insertion order."""
    if isinstance(value, dict):
        return {k: reorder(value[k]) for k in reversed(list(value))}
    if isinstance(value, list):
        return [reorder(v) for v in value]
    return value


def holds_unstorable(text: str) -> bool:
    return "\x00" in text or any(0xD800 <= ord(c) <= 0xDFFF for c in text)


@LOCAL
@given(values)
def test_every_json_like_value_round_trips_exactly(value: Any) -> None:
    written = dumps(value)
    assert "\\u0000" not in written.replace("\\\\", "")  # no NUL escape jsonb would refuse
    assert not any(0xD800 <= ord(c) <= 0xDFFF for c in written)
    written.encode()  # valid UTF-8: what asyncpg sends
    assert_same(loads(written), value)
    assert_same(loads(written.encode()), value)
    assert_same(loads(dumps(value, sort_keys=True)), value)


@POSTGRES
@given(values)
async def test_every_json_like_value_round_trips_through_a_jsonb_column(
    client: Client, value: Any
) -> None:
    # The pool's codec writes with dumps, Postgres parses the text as jsonb (refusing NUL
    # escapes and anything that is not UTF-8), prints it back, and the codec reads it with loads.
    assert_same(await client.pool.fetchval("SELECT $1::jsonb", value), value)


async def test_values_are_stored_in_a_table_and_read_back_in_keys_and_values(
    client: Client,
) -> None:
    value = {
        "nul": "a\x00b",
        "lone surrogates": ["\ud800", "x\udfffy", "\ud83d\ude00"],
        "marked": MARK + "s not a tag",
        "looks like a big int": f"{MARK}i{2**70}",
        "big": [2**64, -(2**63) - 1, 2**200],
        "in range": [2**64 - 1, -(2**63)],
        "a\x00key": {"\ud800": {MARK: [MARK + "i1", "\\0", "\\u0000"]}},
        "backslashes": "\\\\0\\",
        "floats": [0.1, -2.5e-300, 1.7976931348623157e308],
    }
    async with client.pool.acquire() as conn:
        await conn.execute("CREATE TEMP TABLE j (id int PRIMARY KEY, v jsonb NOT NULL)")
        await conn.execute("INSERT INTO j VALUES (1, $1)", value)
        assert_same(await conn.fetchval("SELECT v FROM j WHERE id = 1"), value)
        # jsonb's own operators see the tagged form: a key lookup by its stored (tagged) name.
        [tagged_key] = orjson.loads(dumps({"a\x00key": 0}))
        assert await conn.fetchval("SELECT v ? $1 FROM j", tagged_key)
        assert await conn.fetchval("SELECT jsonb_typeof(v -> 'big' -> 0) FROM j") == "string"
        assert await conn.fetchval("SELECT jsonb_typeof(v -> 'in range' -> 0) FROM j") == "number"


async def test_postgres_refuses_what_orjson_writes_unaided(client: Client) -> None:
    # The reason the module exists: without tagging, jsonb refuses a NUL escape outright.
    with pytest.raises(asyncpg.UntranslatableCharacterError):
        await client.pool.fetchval("SELECT $1::text::jsonb", orjson.dumps("a\x00b").decode())
    assert await client.pool.fetchval("SELECT $1::text::jsonb", dumps("a\x00b")) == "a\x00b"


@pytest.mark.parametrize("value", [4.421984387541937e16, 1e16, -1.5e17, 1.8e19])
async def test_whole_floats_from_1e16_to_2_to_the_64_come_back_as_floats_through_jsonb(
    client: Client, value: float
) -> None:
    assert_same(await client.pool.fetchval("SELECT $1::jsonb", [value]), [value])


@settings(LOCAL, max_examples=80)
@given(st.dictionaries(text, values, min_size=2, max_size=6))
def test_sorted_keys_make_one_text_per_value_whatever_the_key_order(value: dict[str, Any]) -> None:
    shuffled = reorder(value)
    assert list(shuffled) != list(value)
    assert dumps(shuffled, sort_keys=True) == dumps(value, sort_keys=True)


@LOCAL
@given(plain_values)
def test_plain_values_are_written_exactly_as_orjson_writes_them(value: Any) -> None:
    # Request digests (toren._agent.digest) hash this text: it must not change for values that never
    # needed tagging, or digests recorded before tagging existed would no longer match.
    assert dumps(value) == orjson.dumps(value).decode()
    assert dumps(value, sort_keys=True) == orjson.dumps(value, option=orjson.OPT_SORT_KEYS).decode()


def test_the_stored_tag_format_stays_readable() -> None:
    # Journals already written hold this form; a change of format would strand them. (NUL is
    # written \x00, the escapes Python's unicode_escape codec reads at C speed.)
    assert dumps("a\x00b") == '"\ue000sa\\\\x00b"'
    assert dumps("\ud800\\") == '"\ue000s\\\\ud800\\\\\\\\"'
    assert dumps(2**70) == '"\ue000i1180591620717411303424"'
    assert dumps(MARK + "x") == '"\ue000s\ue000x"'
    assert loads('"\ue000sa\\\\x00b"') == "a\x00b"
    assert loads('{"\ue000s\\\\x00":"\ue000i-18446744073709551617"}') == {"\x00": -(2**64) - 1}
    assert loads('"\ue000inot a number"') == "\ue000inot a number"


@LOCAL
@given(text)
def test_safe_text_holds_no_nul_or_surrogate(value: str) -> None:
    safe = safe_text(value)
    assert not holds_unstorable(safe)
    safe.encode()
    if not holds_unstorable(value):
        assert safe == value  # readable text is left alone


async def test_safe_text_is_accepted_by_a_postgres_text_parameter(client: Client) -> None:
    value = "error: a\x00b \ud800 \udfff\ud83d ok \\u0000 \ue000"
    with pytest.raises(asyncpg.PostgresError):  # NUL: not in a text value
        await client.pool.fetchval("SELECT $1::text", "a\x00b")
    with pytest.raises(asyncpg.DataError):  # a lone surrogate: not UTF-8
        await client.pool.fetchval("SELECT $1::text", "a\ud800b")
    safe = safe_text(value)
    assert safe == "error: a\\u0000b \\ud800 \\udfff\\ud83d ok \\u0000 \ue000"
    assert await client.pool.fetchval("SELECT $1::text", safe) == safe


@pytest.mark.parametrize("needs_tags", [False, True])
def test_a_value_nested_300_deep_raises_type_error(needs_tags: bool) -> None:
    deep: Any = "a\x00b" if needs_tags else "plain"
    for i in range(300):
        deep = [deep] if i % 2 else {"k": deep}
    with pytest.raises(TypeError):
        dumps(deep)


def test_nesting_up_to_254_levels_is_written() -> None:
    deep: Any = ["\x00"]
    for _ in range(253):
        deep = [deep]
    assert loads(dumps(deep)) == deep
    with pytest.raises(TypeError):
        dumps([deep])


def test_a_value_nested_far_past_the_recursion_limit_raises_type_error() -> None:
    deep: Any = "\x00"
    for _ in range(100_000):
        deep = [deep]
    with pytest.raises(TypeError):
        dumps(deep)


@pytest.mark.parametrize(
    ("text", "size"),
    [
        ("", 0),
        ("abc", 3),
        ("\x00", 1),
        ("é", 2),
        ("€", 3),
        ("\U0001f600", 4),
        ("\ud800", 3),
        ("\ud83d\ude00", 6),  # two lone surrogates, not a pair: three bytes each
        ("a\udfffb", 5),
    ],
)
def test_utf8_size_counts_bytes_with_a_lone_surrogate_as_three(text: str, size: int) -> None:
    assert utf8_size(text) == size


@LOCAL
@given(st.text())
def test_utf8_size_is_the_length_of_the_utf8_encoding(value: str) -> None:
    assert utf8_size(value) == len(value.encode())
