"""Who a request comes from: a bearer token or a console session, with CSRF checks for the
console's writes and failed attempts limited per client address."""

from __future__ import annotations

import hmac
from urllib.parse import urlsplit

from aiohttp import web

from toren._surfaces.http.common import CLIENT, ProblemError, client_address
from toren._surfaces.http.guard import FAILED_AUTH
from toren._surfaces.tokens import Access, TokenCache, session_access

SESSION_COOKIE = "toren_session"
TOKENS: web.AppKey[TokenCache] = web.AppKey("tokens", TokenCache)
_SAFE = {"GET", "HEAD", "OPTIONS"}


async def authenticate(request: web.Request, *, optional: bool) -> Access | None:
    """The caller's access from a bearer token or a session cookie. Failures are counted per
    client address; past the limit the address gets 429s until its window moves on.

    Raises:
        ProblemError: 401 (no valid credentials, unless ``optional``), 403 (a console write
            without its CSRF token or from another origin), 429 (too many failures).
    """
    failed = request.app[FAILED_AUTH]
    tokens = request.app[TOKENS]
    address = client_address(request)
    pool = request.app[CLIENT].pool
    token = bearer(request)
    cookie = request.cookies.get(SESSION_COOKIE)
    caller: Access | None = None
    # While an address is blocked, only a token this server saw pass lately, or a session
    # cookie (256 random bits: nobody guesses one), is still checked; anything else waits. Any
    # other token is an attempt, counted as a failure before it is checked (one statement: the
    # counts are shared by every server process) and uncounted if it passes; a credential that
    # passes costs nothing here.
    retry_after: int | None = None
    counted = False
    if token is not None:
        if tokens.known(token):
            caller = await tokens.authenticate(pool, token, via="http")
        else:
            attempt = await failed.attempt(address)
            retry_after, counted = attempt.retry_after, True
            if retry_after is None:
                caller = await tokens.authenticate(pool, token, via="http")
                if caller is not None:
                    await failed.passed(attempt)
        detail = "the bearer token is malformed, unknown, revoked or expired"
    elif cookie:
        caller = await session_access(pool, cookie)
        detail = "the console session has ended; sign in again"
    else:
        detail = "send Authorization: Bearer <token> (see `toren tokens create`)"
    if caller is None:
        if token is not None or cookie:
            if not counted:
                retry_after = await failed.failed(address)
            if retry_after is not None and not optional:
                raise ProblemError(
                    429,
                    "Too many failed sign-ins",
                    f"too many failed authentications from {address}; try again in {retry_after}s",
                    headers={"Retry-After": str(retry_after)},
                )
        if optional:
            return None
        raise _unauthorized(detail)
    if caller.principal.via == "console" and request.method not in _SAFE:
        _check_csrf(request, caller)
    return caller


def _unauthorized(detail: str) -> ProblemError:
    return ProblemError(401, "Unauthorized", detail)


def same_origin(request: web.Request) -> bool:
    """Whether the browser's ``Origin`` (if it sent one) is this server. The host is compared,
    not the scheme: behind a proxy that terminates TLS the server itself sees plain HTTP."""
    origin = request.headers.get("Origin")
    if origin is None:
        return True
    try:
        return urlsplit(origin).netloc == request.host
    except ValueError:  # not a URL at all
        return False


def _check_csrf(request: web.Request, caller: Access) -> None:
    if not same_origin(request):
        origin = request.headers.get("Origin")
        raise ProblemError(403, "Forbidden", f"cross-origin write from {origin} refused")
    sent = request.headers.get("X-CSRF-Token", "")
    if not caller.csrf or not hmac.compare_digest(sent.encode(), caller.csrf.encode()):
        raise ProblemError(403, "Forbidden", "a write from the console needs its CSRF token")


def bearer(request: web.Request) -> str | None:
    """The bearer token the request carries, if any (other schemes, such as the Basic of a
    proxy in front, are not ours: then the session cookie, if any, counts)."""
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


async def recheck(request: web.Request) -> Access | None:
    """The caller's access checked again now (through the token cache: at most ``ttl`` stale),
    for a long-lived response such as an event stream; None once revoked or expired."""
    pool = request.app[CLIENT].pool
    token = bearer(request)
    if token is not None:
        return await request.app[TOKENS].authenticate(pool, token, via="http")
    cookie = request.cookies.get(SESSION_COOKIE)
    return await session_access(pool, cookie) if cookie else None
