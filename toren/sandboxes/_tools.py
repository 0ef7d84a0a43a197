"""The tools a sandboxed agent's model sees: ``bash``, ``read_file``, ``write_file``,
``list_files``. The run never calls their functions: it sends each call to the run's sandbox
actor, which runs it in the container (see :mod:`toren.actors.sandboxes`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Annotated, Any

import pydantic

from toren._agent.agents import Tool, ToolContext, tool
from toren._core.errors import ConfigError
from toren.sandboxes._vocabulary import WORKSPACE

if TYPE_CHECKING:
    from toren.sandboxes._settings import Sandbox

COMMAND_MAX = 64 * 1024
CONTENT_MAX = 8 * 1024 * 1024
PATH_MAX = 4096
CAPTION_MAX = 1024
SEND_MAX = 50 * 1024 * 1024
"""The largest file ``send_file`` sends (what a bot may upload to Telegram)."""

Path = Annotated[str, pydantic.Field(min_length=1, max_length=PATH_MAX)]


def _outside() -> ConfigError:
    return ConfigError("sandbox tools run only inside a Toren run, in its sandbox")


async def bash(
    ctx: ToolContext, command: Annotated[str, pydantic.Field(min_length=1, max_length=COMMAND_MAX)]
) -> str:
    raise _outside()


async def read_file(ctx: ToolContext, path: Path) -> str:
    raise _outside()


async def write_file(
    ctx: ToolContext, path: Path, content: Annotated[str, pydantic.Field(max_length=CONTENT_MAX)]
) -> str:
    raise _outside()


async def list_files(ctx: ToolContext, path: Path = ".") -> str:
    raise _outside()


async def send_file(
    ctx: ToolContext,
    path: Path,
    caption: Annotated[str, pydantic.Field(max_length=CAPTION_MAX)] = "",
) -> str:
    raise _outside()


_FUNCTIONS = {f.__name__: f for f in (bash, read_file, write_file, list_files, send_file)}


def sandbox_tools(settings: Sandbox, *, chat: bool = False) -> tuple[Tool, ...]:
    """The four tools, declared for ``settings``: ``bash`` is external and asks a human for
    every command its allow rules do not match; it is at-most-once unless the sandbox is
    declared rerunnable. With ``chat`` (the agent has a Telegram bot), a fifth: a
    workspace file sent to the chat the run talks with."""

    def approval(arguments: Mapping[str, Any]) -> bool:
        return not settings.allows(str(arguments.get("command", "")))

    tools = (
        tool(
            effects="external",
            idempotency="unkeyed" if settings.rerunnable else "at_most_once",
            approval=approval,
            timeout=settings.command_timeout + 60,
            # Nothing of the settings is in the description: it is part of every request, and a
            # changed limit must not make recorded steps look asked differently.
            description=(
                f"Run a bash command in the run's sandbox (a Linux container). Every command "
                f"starts in {WORKSPACE}, the workspace, which keeps its files between commands; "
                "`cd` does not carry over. Output (stdout and stderr) past a cap is cut, and a "
                "command running past a time limit is killed: the result says so. A human may "
                "have to approve each command."
            ),
        )(bash),
        tool(
            effects="read",
            idempotency="keyed",
            description=f"Read a text file of the workspace ({WORKSPACE}); path relative to it.",
        )(read_file),
        tool(
            effects="write",
            idempotency="keyed",
            description=(
                f"Write a file in the workspace ({WORKSPACE}), replacing it; parent directories "
                "are made. Path relative to the workspace."
            ),
        )(write_file),
        tool(
            effects="read",
            idempotency="keyed",
            description=(
                f"List a directory of the workspace ({WORKSPACE}), recursively, with sizes; "
                "path relative to it (default: the workspace)."
            ),
        )(list_files),
    )
    if not chat:
        return tools
    return (
        *tools,
        tool(
            effects="external",
            idempotency="keyed",
            description=(
                f"Send a file of the workspace ({WORKSPACE}) to the chat you are talking with, "
                "with an optional caption (at most 1024 characters); path relative to the "
                "workspace, at most 50 MB. It is sent once, after this call's result."
            ),
        )(send_file),
    )


def is_sandbox_tool(t: Tool) -> bool:
    """Whether ``t`` is one of the sandbox's tools (run by the sandbox actor)."""
    return _FUNCTIONS.get(t.fn.__name__) is t.fn
