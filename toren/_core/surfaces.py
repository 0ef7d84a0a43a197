"""What a kind shows its users, named by where it lives: its CLI commands, HTTP routes and MCP
tools.

A kind's descriptor names its surfaces by import string (``"toren._cli.runs:register"``), so
that naming them imports nothing: the kernel knows no surface, a kind's behaviour does not
import the CLI or the server, and the CLI's start pays only for the commands it describes. Each
surface resolves its own part when it is built: the CLI registers the kinds' command groups,
the HTTP app installs their routes, the MCP server adds their tools.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable
from typing import Any, Literal

import attrs

from toren._core.errors import ConfigError

Part = Literal["cli", "http", "mcp"]


def _refs(_: object, attribute: attrs.Attribute[tuple[str, ...]], value: object) -> None:
    if isinstance(value, str):  # ("m:f") for ("m:f",)
        raise TypeError(
            f"{attribute.name}: a tuple of MODULE:NAME strings, not the string {value!r} "
            "(a one-item tuple needs its comma)"
        )
    if not isinstance(value, tuple):
        raise TypeError(f"{attribute.name}: a tuple of MODULE:NAME strings, not {value!r}")
    for ref in value:
        if not isinstance(ref, str):
            raise TypeError(f"{attribute.name}: {ref!r} is not a MODULE:NAME string")
        module, colon, name = ref.partition(":")
        if not (module and colon and name):
            raise ValueError(f"{attribute.name}: {ref!r} is not MODULE:NAME")


@attrs.frozen(kw_only=True)
class Surfaces:
    """A kind's surfaces, each a ``"module:name"`` import string.

    Attributes:
        cli: ``(group: click.Group) -> None``: adds the kind's commands to ``toren``.
        http: ``(app: aiohttp.web.Application) -> None``: adds the kind's routes (before the
            app starts).
        mcp: ``(tools: toren._surfaces.mcp_server.McpTools) -> None``: adds the kind's tools to
            the MCP server.
    """

    cli: tuple[str, ...] = attrs.field(default=(), validator=_refs)
    http: tuple[str, ...] = attrs.field(default=(), validator=_refs)
    mcp: tuple[str, ...] = attrs.field(default=(), validator=_refs)


def resolve(ref: str) -> Any:
    """What ``"module:name"`` names, importing its module.

    Raises:
        ConfigError: it names nothing (the module or the name is missing, or importing the
            module failed), saying which string and why.
    """
    module, _, name = ref.partition(":")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"surface {ref!r} names nothing: {e}") from e


def resolved(kinds: Iterable[object], part: Part) -> list[Any]:
    """Each of the kinds' ``part`` (``"cli"``, ``"http"`` or ``"mcp"``), resolved, in order.

    Raises:
        TypeError: one of ``kinds`` is not a :class:`Surfaces` (a ``Kind`` gives its own as
            ``kind.surfaces``).
        ConfigError: a string names nothing.
    """
    out: list[Any] = []
    for surfaces in kinds:
        if not isinstance(surfaces, Surfaces):
            hint = " (for a Kind, pass kind.surfaces)" if hasattr(surfaces, "surfaces") else ""
            raise TypeError(f"a {type(surfaces).__name__} is not a Surfaces{hint}")
        out.extend(resolve(ref) for ref in getattr(surfaces, part))
    return out
