"""History: a persistent sequence for the long, append-mostly parts of an actor's state.

A run's calls and conversation only grow, and most of what they hold is never read again by the
run itself (the next step reads the latest turns; the next model request reads the conversation
once). A :class:`History` is an immutable sequence with two parts: a *stored prefix*, in chunks
that a snapshot wrote (raw JSON, decoded the first time something reads into the chunk), and a
*tail* of items added since (a persistent vector). Appending costs the same whatever the length;
activating an actor from its snapshot costs the bytes of its chunks, not the objects in them.

A snapshot (:mod:`toren._core.snapshots`) writes the tail as one new chunk and keeps the chunks it
already wrote, so writing a snapshot costs what was added since the last one.

Reading past the tail (an index into a stored chunk) decodes that chunk once; changing an item of
a stored chunk (``set``) or cutting into one (a slice) moves the chunk's items into the tail, so
the chunk is written again by the next snapshot. Both are rare for a run (its last turn is
changed, which is in the tail or the last chunk; invalidation cuts).

A History can *release* its first items (:meth:`History.release`): they keep their places (its
length and every later index are unchanged) but can no longer be read, and the stored chunks
that hold only released items are let go, so the next snapshot no longer names them. What a
never-ending conversation keeps is then bounded. Reading a released item raises
:class:`Released`; iterating yields the items kept (from :attr:`History.released` on).
"""

from __future__ import annotations

import bisect
import itertools
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, Generic, TypeVar, overload

from pyrsistent import PMap, PVector, pmap, pvector

T = TypeVar("T")


class Released(LookupError):
    """An item a History released was read (see :meth:`History.release`): a reader that needs
    it must stop at :attr:`History.released`. Not an IndexError, so that nothing mistakes it
    for the end of the sequence."""

    def __init__(self, index: int, released: int) -> None:
        super().__init__(f"item {index} was released (the first {released} items are)")
        self.index = index
        self.released = released


class Chunk(Generic[T]):
    """Items a snapshot stored under ``key``: ``count`` of them, decoded on first use.

    Immutable in meaning: the decoded items are cached (and the stored bytes then let go), and
    decoding twice (two threads at once) gives equal items. ``checksum`` is what the snapshot
    that names the chunk recorded for its bytes.
    """

    __slots__ = ("_decode", "_items", "_lock", "checksum", "count", "key", "raw")

    def __init__(
        self,
        key: str,
        count: int,
        raw: bytes,
        decode: Callable[[bytes], Sequence[T]],
        *,
        checksum: str = "",
        items: tuple[T, ...] | None = None,
    ) -> None:
        self.key = key
        self.count = count
        self.raw = raw if items is None else b""
        self.checksum = checksum
        self._decode = decode
        self._items = items
        self._lock = threading.Lock()

    @property
    def decoded(self) -> bool:
        return self._items is not None

    def items(self) -> tuple[T, ...]:
        """The chunk's items.

        Raises:
            ValueError: the stored chunk does not hold ``count`` items (a damaged snapshot).
        """
        items = self._items
        if items is None:
            with self._lock:
                items = self._items
                if items is None:
                    try:
                        items = tuple(self._decode(self.raw))
                    except Exception as exc:
                        raise ValueError(
                            f"snapshot chunk {self.key!r} cannot be read: {exc}"
                        ) from exc
                    if len(items) != self.count:
                        raise ValueError(
                            f"snapshot chunk {self.key!r} holds {len(items)} items, "
                            f"not {self.count}"
                        )
                    self._items = items
                    self.raw = b""
        return items

    def __repr__(self) -> str:
        return f"Chunk({self.key!r}, count={self.count}, decoded={self.decoded})"


class History(Sequence[T]):
    """An immutable sequence: released items (counted, not held), stored chunks, then a
    persistent tail."""

    __slots__ = ("_chunks", "_offset", "_released", "_starts", "_stored", "_tail")

    def __init__(
        self,
        items: Iterable[T] = (),
        *,
        chunks: Sequence[Chunk[T]] = (),
        tail: Any = None,
        offset: int = 0,
        released: int = 0,
    ) -> None:
        self._chunks: tuple[Chunk[T], ...] = tuple(chunks)
        starts, total = [], 0
        for chunk in self._chunks:
            starts.append(total)
            total += chunk.count
        self._starts: tuple[int, ...] = tuple(starts)
        self._stored = total
        # ``offset`` items come before the first chunk (released and let go); the first
        # ``released`` (at least ``offset``) cannot be read.
        self._offset = offset
        self._released = max(offset, released)
        if tail is not None:
            self._tail: PVector[T] = tail
        else:
            self._tail = pvector(items)

    def _with_tail(self, tail: PVector[T]) -> History[T]:
        """The same stored chunks with ``tail``: what every append makes, so nothing about the
        chunks is worked out again."""
        made: History[T] = History.__new__(History)
        made._chunks, made._starts, made._stored = self._chunks, self._starts, self._stored
        made._offset, made._released = self._offset, self._released
        made._tail = tail
        return made

    # What snapshots need.

    @property
    def chunks(self) -> tuple[Chunk[T], ...]:
        """The stored chunks, in order."""
        return self._chunks

    @property
    def tail(self) -> PVector[T]:
        """The items added since the stored chunks."""
        return self._tail

    @property
    def offset(self) -> int:
        """How many items come before the first stored chunk (released, not held)."""
        return self._offset

    @property
    def released(self) -> int:
        """How many items at the front were released: the first index that can be read."""
        return self._released

    def stored(self, chunk: Chunk[T], keep: int = 0) -> History[T]:
        """This sequence with its tail but the last ``keep`` items stored as ``chunk`` (which
        holds those items)."""
        kept = self._tail[len(self._tail) - keep :] if keep else pvector()
        return History(
            chunks=(*self._chunks, chunk),
            tail=pvector(kept),
            offset=self._offset,
            released=self._released,
        )

    def release(self, count: int) -> History[T]:
        """This sequence with its first ``count`` items released (at least those released
        already, at most all of them): their places kept, their values no longer readable.
        The chunks that hold only released items are let go; a chunk that holds a kept item
        is kept whole (releasing is by chunk)."""
        n = min(max(count, self._released), len(self))
        if n == self._released:
            return self
        chunks, offset = list(self._chunks), self._offset
        while chunks and offset + chunks[0].count <= n:
            offset += chunks.pop(0).count
        tail = self._tail
        if not chunks and n > offset:  # into the tail: its released items go too
            tail = pvector(self._tail[n - offset :])
            offset = n
        return History(chunks=chunks, tail=tail, offset=offset, released=n)

    # Sequence.

    def __len__(self) -> int:
        return self._offset + self._stored + len(self._tail)

    @overload
    def __getitem__(self, index: int) -> T: ...

    @overload
    def __getitem__(self, index: slice) -> History[T]: ...

    def __getitem__(self, index: int | slice) -> T | History[T]:
        if isinstance(index, slice):
            return self._slice(index)
        n = len(self)
        i = index + n if index < 0 else index
        if not 0 <= i < n:
            raise IndexError("History index out of range")
        if i < self._released:
            raise Released(i, self._released)
        i -= self._offset
        if i >= self._stored:
            return self._tail[i - self._stored]
        c = bisect.bisect_right(self._starts, i) - 1
        return self._chunks[c].items()[i - self._starts[c]]

    def __iter__(self) -> Iterator[T]:
        """The items kept (from :attr:`released` on)."""
        skip = self._released - self._offset
        for chunk in self._chunks:
            if skip >= chunk.count:
                skip -= chunk.count
                continue
            items = chunk.items()
            yield from items[skip:] if skip else items
            skip = 0
        yield from self._tail[skip:] if skip else self._tail

    def __reversed__(self) -> Iterator[T]:
        """The items kept, last first (a chunk is decoded only when reached)."""
        stored = (item for chunk in reversed(self._chunks) for item in reversed(chunk.items()))
        everything = itertools.chain(reversed(self._tail), stored)
        return itertools.islice(everything, len(self) - self._released)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, History):
            return (
                len(self) == len(other)
                and self._released == other._released
                and all(a == b for a, b in zip(self, other, strict=True))
            )
        if isinstance(other, PVector | list | tuple):
            return (
                not self._released
                and len(self) == len(other)
                and all(a == b for a, b in zip(self, other, strict=True))
            )
        return NotImplemented

    def __hash__(self) -> int:
        return hash((self._released, tuple(self)))

    def __repr__(self) -> str:
        released = f", {self._released} released" if self._released else ""
        return f"History({len(self)} items, {len(self._chunks)} stored chunks{released})"

    def __reduce__(self) -> tuple[Any, ...]:
        # Pickled and copied (``copy.deepcopy``) by its items, as a tuple is: a stored chunk's
        # decoder and lock stay behind.
        if self._released:
            return (_kept, (self._released, tuple(self)))
        return (History, (tuple(self),))

    # Persistent updates: each returns a new History; this one is unchanged.

    def append(self, item: T) -> History[T]:
        return self._with_tail(self._tail.append(item))

    def extend(self, items: Iterable[T]) -> History[T]:
        return self._with_tail(self._tail.extend(items))

    def set(self, index: int, item: T) -> History[T]:
        n = len(self)
        i = index + n if index < 0 else index
        if not 0 <= i < n:
            raise IndexError("History index out of range")
        if i < self._released:
            raise Released(i, self._released)
        local = i - self._offset
        if local >= self._stored:
            return self._with_tail(self._tail.set(local - self._stored, item))
        # Into a stored chunk: that chunk and the ones after it become tail again.
        c = bisect.bisect_right(self._starts, local) - 1
        return self._opened(c).set(i, item)

    def _opened(self, c: int) -> History[T]:
        """The same items with chunks ``c`` on moved into the tail."""
        moved = [x for chunk in self._chunks[c:] for x in chunk.items()]
        return History(
            chunks=self._chunks[:c],
            tail=pvector(moved).extend(self._tail),
            offset=self._offset,
            released=self._released,
        )

    def _slice(self, s: slice) -> History[T]:
        start, stop, step = s.indices(len(self))
        if step != 1:
            return History([self[i] for i in range(start, stop, step)])
        if start == 0:
            # A prefix (what a run keeps when it voids later steps): whole chunks kept as they
            # are, released items still released.
            if stop <= self._released:
                return History(offset=stop, released=stop)
            local = stop - self._offset
            c = bisect.bisect_right(self._starts, local) - 1 if self._chunks else -1
            while c >= 0 and self._starts[c] + self._chunks[c].count > local:
                c -= 1
            kept = self._chunks[: c + 1]
            done = self._offset + sum(chunk.count for chunk in kept)
            rest = History(chunks=self._chunks[c + 1 :], tail=self._tail)
            return History(
                chunks=kept,
                tail=pvector(rest._items(0, stop - done)),
                offset=self._offset,
                released=self._released,
            )
        if start < self._released:
            raise Released(start, self._released)
        return History(self._items(start, stop))

    def _items(self, start: int, stop: int) -> list[T]:
        """Items ``start`` to ``stop`` (in range, none released), reading only the chunks that
        hold them."""
        if stop <= start:
            return []
        start, stop = start - self._offset, stop - self._offset
        if start >= self._stored:
            return list(self._tail[start - self._stored : stop - self._stored])
        c = bisect.bisect_right(self._starts, start) - 1
        items = itertools.chain(
            (x for chunk in self._chunks[c:] for x in chunk.items()), self._tail
        )
        return list(itertools.islice(items, start - self._starts[c], stop - self._starts[c]))


def _kept(released: int, items: tuple[T, ...]) -> History[T]:
    """A History whose first ``released`` items were released, then ``items`` (unpickling)."""
    return History(items, offset=released, released=released)


class Ledger(Mapping[str, T]):
    """An immutable map whose values are kept in a :class:`History`, found through an index of
    positions: a snapshot stores the values in chunks like any History (read when looked up),
    and only the index (keys and positions) in its row. For the large maps of a state whose
    values are only ever added (a run's tool intents and results by call id).

    A value replaced or dropped stays in the History, out of the index (both are rare for the
    maps it is made for)."""

    __slots__ = ("_index", "_values")

    def __init__(
        self,
        items: Mapping[str, T] | Iterable[tuple[str, T]] = (),
        *,
        index: PMap[str, int] | None = None,
        values: History[T] | None = None,
    ) -> None:
        if index is not None and values is not None:
            self._index, self._values = index, values
            return
        pairs = list(items.items() if isinstance(items, Mapping) else items)
        self._values = History([v for _, v in pairs])
        self._index = pmap({k: i for i, (k, _) in enumerate(pairs)})

    @property
    def index(self) -> PMap[str, int]:
        """Each key's position in :attr:`values`."""
        return self._index

    @property
    def values_kept(self) -> History[T]:
        """Every value added, those replaced or dropped included."""
        return self._values

    def with_values(self, values: History[T]) -> Ledger[T]:
        """The same map over ``values`` (which holds the same items, stored otherwise)."""
        return Ledger(index=self._index, values=values)

    def __getitem__(self, key: str) -> T:
        return self._values[self._index[key]]

    def __contains__(self, key: object) -> bool:
        return key in self._index

    def __iter__(self) -> Iterator[str]:
        return iter(self._index)

    def __len__(self) -> int:
        return len(self._index)

    def __repr__(self) -> str:
        return f"Ledger({len(self)} keys)"

    def __reduce__(self) -> tuple[Any, ...]:
        return (Ledger, (dict(self.items()),))

    def set(self, key: str, value: T) -> Ledger[T]:
        return Ledger(
            index=self._index.set(key, len(self._values)), values=self._values.append(value)
        )

    def release(self, keys: Iterable[str]) -> Ledger[T]:
        """This map without ``keys``, its values released up to the first one a kept key
        names (see :meth:`History.release`): the values of dropped keys are let go as long as
        they come before every kept one (a map whose values are added in key order)."""
        ledger = self.without(keys)
        first = min(ledger._index.values(), default=len(ledger._values))
        return Ledger(index=ledger._index, values=ledger._values.release(first))

    def without(self, keys: Iterable[str]) -> Ledger[T]:
        drop = self._index.evolver()
        for key in set(keys):
            if key in self._index:
                del drop[key]
        return Ledger(index=drop.persistent(), values=self._values)
