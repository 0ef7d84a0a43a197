"""Settings and secrets read from files: ``X_FILE=/path`` gives ``X`` the file's content.

Container platforms hand secrets over as files (Docker and Compose secrets under
``/run/secrets/``, Kubernetes secret volumes); a secret in a plain environment variable shows in
``docker inspect`` and in every child process. So any variable ``X`` that Toren or an agent reads
can be given as ``X_FILE`` instead: the file's content, without its trailing newline, becomes
``X`` in this process's environment at boot, before settings, providers and channels read it.

Which ``X``: a name starting with ``TOREN_``, ``ANTHROPIC_``, ``OPENAI_``, ``AWS_`` or
``TELEGRAM_``; a name ending with ``_TOKEN``, ``_SECRET``, ``_KEY`` or ``_PASSWORD``; and every
name an agent's Telegram channel reads (``token_env``, ``webhook_secret_env``). Variables whose
own meaning is a path (``AWS_CONFIG_FILE``, ``AWS_SHARED_CREDENTIALS_FILE``, ...) are left
alone, and so is an empty ``X_FILE``. A file that cannot be read is an error, except for a name
covered only by its ending (it may be another program's): that one is warned about and left
unset. Values are never logged; errors name the variable and the path, never the content.
"""

from __future__ import annotations

import logging
import os
import re
import select
import stat
import time
from collections.abc import Iterable, MutableMapping

from toren._core.errors import ConfigError

log = logging.getLogger("toren.secrets")

SUFFIX = "_FILE"
PREFIXES = ("TOREN_", "ANTHROPIC_", "OPENAI_", "AWS_", "TELEGRAM_")
SECRET_ENDINGS = ("_TOKEN", "_SECRET", "_KEY", "_PASSWORD")
# Variables that are paths in their own right: their X is not a setting.
NATIVE = frozenset(
    {
        "AWS_CONFIG_FILE",
        "AWS_SHARED_CREDENTIALS_FILE",
        "AWS_WEB_IDENTITY_TOKEN_FILE",
        "AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE",
        "AZURE_FEDERATED_TOKEN_FILE",
    }
)
MAX_BYTES = 64 * 1024
STREAM_SECONDS = 5.0  # how long a pipe or a device (not a regular file) may take to end
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def covered(name: str) -> bool:
    """Whether the fixed rules let ``name`` (a variable without ``_FILE``) be read from a file."""
    if name + SUFFIX in NATIVE:
        return False
    return name.startswith(PREFIXES) or name.endswith(SECRET_ENDINGS)


def read_secret_files(
    env: MutableMapping[str, str] | None = None, *, names: Iterable[str] | None = None
) -> list[str]:
    """Set variables from the files their ``X_FILE`` names. Without ``names``: every variable
    the fixed rules cover (the CLI does this first, at boot); with ``names``: those of
    ``names`` the rules do not cover (variables an app reads, once it is loaded). Returns the
    names set, sorted (never the values).

    Raises:
        ConfigError: both ``X`` and ``X_FILE`` are set, or the file cannot be read, is not
            UTF-8 text, is empty or is larger than 64 KiB, or (a pipe, a device) does not end
            within 5 s. The message names the variable
            and the path, never the content. Nothing is set when any file fails.
    """
    env = os.environ if env is None else env
    wanted = None if names is None else {n for n in names if _NAME.fullmatch(n)}
    found: dict[str, str] = {}
    for var, path in sorted(env.items()):
        name = var.removesuffix(SUFFIX)
        if name == var or not name or var in NATIVE or not path:  # X_FILE= is unset
            continue
        if not (covered(name) if wanted is None else name in wanted and not covered(name)):
            continue
        if env.get(name):
            raise ConfigError(
                f"both {name} and {var} are set",
                hint=f"Give the value one way: unset {name}, or unset {var}.",
            )
        try:
            found[name] = _read(var, path)
        except ConfigError as exc:
            if wanted is not None or name.startswith(PREFIXES):
                raise
            # Only its ending made it a secret: it may be another program's variable (a path
            # in its own right), which must not stop every toren command.
            log.warning("%s; %s is left unset", exc, name)
    env.update(found)
    if found:
        log.info("read from files: %s", ", ".join(sorted(found)))
    return sorted(found)


def _read(var: str, path: str) -> str:
    try:
        raw = _read_bytes(path)
    except TimeoutError:
        raise ConfigError(
            f"{var}: nothing came from {path!r} within {STREAM_SECONDS:g} s",
            hint="Point it at a file (a pipe or a device is read only until it ends).",
        ) from None
    except OSError as exc:
        raise ConfigError(
            f"{var}: cannot read {path!r}: {exc.strerror or exc}",
            hint="Mount the secret file there and make it readable by this user "
            f"(uid {os.getuid()}).",
        ) from None
    if len(raw) > MAX_BYTES:
        raise ConfigError(f"{var}: {path!r} is larger than {MAX_BYTES // 1024} KiB")
    try:
        text = raw.decode("utf-8-sig")  # a BOM (Windows editors) is not part of it
    except UnicodeDecodeError:
        raise ConfigError(f"{var}: {path!r} is not UTF-8 text") from None
    value = text.rstrip("\r\n")
    if not value:
        raise ConfigError(f"{var}: {path!r} is empty")
    if "\x00" in value:
        raise ConfigError(f"{var}: {path!r} holds a NUL character")
    return value


def _read_bytes(path: str) -> bytes:
    """Up to ``MAX_BYTES + 1`` bytes of ``path``. Opened without blocking, so a pipe no one
    writes to reads as empty instead of hanging the boot; a pipe or a device (not a regular
    file: a shell's ``<(...)``) is read until it ends, for at most :data:`STREAM_SECONDS`."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        if stat.S_ISREG(os.fstat(fd).st_mode):
            os.set_blocking(fd, True)
            with os.fdopen(os.dup(fd), "rb") as f:
                return f.read(MAX_BYTES + 1)
        deadline = time.monotonic() + STREAM_SECONDS
        raw = b""
        while len(raw) <= MAX_BYTES:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise TimeoutError
            try:
                chunk = os.read(fd, MAX_BYTES + 1 - len(raw))
            except BlockingIOError:
                continue
            if not chunk:
                break
            raw += chunk
        return raw
    finally:
        os.close(fd)
