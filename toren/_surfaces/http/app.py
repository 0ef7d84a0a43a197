"""The aiohttp application: middlewares (access log and metrics, problems, authentication and
scopes) and routes.

Every API route needs a bearer token (``Authorization: Bearer trn_...``) or a console session
cookie, and the scope its route asks for: ``read`` for reads, ``operate`` to start, send and
cancel, ``approve`` to decide. ``/healthz`` answers anyone (worker details only to a caller
who authenticates), and so does ``/readyz``; the console's static page and its sign-in form
need nothing (they hold no data); Telegram's webhook (``POST /telegram/{bot}``) is checked by
its bot's secret instead (:mod:`toren._surfaces.http.channels`); each kind says what its routes
ask as it installs them (:class:`~toren._surfaces.http.common.RouteAccess`). Writes made with a
session cookie must carry the session's CSRF token in ``X-CSRF-Token`` and, if the browser sends
an ``Origin``, come from this origin.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import orjson
import pydantic
from aiohttp import web

from toren._core.archive_reader import ArchivesAt
from toren._core.client import Client
from toren._core.surfaces import Surfaces, resolved
from toren._surfaces.http import console, metrics, readiness
from toren._surfaces.http.access import AccessLog
from toren._surfaces.http.auth import TOKENS, authenticate
from toren._surfaces.http.common import (
    ACCESS,
    CLIENT,
    OPTIONS,
    ROUTE_ACCESS,
    ProblemError,
    RouteAccess,
    ServerOptions,
    client_address,
    problem_response,
    require,
)
from toren._surfaces.http.console import page_headers
from toren._surfaces.http.guard import FAILED_AUTH, FailedAuth
from toren._surfaces.http.models import FieldError, Problem
from toren._surfaces.http.openapi import API_PARTS, document
from toren._surfaces.kinds import SURFACES
from toren._surfaces.tokens import TokenCache

log = logging.getLogger("toren.http")
ACCESS_LOG: web.AppKey[AccessLog] = web.AppKey("access_log", AccessLog)

MAX_BODY = 256 * 1024


def body_limit(message_cap: int) -> int:
    """The largest request body: room for a message at its cap even if every character of it
    is escaped in JSON (``\\u0000`` is six bytes)."""
    return max(MAX_BODY, 6 * message_cap + 64 * 1024)


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

_OPEN = {("GET", "/"), ("POST", "/session"), ("GET", "/favicon.ico"), ("GET", "/readyz")}
_OPTIONAL = {("GET", "/healthz")}  # anyone; worker details only to an authenticated caller
_ANY_SCOPE = {("GET", "/session"), ("DELETE", "/session")}
_SAFE = {"GET", "HEAD", "OPTIONS"}


@web.middleware
async def problems(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every error is a problem document; nothing a client sends makes a 500."""
    try:
        return await handler(request)
    except ProblemError as exc:
        headers = dict(exc.headers)
        if exc.problem.status == 401:
            headers["WWW-Authenticate"] = "Bearer"
        return problem_response(exc.problem, headers)
    except pydantic.ValidationError as exc:
        errors = [
            FieldError(field=".".join(str(p) for p in e["loc"]) or "body", message=e["msg"])
            for e in exc.errors(include_url=False)
        ]
        detail = "; ".join(f"{e.field}: {e.message}" for e in errors)
        return problem_response(
            Problem(title="Invalid request", status=422, detail=detail, errors=errors)
        )
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        title = exc.reason or "Error"
        detail = exc.text if exc.text and not exc.text.startswith(str(exc.status)) else title
        if exc.status == 413:
            limit = body_limit(request.app[OPTIONS].message_cap)
            detail = f"the request body is larger than {limit} bytes"
        keep = {k: v for k, v in exc.headers.items() if k.lower() in ("allow", "retry-after")}
        return problem_response(Problem(title=title, status=exc.status, detail=detail), keep)
    except Exception:
        log.exception("%s %s failed", request.method, request.path)
        return problem_response(
            Problem(title="Internal error", status=500, detail="the server failed; see its log")
        )


@web.middleware
async def authentication(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Who the caller is (401 if no one), and whether the route's scope allows it (403)."""
    key = (request.method, request.path)
    asks = request.app[ROUTE_ACCESS]  # what the kinds' routes ask, as they installed them
    if (
        key in _OPEN
        or request.path.startswith("/static/")
        or any(own_check(request) for own_check in asks.own_check)
    ):
        return await handler(request)
    caller = await authenticate(request, optional=key in _OPTIONAL)
    if caller is None:
        return await handler(request)
    request[ACCESS] = caller
    resource = request.match_info.route.resource
    route = (request.method, resource.canonical) if resource is not None else None
    if route is not None and key not in _ANY_SCOPE:
        default = "read" if request.method in _SAFE else "operate"
        require(request, asks.scopes.get(route, default))
    return await handler(request)


@web.middleware
async def observed(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Metrics and the access log (:mod:`toren._surfaces.http.access`): method, path (never the
    query), status, client address, principal and latency; never a token or a cookie."""
    started = time.perf_counter()
    status = 500
    try:
        response = await handler(request)
        status = response.status
        return response
    except web.HTTPException as exc:  # a redirect raised by a handler (sign-in)
        status = exc.status
        raise
    finally:
        seconds = time.perf_counter() - started
        route = request.match_info.route.resource
        name = route.canonical if route is not None else "unmatched"
        metrics.observe(request.app, request.method, name, status, seconds)
        caller = request.get(ACCESS)
        request.app[ACCESS_LOG].add(
            request.method,
            request.rel_url.raw_path[:500],
            status,
            client_address(request),
            f"{caller.principal.kind}:{caller.principal.id}" if caller else "-",
            seconds,
        )


async def _headers(request: web.Request, response: web.StreamResponse) -> None:
    """API answers hold run data: never cached. The console's files carry the page's own
    protections however they are reached (``/static/index.html`` is the page too)."""
    if not request.path.startswith("/static/"):
        response.headers.setdefault("Cache-Control", "no-store")
        return
    for name, value in page_headers().items():
        if name != "Cache-Control":
            response.headers.setdefault(name, value)


def create_app(
    client: Client,
    options: ServerOptions | None = None,
    *,
    worker: readiness.WorkerProbe | None = None,
    kinds: Sequence[Surfaces] = SURFACES,
) -> web.Application:
    """The API, the OpenAPI document and the console, over ``client``'s database; ``worker``
    reports the worker this process runs too (``toren up``), for ``/readyz``; ``kinds`` are
    the kinds whose routes it serves (Toren's own unless told: ``/runs``, ``/channels``)."""
    options = options or ServerOptions()
    app = web.Application(
        middlewares=[observed, problems, authentication],
        client_max_size=body_limit(options.message_cap),
    )
    if client.archives is None and options.archive_store:
        # a long conversation whose snapshot does not cover its archived events is read there
        client.archives = ArchivesAt(options.archive_store)
    app[CLIENT] = client
    app[OPTIONS] = options
    app[TOKENS] = TokenCache()
    app[FAILED_AUTH] = FailedAuth(client.pool, "http", options.failed_auth_per_minute)
    app[ACCESS_LOG] = AccessLog()
    app[ROUTE_ACCESS] = RouteAccess()
    app[API_PARTS] = []
    app.on_cleanup.append(_flush_access_log)
    app.on_response_prepare.append(_headers)
    metrics.install(app)
    readiness.install(app, worker)
    for install in resolved(kinds, "http"):
        install(app)
    console.install(app)

    @functools.cache
    def openapi() -> dict[str, Any]:  # built at the first request: every kind's part is in
        return document(app[API_PARTS])

    async def serve_openapi(request: web.Request) -> web.Response:
        return web.json_response(openapi(), dumps=lambda v: orjson.dumps(v).decode())

    app.router.add_get("/openapi.json", serve_openapi)
    return app


async def _flush_access_log(app: web.Application) -> None:
    app[ACCESS_LOG].flush()
