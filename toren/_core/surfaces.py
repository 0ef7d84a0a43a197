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

Part = Literal["cli", "http", "mcp"]


def _refs(_: object, attribute: attrs.Attribute[tuple[str, ...]], value: tuple[str, ...]) -> None:
    for ref in value:
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
    """What ``"module:name"`` names, importing its module (an ``ImportError`` or
    ``AttributeError`` if it names nothing)."""
    module, _, name = ref.partition(":")
    return getattr(importlib.import_module(module), name)


def resolved(kinds: Iterable[Surfaces], part: Part) -> list[Any]:
    """Each of the kinds' ``part`` (``"cli"``, ``"http"`` or ``"mcp"``), resolved, in order."""
    return [resolve(ref) for surfaces in kinds for ref in getattr(surfaces, part)]
