"""The aiohttp application: middlewares (problems, authentication, CSRF, metrics) and routes.

Every API route needs a bearer token (``Authorization: Bearer trn_...``) or a console session
cookie; ``/healthz`` needs nothing, and neither do the console's static page and its sign-in
form (they hold no data). Writes made with a session cookie must carry the session's CSRF token
in ``X-CSRF-Token`` and, if the browser sends an ``Origin``, come from this origin.
"""

from __future__ import annotations

import hmac
import logging
import time
from collections.abc import Awaitable, Callable
from urllib.parse import urlsplit

import orjson
import pydantic
from aiohttp import web

from toren._client import Client
from toren._http import console, metrics, runs
from toren._http.common import (
    CLIENT,
    MESSAGE_CAP_KEY,
    PRINCIPAL,
    ProblemError,
    problem_response,
)
from toren._http.console import SESSION_COOKIE
from toren._http.models import FieldError, Problem
from toren._http.openapi import document
from toren._tokens import Principal, TokenCache, session_principal
from toren.runs import MESSAGE_CAP

log = logging.getLogger("toren.http")

MAX_BODY = 256 * 1024


def body_limit(message_cap: int) -> int:
    """The largest request body: room for a message at its cap even if every character of it
    is escaped in JSON (``\\u0000`` is six bytes)."""
    return max(MAX_BODY, 6 * message_cap + 64 * 1024)


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

TOKENS: web.AppKey[TokenCache] = web.AppKey("tokens", TokenCache)

_OPEN = {("GET", "/healthz"), ("GET", "/"), ("POST", "/session"), ("GET", "/favicon.ico")}
_SAFE = {"GET", "HEAD", "OPTIONS"}


@web.middleware
async def problems(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every error is a problem document; nothing a client sends makes a 500."""
    try:
        return await handler(request)
    except ProblemError as exc:
        challenge = {"WWW-Authenticate": "Bearer"} if exc.problem.status == 401 else None
        return problem_response(exc.problem, challenge)
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
            limit = body_limit(request.app[MESSAGE_CAP_KEY])
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
    if (request.method, request.path) in _OPEN or request.path.startswith("/static/"):
        return await handler(request)
    pool = request.app[CLIENT].pool
    principal: Principal | None = None
    header = request.headers.get("Authorization", "")
    if header:
        scheme, _, token = header.partition(" ")
        if scheme.lower() == "bearer" and token:
            principal = await request.app[TOKENS].authenticate(pool, token.strip())
        if principal is None:
            raise _unauthorized("the bearer token is malformed, unknown or revoked")
    else:
        cookie = request.cookies.get(SESSION_COOKIE)
        if cookie:
            principal = await session_principal(pool, cookie)
        if principal is None:
            raise _unauthorized("send Authorization: Bearer <token> (see `toren tokens create`)")
        if request.method not in _SAFE:
            _check_csrf(request, principal)
    request[PRINCIPAL] = principal
    return await handler(request)


def _unauthorized(detail: str) -> ProblemError:
    return ProblemError(401, "Unauthorized", detail)


def same_origin(request: web.Request) -> bool:
    """Whether the browser's ``Origin`` (if it sent one) is this server. The host is compared,
    not the scheme: behind a proxy that terminates TLS the server itself sees plain HTTP."""
    origin = request.headers.get("Origin")
    return origin is None or urlsplit(origin).netloc == request.host


def _check_csrf(request: web.Request, principal: Principal) -> None:
    if not same_origin(request):
        origin = request.headers.get("Origin")
        raise ProblemError(403, "Forbidden", f"cross-origin write from {origin} refused")
    sent = request.headers.get("X-CSRF-Token", "")
    if not principal.csrf or not hmac.compare_digest(sent.encode(), principal.csrf.encode()):
        raise ProblemError(403, "Forbidden", "a write from the console needs its CSRF token")


@web.middleware
async def measured(request: web.Request, handler: Handler) -> web.StreamResponse:
    started = time.perf_counter()
    status = 500
    try:
        response = await handler(request)
        status = response.status
        return response
    finally:
        route = request.match_info.route.resource
        name = route.canonical if route is not None else "unmatched"
        metrics.observe(request.app, request.method, name, status, time.perf_counter() - started)


def create_app(client: Client, *, message_cap: int = MESSAGE_CAP) -> web.Application:
    """The API, the OpenAPI document and the console, over ``client``'s database; a message
    or run input over ``message_cap`` bytes is refused with a 413."""
    app = web.Application(
        middlewares=[measured, problems, authentication], client_max_size=body_limit(message_cap)
    )
    app[CLIENT] = client
    app[MESSAGE_CAP_KEY] = message_cap
    app[TOKENS] = TokenCache()
    metrics.install(app)
    runs.install(app)
    console.install(app)
    app.router.add_get("/openapi.json", _openapi)
    return app


async def _openapi(request: web.Request) -> web.Response:
    return web.json_response(document(), dumps=lambda v: orjson.dumps(v).decode())
