"""What a worker lends its actors: its runtimes, providers and registries, by type.

A worker opens what its actors share (a model provider pool, a Docker client, its agents) when
it starts and closes it when it stops. It puts each into one :class:`Resources`, which every
:class:`~toren._core.host.ActorHost` it builds hands to each :class:`~toren._core.actor.Context`
(``ctx.resources``). Two workers in one process each have their own, so nothing an actor uses
is shared through a module's globals.
"""

from __future__ import annotations

from typing import Any, TypeVar

from toren._core.errors import InternalError

T = TypeVar("T")


class MissingResource(InternalError):
    """An actor asked its worker for something the worker did not open."""

    def __init__(self, kind: type[Any]) -> None:
        self.kind = kind
        super().__init__(f"this worker has no {kind.__qualname__} (it was not opened)")


class Resources:
    """One worker's shared objects, at most one per type."""

    def __init__(self, *values: object) -> None:
        self._by_type: dict[type[Any], object] = {}
        for value in values:
            self.put(value)

    def put(self, value: T, *, as_type: type[T] | None = None) -> T:
        """Make ``value`` the worker's ``as_type`` (its own type by default); returns it."""
        self._by_type[as_type or type(value)] = value
        return value

    def remove(self, kind: type[Any]) -> None:
        """Forget the worker's ``kind`` (after closing it), if it has one."""
        self._by_type.pop(kind, None)

    def find(self, kind: type[T]) -> T | None:
        """The worker's ``kind``, or ``None`` if it has none."""
        value = self._by_type.get(kind)
        if value is None:
            return None
        if not isinstance(value, kind):
            raise InternalError(f"resource {kind.__qualname__} holds a {type(value).__name__}")
        return value

    def get(self, kind: type[T]) -> T:
        """The worker's ``kind``.

        Raises:
            MissingResource: the worker did not open one (an internal error: a worker opens
                everything its actor kinds ask for before it claims any actor).
        """
        value = self.find(kind)
        if value is None:
            raise MissingResource(kind)
        return value

    def __contains__(self, kind: object) -> bool:
        return kind in self._by_type
