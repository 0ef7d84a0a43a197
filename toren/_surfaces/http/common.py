"""What the HTTP modules share: the app keys, problems, body parsing, path parameters."""

from __future__ import annotations

import functools
import ipaddress
import json as stdjson
import uuid
from collections.abc import Callable, Mapping
from typing import TypeVar

import attrs
import orjson
import pydantic
from aiohttp import web
from pydantic_core import PydanticSerializationError

from toren._agent.principal import Principal
from toren._core.client import Client
from toren._core.config import archive_store_url
from toren._settings import Settings
from toren._surfaces.http.models import FieldError, Problem
from toren._surfaces.tokens import Access


@attrs.frozen(kw_only=True)
class ServerOptions:
    """What an API server process is configured with (see :class:`~toren.Settings`)."""

    message_cap: int = 64 * 1024
    secure_cookies: bool | None = None
    trusted_proxies: tuple[str, ...] = ()
    streams_max: int = 100
    streams_per_token: int = 10
    stream_idle_seconds: float = 300.0
    stream_recheck_seconds: float = 2.0
    failed_auth_per_minute: int = 20
    pool_size: int = 10
    archive_store: str | None = None  # where pruned runs' journals are read (GET .../archive)
    metrics_dir: str | None = None
    """The directory of ``prometheus_client``'s multiprocess mode, when this process is one of
    several serving one port (``toren serve --workers N``): ``/metrics`` then counts requests
    of them all. Its ``PROMETHEUS_MULTIPROC_DIR`` must name it before ``prometheus_client`` is
    imported."""

    @classmethod
    def of(cls, settings: Settings) -> ServerOptions:
        return cls(
            message_cap=settings.max_message_bytes,
            secure_cookies=settings.secure_cookies,
            trusted_proxies=settings.trusted_proxies,
            streams_max=settings.streams_max,
            streams_per_token=settings.streams_per_token,
            stream_idle_seconds=settings.stream_idle_seconds,
            failed_auth_per_minute=settings.failed_auth_per_minute,
            pool_size=settings.pool_size,
            archive_store=archive_store_url(settings),
        )


@attrs.define
class RouteAccess:
    """What the kinds' routes ask of a caller besides the rule (a token or session with the
    ``read`` scope for reads, ``operate`` for writes): each kind adds its own as it installs
    its routes.

    Attributes:
        scopes: The scope a route asks for instead, by ``(method, canonical path)``.
        own_check: Requests that reach their handler unauthenticated, each kind's test of
            them: the handler checks them itself (Telegram's webhook, by its bot's secret).
    """

    scopes: dict[tuple[str, str], str] = attrs.Factory(dict)
    own_check: list[Callable[[web.Request], bool]] = attrs.Factory(list)

    def ask(self, scopes: Mapping[tuple[str, str], str]) -> None:
        """Have these routes ask for these scopes.

        Raises:
            ValueError: another kind has a route ask for another scope already (a kind's
                routes cannot loosen another's).
        """
        for route, scope in scopes.items():
            if self.scopes.setdefault(route, scope) != scope:
                raise ValueError(f"{route} already asks for {self.scopes[route]!r}, not {scope!r}")


CLIENT: web.AppKey[Client] = web.AppKey("client", Client)
OPTIONS: web.AppKey[ServerOptions] = web.AppKey("options", ServerOptions)
ROUTE_ACCESS: web.AppKey[RouteAccess] = web.AppKey("route_access", RouteAccess)
ACCESS: web.RequestKey[Access] = web.RequestKey("access", Access)
M = TypeVar("M", bound=pydantic.BaseModel)


class ProblemError(Exception):
    """Raised by handlers: answered as an RFC 9457 problem document."""

    def __init__(
        self,
        status: int,
        title: str,
        detail: str,
        errors: list[FieldError] | None = None,
        *,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(detail)
        self.problem = Problem(title=title, status=status, detail=detail, errors=errors or [])
        self.headers = headers or {}


def problem_response(problem: Problem, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(
        body=to_json(problem),
        status=problem.status,
        content_type="application/problem+json",
        headers=headers,
    )


def to_json(model: pydantic.BaseModel) -> str:
    """``model`` as JSON text, also when it holds lone surrogates (untrusted text from runs):
    those are written as ``\\uXXXX`` escapes, which JSON allows."""
    try:
        return model.model_dump_json()
    except PydanticSerializationError:
        return stdjson.dumps(model.model_dump(mode="python"), default=str, ensure_ascii=True)


def json(model: pydantic.BaseModel, status: int = 200) -> web.Response:
    return web.Response(body=to_json(model), status=status, content_type="application/json")


async def read_body(request: web.Request, model: type[M]) -> M:
    """The JSON body as ``model``; an empty body is ``{}``.

    Raises:
        ProblemError: 400 if it is not JSON; pydantic's ValidationError (a 422) if it does not fit.
    """
    raw = await request.read()
    try:
        data = orjson.loads(raw) if raw.strip() else {}
    except orjson.JSONDecodeError as exc:
        raise ProblemError(
            400,
            "Malformed body",
            f"the body is not JSON: {exc}",
            [FieldError(field="body", message="not JSON")],
        ) from exc
    if not isinstance(data, dict):
        raise ProblemError(
            422,
            "Invalid request",
            "the body must be a JSON object",
            [FieldError(field="body", message="not an object")],
        )
    return model.model_validate(data)


def access(request: web.Request) -> Access:
    """The authenticated caller of a request that passed authentication."""
    return request[ACCESS]


def principal(request: web.Request) -> Principal:
    return request[ACCESS].principal


def require(request: web.Request, scope: str, agent: str | None = None) -> None:
    """Refuse (403) a caller without ``scope``, or limited to other agents than ``agent``.

    Raises:
        ProblemError: 403, naming what is missing.
    """
    caller = access(request)
    if not caller.allows(scope):
        have = ", ".join(sorted(caller.scopes))
        raise ProblemError(
            403, "Forbidden", f"this token lacks the {scope!r} scope (it has: {have})"
        )
    if agent is not None and not caller.may_write(agent):
        raise ProblemError(403, "Forbidden", f"this token may not act on runs of agent {agent!r}")


ADDRESS: web.RequestKey[str] = web.RequestKey("address", str)


@functools.cache
def _networks(proxies: tuple[str, ...]) -> list[ipaddress.IPv4Network | ipaddress.IPv6Network]:
    return [ipaddress.ip_network(n) for n in proxies]


def client_address(request: web.Request) -> str:
    """The client's address (worked out once per request): the peer's, or, when the peer is a
    trusted proxy, the nearest address in ``X-Forwarded-For`` that is not a trusted proxy."""
    if ADDRESS not in request:
        request[ADDRESS] = _client_address(request)
    return request[ADDRESS]


def _client_address(request: web.Request) -> str:
    peer = request.remote or "?"
    trusted = _networks(request.app[OPTIONS].trusted_proxies)

    def is_proxy(address: str) -> bool:
        try:
            ip = ipaddress.ip_address(address)
        except ValueError:
            return False
        return any(ip in network for network in trusted)

    if not trusted or not is_proxy(peer):
        return peer
    hops = [h.strip() for h in request.headers.get("X-Forwarded-For", "").split(",")]
    for hop in reversed([h for h in hops if h]):
        if not is_proxy(hop):
            return hop[:64]
    return peer


def run_id(request: web.Request) -> str:
    """``run/<uuid>`` from the path's ``{run}``; a malformed one is an unknown run (404)."""
    raw = request.match_info["run"]
    try:
        return f"run/{uuid.UUID(raw)}"
    except ValueError as exc:
        raise ProblemError(404, "Not found", f"no run {raw!r}") from exc
