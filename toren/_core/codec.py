"""Payloads: how messages, events and snapshots become JSON and back.

Messages and events are attrs classes registered under a stable type name with
:func:`message` (or :func:`event`, the same registry). The name, not the Python path, is stored, so
a class can move between modules without stranding journals. One cattrs converter serves the whole
project. Plain ``dict`` payloads are allowed too (type name ``json``), for senders that have no
Python class at hand (the CLI, other services).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar, get_args, get_origin

import attrs
from cattrs.preconf.json import make_converter

from toren._core.errors import InternalError, UnknownMessageType
from toren._core.history import History, Ledger
from toren._core.names import NAMES

converter = make_converter()


def _register_history() -> None:
    """A :class:`~toren._core.history.History` is written as a list of its items and read back as
    one with no stored chunks, a :class:`~toren._core.history.Ledger` as a dict (snapshots store
    their chunks themselves: :mod:`toren._core.snapshots`)."""

    def item_of(t: Any) -> Any:
        args = get_args(t)
        return args[0] if args else Any

    def is_history(t: Any) -> bool:
        return t is History or get_origin(t) is History

    def unstructure(t: Any) -> Callable[[Any], Any]:
        item = item_of(t)
        return lambda v: [converter.unstructure(x, item) for x in v]

    def structure(t: Any) -> Callable[[Any, Any], Any]:
        item = item_of(t)
        return lambda v, _: History([converter.structure(x, item) for x in v])

    converter.register_unstructure_hook_factory(is_history, unstructure)
    converter.register_structure_hook_factory(is_history, structure)

    def is_ledger(t: Any) -> bool:
        return t is Ledger or get_origin(t) is Ledger

    def unstructure_ledger(t: Any) -> Callable[[Any], Any]:
        item = item_of(t)
        return lambda v: {k: converter.unstructure(x, item) for k, x in v.items()}

    def structure_ledger(t: Any) -> Callable[[Any, Any], Any]:
        item = item_of(t)
        return lambda v, _: Ledger({k: converter.structure(x, item) for k, x in v.items()})

    converter.register_unstructure_hook_factory(is_ledger, unstructure_ledger)
    converter.register_structure_hook_factory(is_ledger, structure_ledger)


_register_history()

JSON = "json"
# The process's payload names (toren._core.names), read on every encode and decode.
_class_named = NAMES.payloads.get
_name_of = NAMES.payload_names.get

T = TypeVar("T", bound=type)


def message(name: str) -> Callable[[T], T]:
    """Register an attrs class as a payload stored under ``name``.

    Raises:
        InternalError: the name is taken by another class, or the class is not an attrs class.
    """

    def register(cls: T) -> T:
        checked: type = cls  # attrs.has() narrows its argument; keep ``cls`` a T
        if not attrs.has(checked):
            raise InternalError(f"{cls.__qualname__} must be an attrs class to be a payload")
        NAMES.add_payload(name, cls)
        return cls

    return register


event = message


def type_name(payload: object) -> str:
    """The registered name of a payload's type.

    Raises:
        UnknownMessageType: the payload's class was never registered.
    """
    if isinstance(payload, dict):
        return JSON
    name = _name_of(type(payload))
    if name is None:
        raise UnknownMessageType(type(payload).__qualname__)
    return name


def encode(payload: object) -> tuple[str, Any]:
    """``(type name, JSON-ready body)`` for a payload."""
    name = type_name(payload)
    if name == JSON:
        return name, payload
    return name, converter.unstructure(payload)


def decode(name: str, body: Any) -> Any:
    """The payload stored as ``(name, body)``.

    Raises:
        UnknownMessageType: no loaded module registered ``name``.
    """
    if name == JSON:
        return body
    cls = _class_named(name)
    if cls is None:
        raise UnknownMessageType(name)
    return converter.structure(body, cls)


def registered() -> dict[str, type]:
    """Every registered payload type by name (a copy)."""
    return dict(NAMES.payloads)
