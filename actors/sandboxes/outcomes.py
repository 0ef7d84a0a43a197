"""What the helper script's execs come back with, read: a command's outcome, a directory
listing, and the error each of its exit statuses means.

The script (:mod:`toren.actors.sandboxes._script`) says how a command went in one status line on
stderr and the command's output on stdout; a file action says what was wrong with a path by its
exit status. Here those become values and exceptions; :mod:`toren.actors.sandboxes.docker` runs
the execs.
"""

from __future__ import annotations

import errno
import re
from typing import Literal

import attrs

from toren.actors.sandboxes.hardening import WORKSPACE

MARKER_ENV = "TOREN_COMMAND"
"""The environment variable that tags every process of a command with its marker."""

_MARKER = re.compile(r"[A-Za-z0-9_-]{1,128}")  # no dot: a record's files are <marker>.<part>


@attrs.frozen
class ScriptDone:
    """One exec of the helper script, ended: its exit status, its stdout, its stderr."""

    exit_code: int
    stdout: bytes
    stderr: str


@attrs.frozen(kw_only=True)
class Outcome:
    """What is known about one command."""

    state: Literal["finished", "interrupted", "not_started"]
    exit_code: int | None  # None: unknown. 124 or 137 when killed at the time limit
    output: str  # stdout and stderr merged, at most the cap (UTF-8, invalid bytes replaced)
    output_bytes: int  # everything the command wrote, counted
    timed_out: bool = False
    oom_killed: bool = False

    @property
    def truncated(self) -> bool:
        return self.output_bytes > len(self.output.encode())


class ExecFailed(Exception):
    """A helper script failed inside the container; ``stderr`` says why."""

    def __init__(self, action: str, exit_code: int, stderr: str) -> None:
        self.action = action
        self.exit_code = exit_code
        self.stderr = stderr
        hint = (
            " (does the image have bash, GNU coreutils and tar?)" if exit_code in (126, 127) else ""
        )
        super().__init__(f"{action} in the sandbox failed, exit {exit_code}{hint}: {stderr}")


class PathRefused(ValueError):
    """A workspace path that is not allowed; ``reason`` says why."""

    def __init__(self, path: str, reason: str) -> None:
        self.path = path
        self.reason = reason
        super().__init__(f"path {path!r} refused: {reason}")


class WorkspaceTooLarge(Exception):
    """The workspace holds more than it may be exported as (sparse files, or a cap raised)."""


class MarkerUsed(ValueError):
    """A command with this marker already ran (or started) in the container."""

    def __init__(self, marker: str) -> None:
        self.marker = marker
        super().__init__(
            f"a command with marker {marker!r} already ran in this sandbox: a marker runs at most "
            "once (recover() says what became of it)"
        )


def check_marker(marker: str) -> None:
    if not _MARKER.fullmatch(marker):
        raise ValueError(f"a marker is 1 to 128 of A-Z, a-z, 0-9, _ and -, not {marker!r}")


def raise_for_path(action: str, path: str, done: ScriptDone) -> None:
    """Raise what a file action's exit status means (nothing for 0).

    Raises:
        PathRefused: 3, outside the workspace or not a regular file.
        FileNotFoundError, IsADirectoryError, NotADirectoryError: 4, 5, 6.
        ExecFailed: any other failure.
    """
    reason = done.stderr.strip().splitlines()[-1] if done.stderr.strip() else ""
    if done.exit_code == 3:
        raise PathRefused(path, reason)
    if done.exit_code == 4:
        raise FileNotFoundError(errno.ENOENT, reason, path)
    if done.exit_code == 5:
        raise IsADirectoryError(errno.EISDIR, reason, path)
    if done.exit_code == 6:
        raise NotADirectoryError(errno.ENOTDIR, reason, path)
    if done.exit_code != 0:
        raise ExecFailed(f"{action} {path!r}", done.exit_code, done.stderr.strip())


def read_listing(stdout: bytes) -> list[tuple[str, str, int]]:
    """``list``'s output (NUL-separated stat type, size and path triples) as (path relative to
    /workspace, kind, size) entries."""
    fields = stdout.split(b"\0")[:-1]
    entries = []
    for index in range(0, len(fields) - 2, 3):
        kind = fields[index].decode()
        name = fields[index + 2].decode("utf-8", errors="surrogateescape")
        entries.append(
            (name.removeprefix(WORKSPACE).lstrip("/"), _kind(kind), int(fields[index + 1]))
        )
    return entries


def _kind(stat_type: str) -> str:
    if stat_type in ("regular file", "regular empty file"):
        return "file"
    return {"directory": "dir", "symbolic link": "link"}.get(stat_type, "other")


def read_outcome(action: str, done: ScriptDone) -> Outcome:
    """Parses ``report``: ``toren STATE EXIT TIMED OOM REST`` on stderr, the output on stdout."""
    status = [line.split() for line in done.stderr.splitlines() if line.startswith("toren ")]
    if done.exit_code != 0 or not status or len(status[-1]) != 6:
        raise ExecFailed(action, done.exit_code, done.stderr.strip())
    _, state, exit_code, timed, oom, rest = status[-1]
    if state not in ("finished", "interrupted", "not_started"):
        raise ExecFailed(action, done.exit_code, f"unexpected report {done.stderr.strip()!r}")
    return Outcome(
        state=state,  # type: ignore[arg-type]  # checked against the Literal just above
        exit_code=None if exit_code == "-" else int(exit_code),
        output=done.stdout.decode("utf-8", errors="replace"),
        output_bytes=len(done.stdout) + int(rest),
        timed_out=timed == "1",
        oom_killed=oom == "1",
    )
