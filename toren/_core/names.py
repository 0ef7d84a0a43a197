"""The process's names: which class an actor kind and a payload's wire name stand for.

Class statements fill it: an :class:`~toren._core.actor.Actor` subclass naming its ``kind``,
a class decorated with :func:`~toren._core.codec.message` (or ``event``). A class exists once
per process, so its name does too: two workers in one process run the same classes and read the
same names, and nothing here belongs to one worker. It is the one registry the kernel keeps for
the process (``tests/test_floors.py`` lists it).

The kernel's hot paths (encoding and decoding every payload, finding an actor's class) read its
tables through their ``get`` methods, bound once at import, so a lookup costs no more than a
module-level dict's. The tables are made once and never replaced, so those bound readers stay
true.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Final

from toren._core.errors import InternalError

if TYPE_CHECKING:
    from toren._core.actor import Actor


class Names:
    """Actor kinds and payload types by name (and payload names by type).

    Attributes:
        kinds: each actor kind's class.
        payloads: each payload type by its wire name.
        payload_names: each payload type's wire name.
    """

    __slots__ = ("kinds", "payload_names", "payloads")

    def __init__(self) -> None:
        self.kinds: Final[dict[str, type[Actor[Any]]]] = {}
        self.payloads: Final[dict[str, type]] = {}
        self.payload_names: Final[dict[type, str]] = {}

    def add_kind(self, kind: str, cls: type[Actor[Any]]) -> None:
        """Register ``cls`` as actor kind ``kind`` (again, for a class of the same name: a
        module imported twice, a class redefined in a test).

        Raises:
            InternalError: ``kind`` is another class's.
        """
        _free(self.kinds, "actor kind", kind, cls)
        self.kinds[kind] = cls

    def add_payload(self, name: str, cls: type) -> None:
        """Register ``cls`` as the payload stored under ``name`` (again, as :meth:`add_kind`).

        Raises:
            InternalError: ``name`` is another class's.
        """
        _free(self.payloads, "payload name", name, cls)
        self.payloads[name] = cls
        self.payload_names[cls] = name


def _free(table: Mapping[str, type], what: str, name: str, cls: type) -> None:
    """Raise unless ``name`` in ``table`` is free or ``cls``'s (by its qualified name)."""
    other = table.get(name)
    if other is not None and other.__qualname__ != cls.__qualname__:
        raise InternalError(f"{what} {name!r} is taken by {other.__qualname__}")


NAMES = Names()
