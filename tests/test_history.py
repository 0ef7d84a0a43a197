"""History: the persistent sequence whose stored chunks are decoded on first read.

The property: any sequence of operations (append, extend, set, slices, storing the tail as a
chunk) gives the same items as the same operations on a list, whatever has been stored and
whether or not a chunk has been read yet; and earlier values never change.
"""

from __future__ import annotations

import itertools
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from toren._core.history import Chunk, History, Ledger, Released

counter = itertools.count()


def stored(h: History[int]) -> History[int]:
    """``h`` with its tail stored as a chunk, as a snapshot stores it (read back lazily)."""
    tail = list(h.tail)
    if not tail:
        return h
    raw = orjson.dumps(tail)
    chunk = Chunk(f"k{next(counter)}", len(tail), raw, orjson.loads)
    return History(chunks=(*h.chunks, chunk), offset=h.offset, released=h.released)


OPS = st.one_of(
    st.tuples(st.just("append"), st.integers(-(2**31), 2**31)),
    st.tuples(st.just("extend"), st.lists(st.integers(0, 99), max_size=5)),
    st.tuples(st.just("set"), st.integers(-30, 30), st.integers(0, 99)),
    st.tuples(st.just("prefix"), st.integers(0, 30)),
    st.tuples(st.just("slice"), st.integers(0, 30), st.integers(0, 30)),
    st.tuples(st.just("store")),
)


def apply(h: History[int], model: list[int], op: tuple[Any, ...]) -> tuple[History[int], list[int]]:
    name = op[0]
    if name == "append":
        return h.append(op[1]), [*model, op[1]]
    if name == "extend":
        return h.extend(op[1]), [*model, *op[1]]
    if name == "set":
        i = op[1]
        if not -len(model) <= i < len(model):
            with pytest.raises(IndexError):
                h.set(i, op[2])
            return h, model
        changed = list(model)
        changed[i] = op[2]
        return h.set(i, op[2]), changed
    if name == "prefix":
        return h[: op[1]], model[: op[1]]
    if name == "slice":
        return h[op[1] : op[2]], model[op[1] : op[2]]
    return stored(h), model


@settings(max_examples=400, deadline=None, derandomize=True)
@given(ops=st.lists(OPS, max_size=25), probes=st.lists(st.integers(-40, 40), max_size=5))
def test_history_behaves_as_a_list(ops: list[tuple[Any, ...]], probes: list[int]) -> None:
    h: History[int] = History()
    model: list[int] = []
    kept: list[tuple[History[int], list[int]]] = []
    for op in ops:
        h, model = apply(h, model, op)
        kept.append((h, list(model)))
        for i in probes:  # reads into stored chunks decode them, or not: the same items
            if -len(model) <= i < len(model):
                assert h[i] == model[i]
            else:
                with pytest.raises(IndexError):
                    h[i]
    assert len(h) == len(model)
    assert list(h) == model
    assert list(reversed(h)) == model[::-1]
    assert h == model
    assert h == History(model)
    for earlier, items in kept:  # persistent: nothing made later changed an earlier value
        assert list(earlier) == items


@settings(max_examples=400, deadline=None, derandomize=True)
@given(
    ops=st.lists(st.one_of(OPS, st.tuples(st.just("release"), st.integers(0, 30))), max_size=25),
    probes=st.lists(st.integers(-40, 40), max_size=5),
)
def test_a_released_front_keeps_its_places_and_nothing_else(
    ops: list[tuple[Any, ...]], probes: list[int]
) -> None:
    """Releasing the first items keeps the length and every later index; a released item
    cannot be read (nor changed, nor sliced from); the kept ones read as a list's, stored or
    not; the chunks holding only released items are let go."""
    h: History[int] = History()
    model: list[int] = []
    released = 0
    for op in ops:
        name = op[0]
        if name == "release":
            released = min(max(op[1], released), len(model))
            h = h.release(op[1])
            # the first chunk kept holds a kept item
            assert not h.chunks or h.offset + h.chunks[0].count > released
            continue
        touches = (
            name == "set"
            and -len(model) <= op[1] < len(model)
            and op[1] % max(1, len(model)) < released
        ) or (name == "slice" and 0 < op[1] < released)
        if touches:
            with pytest.raises(Released):
                apply(h, model, op)
            continue
        if name == "slice" and op[1] > 0:
            released = 0  # a slice is a new sequence
        elif name == "prefix":
            released = min(released, op[1])
        h, model = apply(h, model, op)
        if name == "slice" and op[1] == 0:
            released = min(released, len(model))
        for i in probes:
            j = i + len(model) if i < 0 else i
            if not 0 <= j < len(model):
                with pytest.raises(IndexError):
                    h[i]
            elif j < released:
                with pytest.raises(Released):
                    h[i]
            else:
                assert h[i] == model[j]
    assert (len(h), h.released) == (len(model), released)
    assert list(h) == model[released:]
    assert list(reversed(h)) == model[released:][::-1]
    assert h == History(model).release(released)


def test_a_ledger_lets_go_of_the_values_before_every_kept_key() -> None:
    ledger = Ledger([("a", 1), ("b", 2), ("c", 3), ("d", 4)])
    kept = ledger.release(["a", "c"])
    assert dict(kept) == {"b": 2, "d": 4}
    assert kept.values_kept.released == 1  # "c" comes after "b", kept: its value stays stored
    assert dict(kept.release(["b"])) == {"d": 4}
    assert kept.release(["b"]).values_kept.released == 3


def test_a_stored_chunk_is_decoded_once_and_only_when_read() -> None:
    decoded: list[bytes] = []

    def decode(raw: bytes) -> list[int]:
        decoded.append(raw)
        return list(orjson.loads(raw))

    h = History(chunks=[Chunk("a", 3, b"[1,2,3]", decode), Chunk("b", 2, b"[4,5]", decode)])
    assert (len(h), decoded) == (5, [])
    h = h.append(6)
    assert (h[-1], decoded) == (6, [])  # the tail: nothing decoded
    assert (h[3], decoded) == (4, [b"[4,5]"])
    assert (h[4], list(h)) == (5, [1, 2, 3, 4, 5, 6])
    assert decoded == [b"[4,5]", b"[1,2,3]"]


def test_a_damaged_chunk_says_so() -> None:
    h = History(chunks=[Chunk("a", 3, b"[1,2]", orjson.loads)])
    with pytest.raises(ValueError, match="holds 2 items, not 3"):
        list(h)


def test_a_prefix_keeps_whole_chunks_stored() -> None:
    a, b = Chunk("a", 3, b"[1,2,3]", orjson.loads), Chunk("b", 3, b"[4,5,6]", orjson.loads)
    h = History(chunks=[a, b], tail=History([7]).tail)
    cut = h[:4]
    assert (cut.chunks, list(cut.tail)) == ((a,), [4])
    assert list(cut) == [1, 2, 3, 4]


def test_a_chunk_read_from_threads_at_once_is_decoded_once_and_lets_its_bytes_go() -> None:
    """The snapshot encoder runs in a worker thread while the event loop reads: a chunk read
    from several threads at once is decoded once, every reader gets the same items, and the
    stored bytes are let go once decoded."""
    import threading

    started = threading.Barrier(8)
    decoded: list[bytes] = []

    def slow(raw: bytes) -> list[int]:
        decoded.append(raw)
        return list(orjson.loads(raw))

    chunk = Chunk("a", 3, b"[1,2,3]", slow)
    h = History(chunks=[chunk]).append(4)
    seen: list[list[int]] = []

    def read() -> None:
        started.wait(timeout=10)
        seen.append(list(h))

    threads = [threading.Thread(target=read) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    assert seen == [[1, 2, 3, 4]] * 8
    assert decoded == [b"[1,2,3]"]
    assert (chunk.decoded, chunk.raw) == (True, b"")
    # Slices, negative indexes and a set into the stored chunk: as on a list, the chunk untouched.
    assert (h[-4], list(h[-3:-1]), list(h[::-2])) == (1, [2, 3], [4, 2])
    changed = h.set(-4, 9)
    assert (list(changed), list(h), changed.chunks) == ([9, 2, 3, 4], [1, 2, 3, 4], ())


def test_a_history_pickles_and_copies_by_its_items() -> None:
    """As a tuple does: a state holding one can be deep-copied or pickled (the stored chunk's
    decoder and lock are not)."""
    import copy
    import pickle

    h = History(chunks=[Chunk("a", 2, b"[1,[2]]", orjson.loads)]).append(3)
    for again in (copy.deepcopy(h), pickle.loads(pickle.dumps(h)), copy.copy(h)):
        assert isinstance(again, History)
        assert list(again) == [1, [2], 3]


LEDGER_OPS = st.one_of(
    st.tuples(st.just("set"), st.sampled_from("abcdef"), st.integers(0, 99)),
    st.tuples(st.just("without"), st.sets(st.sampled_from("abcdefg"), max_size=3)),
    st.tuples(st.just("store")),
)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(ops=st.lists(LEDGER_OPS, max_size=30))
def test_a_ledger_behaves_as_a_dict(ops: list[tuple[Any, ...]]) -> None:
    """Set, drop, and the values stored as a snapshot stores them: the same map as a dict's."""
    from toren._core.history import Ledger

    ledger: Ledger[int] = Ledger()
    model: dict[str, int] = {}
    kept = []
    for op in ops:
        if op[0] == "set":
            ledger, model = ledger.set(op[1], op[2]), {**model, op[1]: op[2]}
        elif op[0] == "without":
            ledger = ledger.without(op[1])
            model = {k: v for k, v in model.items() if k not in op[1]}
        else:
            ledger = ledger.with_values(stored(ledger.values_kept))
        kept.append((ledger, dict(model)))
        assert dict(ledger.items()) == model
        assert ledger == model
        assert len(ledger) == len(model)
        assert all((k in ledger) == (k in model) for k in "abcdefg")
    for earlier, items in kept:
        assert dict(earlier) == items
    assert Ledger(model) == ledger
