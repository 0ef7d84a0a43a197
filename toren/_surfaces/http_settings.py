"""The HTTP surface's settings: the console's cookies and address, proxies, streams, sign-ins."""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

import attrs

from toren._core.config import Env, http_url, networks, positive


@attrs.frozen(kw_only=True, slots=False)  # one of several bases of toren.Settings
class HttpSettings:
    """Settings of the API server and the console.

    Attributes:
        secure_cookies: Whether the console's session cookie is ``Secure``; unset, it is when
            the request came over TLS (set it true behind a proxy that terminates TLS).
        trusted_proxies: Addresses (or networks) of reverse proxies whose
            ``X-Forwarded-For`` names the client (for the failed-sign-in limit and the access
            log); from anyone else the header is ignored.
        streams_max: Event streams one API server process keeps open at once (429 past it);
            per process, so N processes (``--workers N``) hold up to N times it.
        streams_per_token: Event streams one token (or session) may hold open per process
            (summed over processes, as ``streams_max``).
        stream_idle_seconds: An event stream with no new event for this long is closed (the
            client reconnects with ``Last-Event-ID``).
        failed_auth_per_minute: Failed sign-ins (bad bearer tokens, console sign-ins) one
            client address may make per minute before it gets 429s, counted in Postgres
            across every API server process on the database.
        console_url: The console's address as people open it (``https://toren.example.com``),
            for the links the CLI prints beside a run; unset, the CLI links to the console of
            the running ``toren dev`` whose database it uses, if any.
    """

    ENV: ClassVar[Env] = {
        "secure_cookies": ("TOREN_SECURE_COOKIES", bool),
        "trusted_proxies": ("TOREN_TRUSTED_PROXIES", tuple),
        "streams_max": ("TOREN_STREAMS_MAX", int),
        "streams_per_token": ("TOREN_STREAMS_PER_TOKEN", int),
        "stream_idle_seconds": ("TOREN_STREAM_IDLE_SECONDS", float),
        "failed_auth_per_minute": ("TOREN_FAILED_AUTH_PER_MINUTE", int),
        "console_url": ("TOREN_CONSOLE_URL", str),
    }
    TABLES: ClassVar[Mapping[str, str]] = {}

    secure_cookies: bool | None = None
    trusted_proxies: tuple[str, ...] = attrs.field(default=(), converter=networks)
    streams_max: int = attrs.field(default=100, validator=positive)
    streams_per_token: int = attrs.field(default=10, validator=positive)
    stream_idle_seconds: float = attrs.field(default=300.0, validator=positive)
    failed_auth_per_minute: int = attrs.field(default=20, validator=positive)
    console_url: str | None = attrs.field(default=None, validator=http_url)
