"""The kernel's settings, and how every layer's settings are read.

Settings are what is not code, read from ``toren.toml`` (or ``TOREN_CONFIG``) and ``TOREN_*``.
Precedence, lowest first: defaults, the TOML file, environment variables, explicit overrides
(command-line options). Invalid values raise :class:`~toren.ConfigError` naming the setting.

:class:`WorkerSettings` holds what the kernel reads: the database, leases and the worker. Each
layer above adds its own fields in a class of its own, with the variables it reads (``ENV``) and
the tables it parses (``TABLES``, :meth:`WorkerSettings.parse_tables`); ``toren.Settings``
(:mod:`toren._settings`) is composed from them all. This module knows none of their fields.
"""

from __future__ import annotations

import ipaddress
import math
import os
import socket
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar, Self
from urllib.parse import urlsplit

import attrs

from toren._core.durations import kept_for, setting_duration
from toren._core.errors import ConfigError
from toren._core.secret_files import SUFFIX

# Setting name -> (environment variable, type). The TOML file uses the setting names as keys,
# at top level or under [worker]; each layer's class names its own in ``ENV``.
Env = Mapping[str, tuple[str, type]]

_KERNEL_ENV: Env = {
    "database_url": ("TOREN_DATABASE_URL", str),
    "home": ("TOREN_HOME", Path),
    "lease_seconds": ("TOREN_LEASE_SECONDS", float),
    "renew_seconds": ("TOREN_RENEW_SECONDS", float),
    "poll_seconds": ("TOREN_POLL_SECONDS", float),
    "grace_seconds": ("TOREN_GRACE_SECONDS", float),
    "max_actors": ("TOREN_MAX_ACTORS", int),
    "pool_size": ("TOREN_POOL_SIZE", int),
    "commit_lanes": ("TOREN_COMMIT_LANES", int),
    "commit_batch": ("TOREN_COMMIT_BATCH", int),
    "worker_name": ("TOREN_WORKER_NAME", str),
    "deploy_label": ("TOREN_DEPLOY_LABEL", str),
    "actor_restart_intensity": ("TOREN_ACTOR_RESTART_INTENSITY", int),
    "actor_restart_period": ("TOREN_ACTOR_RESTART_PERIOD", float),
    "dedupe_retention_seconds": ("TOREN_DEDUPE_RETENTION_SECONDS", float),
    "snapshot_every": ("TOREN_SNAPSHOT_EVERY", int),
    "archive_store": ("TOREN_ARCHIVE_STORE", str),
    "deadletter_keep_for": ("TOREN_DEADLETTER_KEEP_FOR", str),
    "token_keep_for": ("TOREN_TOKEN_KEEP_FOR", str),
}


# What a value of each type must look like. An error says this instead of showing the value: a
# value that does not parse may be a secret given in the wrong variable or file.
_EXPECTED: dict[type, str] = {
    float: "a number",
    int: "a whole number",
    bool: "true or false (or 1/0, yes/no, on/off)",
    tuple: "addresses or networks (such as 10.0.0.0/8), comma-separated or as a list",
    str: "text",
    Path: "a path",
}
_NOT_SHOWN = "The value is not shown, in case it is a secret given in the wrong place."


def _deadletter_keep_for(value: str | float) -> float:
    return setting_duration("deadletter_keep_for", value)


def _token_keep_for(value: str | float) -> float:
    return setting_duration("token_keep_for", value)


def positive(inst: Any, attribute: attrs.Attribute[Any], value: float) -> None:
    if not (value > 0 and math.isfinite(value)):  # NaN compares false both ways
        raise ConfigError(f"{attribute.name} must be a positive finite number, got {value!r}")


def _batch_size(inst: Any, attribute: attrs.Attribute[Any], value: int) -> None:
    positive(inst, attribute, value)
    if value > 1000:
        raise ConfigError(f"{attribute.name} must be at most 1000, got {value!r}")


def http_url(inst: Any, attribute: attrs.Attribute[Any], value: str | None) -> None:
    # Printed to a terminal beside a run: a space or a line break would print a line, or a
    # link, that is not the console's.
    if value is None:
        return
    try:
        parts = urlsplit(value)
        usable = bool(parts.hostname) and parts.scheme.lower() in ("http", "https")
        usable = usable and not parts.query and not parts.fragment  # the link appends #/runs/
    except ValueError:  # such as an unclosed [ of an IPv6 address
        usable = False
    if not usable or any(c.isspace() or not c.isprintable() for c in value):
        raise ConfigError(
            f"{attribute.name} must be an http:// or https:// URL with a host, and no query, "
            "fragment, spaces or control characters",
            hint="Give the address people open the console at, such as https://toren.example.com.",
        )


def networks(value: Any, where: str = "trusted_proxies") -> tuple[str, ...]:
    """Addresses or networks, from a list or a comma-separated string.

    Raises:
        ConfigError: one is neither; the message names ``where`` and the entry's position,
            never the entry (it may be a secret given in the wrong place).
    """
    items = value.split(",") if isinstance(value, str) else list(value)
    found = []
    for n, item in enumerate((str(i).strip() for i in items), start=1):
        if not item:
            continue
        try:
            found.append(str(ipaddress.ip_network(item, strict=False)))
        except ValueError:
            raise ConfigError(
                f"{where}: entry {n} of {len(items)} must be an address or network "
                "(such as 10.0.0.0/8)",
                hint=_NOT_SHOWN,
            ) from None
    return tuple(found)


@attrs.frozen(kw_only=True)
class WorkerSettings:
    """The kernel's settings: the database, leases and the worker.

    Attributes:
        database_url: Postgres URL; ``None`` means the embedded server under ``home``.
        home: Where ``toren dev`` keeps its embedded database and records its URL.
        lease_seconds: How long a claim on an actor lasts without renewal.
        renew_seconds: How often a worker renews all of its leases (one statement).
        poll_seconds: Fallback poll for runnable actors when no notification arrives.
        grace_seconds: On SIGTERM, how long in-flight handling may take before it is cut.
        max_actors: How many actors one worker runs at once; it stops claiming at the cap.
        pool_size: Connections in the worker's pool (plus one dedicated lock connection), and
            in an API server's (``toren serve``; ``toren up`` and ``toren dev`` have both).
        commit_lanes: Steps (or batches of steps) a worker commits at once, each on a
            connection of its pool (2 by default; at most ``pool_size`` - 1, the rest serving
            the worker's claims, sends and reads). A step that finds a lane free commits at
            once; under load, steps wait for one and go together (group commit,
            :mod:`toren._core.group_commit`).
        commit_batch: The most steps committed in one batch (32 by default; 1: every step
            in a transaction of its own).
        worker_name: Shown by ``toren workers``; defaults to the host name.
        deploy_label: Optional label added to the code version (for example a git sha).
        actor_restart_intensity: Restarts of one actor (failed starts, dead-lettered messages)
            tolerated within ``actor_restart_period`` seconds; one more marks it failed.
        actor_restart_period: The window for ``actor_restart_intensity``, in seconds.
        dedupe_retention_seconds: How long a used dedupe key is remembered (7 days by default);
            a repeated send within that window is a no-op.
        snapshot_every: Events between two snapshots of an actor that keeps them (a run: its
            state, so activating it reads that and the events since); unset, each kind's own
            (runs: 1,000).
        archive_store: Where journals are archived before their rows are deleted
            (:mod:`toren._core.archive`): a directory (or ``file:///path``), or
            ``s3://bucket/prefix`` (endpoint from ``TOREN_S3_ENDPOINT_URL`` for MinIO, R2 and
            the like). Unset: ``HOME/archive``, which only this machine can read: use S3
            across machines.
        deadletter_keep_for: How long a dead letter is kept (inspectable, requeueable) after
            it died; then housekeeping archives it with its message to the archive store and
            deletes it (30 days by default; ``"30d"``-style or seconds).
        token_keep_for: How long an API token's row is kept after it was revoked or expired
            (30 days by default); then housekeeping deletes it and its console sessions.
        config_file: The TOML file these settings were read from, if any.
    """

    # The variables this class reads (setting -> variable, type); a subclass or mixin names only
    # its own, and :meth:`env` gathers them over the classes it is composed of.
    ENV: ClassVar[Env] = _KERNEL_ENV
    # The TOML tables this class parses (name -> how the "unknown table" hint shows it).
    TABLES: ClassVar[Mapping[str, str]] = {"worker": "[worker]"}

    database_url: str | None = None
    home: Path = attrs.field(factory=lambda: Path.home() / ".toren")
    lease_seconds: float = attrs.field(default=15.0, validator=positive)
    renew_seconds: float = attrs.field(default=5.0, validator=positive)
    poll_seconds: float = attrs.field(default=1.0, validator=positive)
    grace_seconds: float = attrs.field(default=30.0, validator=positive)
    max_actors: int = attrs.field(default=1000, validator=positive)
    pool_size: int = attrs.field(default=10, validator=positive)
    commit_lanes: int = attrs.field(default=2, validator=positive)
    commit_batch: int = attrs.field(default=32, validator=_batch_size)
    worker_name: str = attrs.field(factory=socket.gethostname)
    deploy_label: str | None = None
    actor_restart_intensity: int = attrs.field(default=5, validator=positive)
    actor_restart_period: float = attrs.field(default=60.0, validator=positive)
    dedupe_retention_seconds: float = attrs.field(
        default=7 * 86400.0, validator=[positive, lambda _, a, v: kept_for(a.name, v)]
    )
    snapshot_every: int | None = attrs.field(
        default=None, validator=attrs.validators.optional(positive)
    )
    archive_store: str | None = None
    deadletter_keep_for: float = attrs.field(default=30 * 86400.0, converter=_deadletter_keep_for)
    token_keep_for: float = attrs.field(default=30 * 86400.0, converter=_token_keep_for)
    config_file: Path | None = None

    def __attrs_post_init__(self) -> None:
        if self.renew_seconds >= self.lease_seconds:
            raise ConfigError(
                f"renew_seconds ({self.renew_seconds:g}) must be shorter than lease_seconds "
                f"({self.lease_seconds:g})",
                hint="A lease must be renewed before it expires; use about a third of the lease.",
            )

    @classmethod
    def env(cls) -> dict[str, tuple[str, type]]:
        """Every setting this class reads from a variable or a flat key, with its layers'."""
        found: dict[str, tuple[str, type]] = {}
        for klass in reversed(cls.__mro__):
            found.update(vars(klass).get("ENV", {}))
        return found

    @classmethod
    def tables(cls) -> dict[str, str]:
        """Every table this class parses, with its layers'."""
        found: dict[str, str] = {}
        for klass in reversed(cls.__mro__):
            found.update(vars(klass).get("TABLES", {}))
        return found

    @classmethod
    def parse_tables(cls, data: dict[str, Any], source: str) -> dict[str, Any]:
        """Take this layer's tables out of ``data`` (a TOML file's, read from ``source``) and
        return the settings they give. A layer with tables of its own overrides this and calls
        ``super()``; ``[worker]`` is read with the flat keys."""
        return {}

    @classmethod
    def load(
        cls, *, config_file: Path | None = None, env: dict[str, str] | None = None, **overrides: Any
    ) -> Self:
        """Build settings from the TOML file, the environment and ``overrides``.

        Raises:
            ConfigError: a value has the wrong type, a key is unknown, or the file is not TOML.
        """
        env = dict(os.environ) if env is None else env
        values: dict[str, Any] = {}
        path = config_file or (Path(env["TOREN_CONFIG"]) if "TOREN_CONFIG" in env else None)
        if path is None and Path("toren.toml").is_file():
            path = Path("toren.toml")
        if path is not None:
            values.update(cls._read_toml(path))
            values["config_file"] = path
        for name, (var, typ) in cls.env().items():
            if env.get(var):
                values[name] = _convert(name, _origin(var, env), typ, env[var])
        values.update({k: v for k, v in overrides.items() if v is not None})
        try:
            return cls(**values)
        except TypeError as exc:
            raise ConfigError(f"invalid settings: {exc}") from None

    @classmethod
    def _read_toml(cls, path: Path) -> dict[str, Any]:
        try:
            data = tomllib.loads(path.read_text())
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise ConfigError(f"cannot read config file {path}: {exc}") from None
        tabled = cls.parse_tables(data, str(path))
        known = cls.tables()
        tables = sorted(k for k, v in data.items() if isinstance(v, dict) and k not in known)
        if tables:
            raise ConfigError(
                f"unknown table(s) in {path}: {', '.join(f'[{t}]' for t in tables)}",
                hint=f"Known tables: {' and '.join(known.values())}.",
            )
        flat = {k: v for k, v in data.items() if not isinstance(v, dict)}
        flat.update(data.get("worker", {}))
        spec = cls.env()
        unknown = sorted(set(flat) - set(spec))
        if unknown:
            raise ConfigError(
                f"unknown setting(s) in {path}: {', '.join(unknown)}",
                hint=f"Known settings: {', '.join(sorted(spec))}.",
            )
        values = {name: _convert(name, str(path), spec[name][1], v) for name, v in flat.items()}
        values.update(tabled)
        return values


def _origin(var: str, env: Mapping[str, str]) -> str:
    """Where ``var``'s value came from: the variable, or its ``X_FILE`` and the file's path
    (:func:`toren._core.secret_files.read_secret_files` has copied the file's content into
    ``var``)."""
    path = env.get(var + SUFFIX)
    return f"{var}{SUFFIX} ({path})" if path else var


def _convert(name: str, source: str, typ: type, raw: Any) -> Any:
    """``raw`` (from ``source``: a variable, a file) as a ``typ``.

    Raises:
        ConfigError: it is not one; the message names the setting and ``source`` and says what
            form was expected, never what ``raw`` holds.
    """
    if typ is bool:
        if isinstance(raw, bool):
            return raw
        if str(raw).lower() in ("1", "true", "yes", "on", "0", "false", "no", "off"):
            return str(raw).lower() in ("1", "true", "yes", "on")
    elif typ is tuple:
        listed = raw if isinstance(raw, list | tuple) else str(raw)
        return networks(listed, f"{name} from {source}")
    else:
        try:
            return typ(raw)
        except (TypeError, ValueError):
            pass
    raise ConfigError(f"{name} from {source} must be {_EXPECTED[typ]}", hint=_NOT_SHOWN)


def archive_store_url(settings: WorkerSettings) -> str:
    """Where journals are archived: ``archive_store`` (``TOREN_ARCHIVE_STORE``), by default a
    directory under Toren's home (readable on this machine only: use S3 across machines)."""
    return settings.archive_store or str(settings.home / "archive")
