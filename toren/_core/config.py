"""Settings: what is not code. Read from ``toren.toml`` (or ``TOREN_CONFIG``) and ``TOREN_*``.

Precedence, lowest first: defaults, the TOML file, environment variables, explicit overrides
(command-line options). Invalid values raise :class:`~toren.ConfigError` naming the setting.

Per-agent settings come from the file only (``[agents.NAME]`` tables, no environment variables):
they replace values given in ``Agent(...)`` key by key, when the app's agents are registered
(see :mod:`toren._agent.tables`).
"""

from __future__ import annotations

import ipaddress
import math
import os
import socket
import tomllib
import types
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import attrs

from toren._core.errors import ConfigError
from toren._core.secret_files import SUFFIX

if TYPE_CHECKING:
    from toren._agent.tables import Tables

# Setting name -> (environment variable, type). The TOML file uses the setting names as keys,
# at top level or under [worker].
_ENV: dict[str, tuple[str, type]] = {
    "database_url": ("TOREN_DATABASE_URL", str),
    "home": ("TOREN_HOME", Path),
    "lease_seconds": ("TOREN_LEASE_SECONDS", float),
    "renew_seconds": ("TOREN_RENEW_SECONDS", float),
    "poll_seconds": ("TOREN_POLL_SECONDS", float),
    "grace_seconds": ("TOREN_GRACE_SECONDS", float),
    "max_actors": ("TOREN_MAX_ACTORS", int),
    "pool_size": ("TOREN_POOL_SIZE", int),
    "worker_name": ("TOREN_WORKER_NAME", str),
    "deploy_label": ("TOREN_DEPLOY_LABEL", str),
    "actor_restart_intensity": ("TOREN_ACTOR_RESTART_INTENSITY", int),
    "actor_restart_period": ("TOREN_ACTOR_RESTART_PERIOD", float),
    "dedupe_retention_seconds": ("TOREN_DEDUPE_RETENTION_SECONDS", float),
    "max_message_bytes": ("TOREN_MAX_MESSAGE_BYTES", int),
    "secure_cookies": ("TOREN_SECURE_COOKIES", bool),
    "trusted_proxies": ("TOREN_TRUSTED_PROXIES", tuple),
    "streams_max": ("TOREN_STREAMS_MAX", int),
    "streams_per_token": ("TOREN_STREAMS_PER_TOKEN", int),
    "stream_idle_seconds": ("TOREN_STREAM_IDLE_SECONDS", float),
    "snapshot_every": ("TOREN_SNAPSHOT_EVERY", int),
    "failed_auth_per_minute": ("TOREN_FAILED_AUTH_PER_MINUTE", int),
    "sandboxes": ("TOREN_SANDBOXES", bool),
    "workspace_store": ("TOREN_WORKSPACE_STORE", str),
    "sandbox_reap_seconds": ("TOREN_SANDBOX_REAP_SECONDS", float),
    "telegram_api_url": ("TOREN_TELEGRAM_API_URL", str),
    "console_url": ("TOREN_CONSOLE_URL", str),
}

_TABLES = {"worker"}  # and [agents.NAME], read by toren._agent.tables

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


def _positive(inst: Settings, attribute: attrs.Attribute[Any], value: float) -> None:
    if not (value > 0 and math.isfinite(value)):  # NaN compares false both ways
        raise ConfigError(f"{attribute.name} must be a positive finite number, got {value!r}")


def _http_url(inst: Settings, attribute: attrs.Attribute[Any], value: str | None) -> None:
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


def _networks(value: Any, where: str = "trusted_proxies") -> tuple[str, ...]:
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


def _frozen_tables(value: Mapping[str, Mapping[str, Any]]) -> Tables:
    return types.MappingProxyType(
        {name: types.MappingProxyType(dict(table)) for name, table in value.items()}
    )


@attrs.frozen(kw_only=True)
class Settings:
    """Runtime settings of a worker or a client.

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
        worker_name: Shown by ``toren workers``; defaults to the host name.
        deploy_label: Optional label added to the code version (for example a git sha).
        actor_restart_intensity: Restarts of one actor (failed starts, dead-lettered messages)
            tolerated within ``actor_restart_period`` seconds; one more marks it failed.
        actor_restart_period: The window for ``actor_restart_intensity``, in seconds.
        dedupe_retention_seconds: How long a used dedupe key is remembered (7 days by default);
            a repeated send within that window is a no-op.
        max_message_bytes: The largest human message or run input (UTF-8 bytes) the API, the
            CLI and the MCP server accept (64 KiB by default); a longer one is refused, never
            truncated.
        secure_cookies: Whether the console's session cookie is ``Secure``; unset, it is when
            the request came over TLS (set it true behind a proxy that terminates TLS).
        trusted_proxies: Addresses (or networks) of reverse proxies whose
            ``X-Forwarded-For`` names the client (for the failed-sign-in limit and the access
            log); from anyone else the header is ignored.
        streams_max: Event streams one API server process keeps open at once (429 past it).
        streams_per_token: Event streams one token (or session) may hold open per process.
        stream_idle_seconds: An event stream with no new event for this long is closed (the
            client reconnects with ``Last-Event-ID``).
        failed_auth_per_minute: Failed sign-ins (bad bearer tokens, console sign-ins) one
            client address may make per minute before it gets 429s.
        snapshot_every: Events between two snapshots of an actor that keeps them (a run: its
            state, so activating it reads that and the events since); unset, each kind's own
            (runs: 1,000).
        sandboxes: Whether this worker runs sandboxes when Docker answers (default true);
            false keeps it from serving them even where Docker is.
        workspace_store: Where sandbox workspaces are checkpointed: a directory (or
            ``file:///path``), or ``s3://bucket/prefix`` (endpoint from
            ``TOREN_S3_ENDPOINT_URL`` for MinIO, R2 and the like). Unset: ``HOME/workspaces``,
            which only workers on this machine can read: use S3 across machines.
        sandbox_reap_seconds: How often a worker with Docker looks for sandbox containers
            whose run has ended, and removes them.
        telegram_api_url: The Bot API's address (default ``https://api.telegram.org``): a
            self-hosted Bot API server, or a local test server.
        console_url: The console's address as people open it (``https://toren.example.com``),
            for the links the CLI prints beside a run; unset, the CLI links to the console of
            the running ``toren dev`` whose database it uses, if any.
        agents: The ``[agents.NAME]`` tables of the file, by agent name: values that replace
            those given in ``Agent(...)`` when the app's agents are registered (read-only).
        config_file: The TOML file these settings were read from, if any.
    """

    database_url: str | None = None
    home: Path = attrs.field(factory=lambda: Path.home() / ".toren")
    lease_seconds: float = attrs.field(default=15.0, validator=_positive)
    renew_seconds: float = attrs.field(default=5.0, validator=_positive)
    poll_seconds: float = attrs.field(default=1.0, validator=_positive)
    grace_seconds: float = attrs.field(default=30.0, validator=_positive)
    max_actors: int = attrs.field(default=1000, validator=_positive)
    pool_size: int = attrs.field(default=10, validator=_positive)
    worker_name: str = attrs.field(factory=socket.gethostname)
    deploy_label: str | None = None
    actor_restart_intensity: int = attrs.field(default=5, validator=_positive)
    actor_restart_period: float = attrs.field(default=60.0, validator=_positive)
    dedupe_retention_seconds: float = attrs.field(default=7 * 86400.0, validator=_positive)
    max_message_bytes: int = attrs.field(default=64 * 1024, validator=_positive)
    secure_cookies: bool | None = None
    trusted_proxies: tuple[str, ...] = attrs.field(default=(), converter=_networks)
    streams_max: int = attrs.field(default=100, validator=_positive)
    streams_per_token: int = attrs.field(default=10, validator=_positive)
    stream_idle_seconds: float = attrs.field(default=300.0, validator=_positive)
    failed_auth_per_minute: int = attrs.field(default=20, validator=_positive)
    snapshot_every: int | None = attrs.field(
        default=None, validator=attrs.validators.optional(_positive)
    )
    sandboxes: bool = True
    workspace_store: str | None = None
    sandbox_reap_seconds: float = attrs.field(default=30.0, validator=_positive)
    telegram_api_url: str | None = None
    console_url: str | None = attrs.field(default=None, validator=_http_url)
    agents: Tables = attrs.field(
        factory=lambda: types.MappingProxyType({}), converter=_frozen_tables, hash=False
    )
    config_file: Path | None = None

    def __attrs_post_init__(self) -> None:
        if self.renew_seconds >= self.lease_seconds:
            raise ConfigError(
                f"renew_seconds ({self.renew_seconds:g}) must be shorter than lease_seconds "
                f"({self.lease_seconds:g})",
                hint="A lease must be renewed before it expires; use about a third of the lease.",
            )

    @classmethod
    def load(
        cls, *, config_file: Path | None = None, env: dict[str, str] | None = None, **overrides: Any
    ) -> Settings:
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
            values.update(_read_toml(path))
            values["config_file"] = path
        for name, (var, typ) in _ENV.items():
            if env.get(var):
                values[name] = _convert(name, _origin(var, env), typ, env[var])
        values.update({k: v for k, v in overrides.items() if v is not None})
        try:
            return cls(**values)
        except TypeError as exc:
            raise ConfigError(f"invalid settings: {exc}") from None


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"cannot read config file {path}: {exc}") from None
    agents = None
    if "agents" in data:
        # Here, not at the top: checking the tables needs the agent layer (and pydantic), which
        # a settings file without them (and every CLI command reading one) does without.
        from toren._agent.tables import read_agent_tables

        agents = read_agent_tables(data.pop("agents"), str(path))
    tables = sorted(k for k, v in data.items() if isinstance(v, dict) and k not in _TABLES)
    if tables:
        raise ConfigError(
            f"unknown table(s) in {path}: {', '.join(f'[{t}]' for t in tables)}",
            hint="Known tables: [worker] and [agents.NAME] (one per agent).",
        )
    flat = {k: v for k, v in data.items() if not isinstance(v, dict)}
    flat.update(data.get("worker", {}))
    unknown = sorted(set(flat) - set(_ENV))
    if unknown:
        raise ConfigError(
            f"unknown setting(s) in {path}: {', '.join(unknown)}",
            hint=f"Known settings: {', '.join(sorted(_ENV))}.",
        )
    values = {name: _convert(name, str(path), _ENV[name][1], v) for name, v in flat.items()}
    if agents is not None:
        values["agents"] = agents
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
        return _networks(listed, f"{name} from {source}")
    else:
        try:
            return typ(raw)
        except (TypeError, ValueError):
            pass
    raise ConfigError(f"{name} from {source} must be {_EXPECTED[typ]}", hint=_NOT_SHOWN)
