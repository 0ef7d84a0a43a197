"""What a running ``toren dev`` leaves under ``TOREN_HOME`` so that other terminals find it, and
the locks that keep a second one off its home and its data.

- ``database.json``, the record: ``pid``, ``database_url``, ``api_url`` and ``data_dir``. It is
  written (atomically, by rename) only once ``toren dev`` is up (Postgres started, schema
  migrated, API listening, worker registered), and removed when that same process exits
  cleanly. A record whose pid has exited, or whose home's lock no process holds (its pid is
  another process's by now), is stale: commands say that no ``toren dev`` runs.
- ``dev.lock``, held (``flock``) by the ``toren dev`` of this home for its whole life, and the
  data directory itself, held the same way: a second ``toren dev`` on either refuses to start and
  says where the first one runs. The kernel drops these locks when their process dies, even by
  ``kill -9``, so a crashed ``toren dev`` never blocks the next one; its stale record is replaced.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

import attrs

from toren._core.errors import ConfigError, TorenError

RECORD_FILE = "database.json"
LOCK_FILE = "dev.lock"


@attrs.frozen(kw_only=True)
class DevRecord:
    """Where a ``toren dev`` runs, as it recorded itself once up."""

    pid: int
    database_url: str
    api_url: str | None = None
    data_dir: str | None = None

    @property
    def alive(self) -> bool:
        """Whether the recorded process still exists (see :meth:`running_in`)."""
        return pid_alive(self.pid)

    def running_in(self, home: Path) -> bool:
        """Whether the ``toren dev`` recorded under ``home`` still runs: its pid exists and
        holds the home's lock. A pid alone may be another process's by now (after a reboot)."""
        return self.alive and _holder(home / LOCK_FILE) in (self.pid, _UNKNOWN)

    def where(self) -> str:
        """``pid N, API URL, data DIR``: what a person needs to find it."""
        parts = [f"pid {self.pid}", f"API {self.api_url}" if self.api_url else "no API"]
        if self.data_dir:
            parts.append(f"data in {self.data_dir}")
        return ", ".join(parts)


class DevAlreadyRunning(TorenError):
    """Another ``toren dev`` holds this home or this data directory."""

    def __init__(self, what: str, record: DevRecord | None, pid: int | None) -> None:
        self.record = record
        self.pid = record.pid if record else pid
        if record is not None:
            where = f" ({record.where()})"
        elif pid is not None:
            where = f" (pid {pid}, still starting)"
        else:
            where = ""
        super().__init__(
            f"another `toren dev` is already running on {what}{where}. Use that one (its "
            "commands work from any terminal), stop it with Ctrl-C in its terminal, or start "
            "this one with another TOREN_HOME and --data-dir"
        )


def pid_alive(pid: int) -> bool:
    """Whether a process ``pid`` exists (one of another user's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    except (OSError, OverflowError):
        return False
    return True


def read_record(home: Path) -> DevRecord | None:
    """The record under ``home``, alive or stale; ``None`` if there is none or it is unreadable
    (a record from an older version, a file cut short)."""
    try:
        data = json.loads((home / RECORD_FILE).read_text())
        record = DevRecord(
            pid=int(data["pid"]),
            database_url=str(data["database_url"]),
            api_url=data.get("api_url"),
            data_dir=data.get("data_dir"),
        )
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return record


def recorded_dev_url(home: Path) -> str | None:
    """The database URL a running ``toren dev`` recorded under ``home``; ``None`` when none
    runs (no record, or its process has exited)."""
    record = read_record(home)
    return record.database_url if record is not None and record.running_in(home) else None


def write_record(home: Path, record: DevRecord) -> None:
    """Write the record atomically: a reader sees the old one or the new one, never half."""
    home.mkdir(parents=True, exist_ok=True)
    staged = home / f".{RECORD_FILE}.{os.getpid()}"
    # Only its owner may read it: a configured database URL may hold a password.
    fd = os.open(staged, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps(attrs.asdict(record)))
    staged.replace(home / RECORD_FILE)


def remove_record(home: Path, pid: int) -> None:
    """Remove the record if it is ``pid``'s; leave anyone else's."""
    record = read_record(home)
    if record is not None and record.pid == pid:
        with contextlib.suppress(FileNotFoundError):
            (home / RECORD_FILE).unlink()


@contextlib.contextmanager
def claimed(home: Path, data_dir: Path | None) -> Iterator[None]:
    """Hold this home (and ``data_dir``, created if missing) for one ``toren dev`` while inside.

    Raises:
        DevAlreadyRunning: another process holds either; the message says where it runs.
        ConfigError: either cannot be created, opened or locked (a read-only directory, a
            file system without locks).
    """
    try:
        held = _claim(home, data_dir)
    except OSError as exc:
        where = exc.filename or home
        raise ConfigError(
            f"toren dev cannot use {where}: {exc.strerror or exc}",
            hint="Point TOREN_HOME (and --data-dir) at a local directory you can write to.",
        ) from None
    with held:
        yield


def _claim(home: Path, data_dir: Path | None) -> contextlib.ExitStack:
    """The locks of :func:`claimed`, held until the returned stack closes."""
    home.mkdir(parents=True, exist_ok=True)
    with contextlib.ExitStack() as stack:  # closed (locks dropped) if anything below fails
        lock = stack.enter_context(_open(home / LOCK_FILE, os.O_RDWR | os.O_CREAT))
        if not _try_lock(lock, patience=0.5):  # a reader asking :func:`_held` holds it briefly
            raise DevAlreadyRunning(f"{home}", read_record(home), _lock_pid(lock))
        os.ftruncate(lock, 0)
        os.write(lock, str(os.getpid()).encode())
        if data_dir is not None:
            data_dir.mkdir(parents=True, exist_ok=True)
            data = stack.enter_context(_open(data_dir, os.O_RDONLY))
            if not _try_lock(data):
                record = read_record(home)
                same = record is not None and record.data_dir == str(data_dir)
                raise DevAlreadyRunning(f"the data in {data_dir}", record if same else None, None)
        return stack.pop_all()


@contextlib.contextmanager
def _open(path: Path, flags: int) -> Iterator[int]:
    fd = os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)  # never through a link
    try:
        yield fd
    finally:
        os.close(fd)  # closing the last descriptor drops the lock


def _try_lock(fd: int, *, patience: float = 0.0, shared: bool = False) -> bool:
    """Lock ``fd`` (exclusively, unless ``shared``), trying for ``patience`` seconds."""
    deadline = time.monotonic() + patience
    while True:
        try:
            fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.02)
        else:
            return True


_UNKNOWN = -1


def _holder(lock: Path) -> int | None:
    """The pid of the ``toren dev`` holding ``lock`` (which it wrote there), ``None`` when no
    process holds it (a shared lock taken and dropped at once says so); ``_UNKNOWN`` when that
    cannot be told (an unreadable file), so that the pid decides."""
    try:
        fd = os.open(lock, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError:
        return _UNKNOWN
    try:
        if _try_lock(fd, shared=True):
            return None
        pid = _lock_pid(fd)
        return _UNKNOWN if pid is None else pid
    finally:
        os.close(fd)  # drops the shared lock


def _lock_pid(fd: int) -> int | None:
    try:
        return int(os.pread(fd, 32, 0).decode() or "x")
    except (OSError, ValueError):
        return None


def forget_dead_handles(data_dir: Path) -> None:
    """Drop the pids of exited processes from pgserver's list of the data directory's users.

    pgserver stops the server when its last user exits, judged by that list; a ``toren dev``
    killed with ``kill -9`` never took itself off it, so the next one's clean exit would leave
    the server running. Call it while holding the data directory (:func:`claimed`).
    """
    path = data_dir / ".handle_pids.json"
    try:
        pids = [int(p) for p in json.loads(path.read_text())]
    except (OSError, ValueError, TypeError):
        return
    live = [p for p in pids if pid_alive(p)]
    if live != pids:
        path.write_text(json.dumps(live))
