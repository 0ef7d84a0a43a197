"""The console: one static page over the API, and the session it signs in with.

``POST /session`` takes a token (a form field, as a plain HTML form sends it) and answers with
an HttpOnly, SameSite=Strict session cookie; ``GET /session`` tells the page who it is and the
CSRF token its writes must carry; ``DELETE /session`` signs out.
"""

from __future__ import annotations

from pathlib import Path

import attrs
from aiohttp import web

from toren._surfaces.http.auth import SESSION_COOKIE, same_origin
from toren._surfaces.http.common import CLIENT, OPTIONS, ProblemError, access, client_address
from toren._surfaces.http.guard import FAILED_AUTH
from toren._surfaces.tokens import authenticate, close_session, open_session

STATIC = Path(__file__).parent / "static"


def install(app: web.Application) -> None:
    app.router.add_get("/", index)
    app.router.add_get("/favicon.ico", favicon)
    app.router.add_static("/static/", STATIC)
    app.router.add_post("/session", sign_in)
    app.router.add_get("/session", whoami)
    app.router.add_delete("/session", sign_out)


async def favicon(request: web.Request) -> web.Response:
    return web.Response(status=204)


async def index(request: web.Request) -> web.FileResponse:
    return web.FileResponse(STATIC / "index.html", headers=page_headers())


def page_headers() -> dict[str, str]:
    return {
        "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; "
        "frame-ancestors 'none'; form-action 'self'",
        "X-Content-Type-Options": "nosniff",
        "Referrer-Policy": "same-origin",  # "no-referrer" makes form posts send Origin: null
        "Cache-Control": "no-store",
    }


async def sign_in(request: web.Request) -> web.StreamResponse:
    if not same_origin(request):
        origin = request.headers.get("Origin", "")
        raise ProblemError(403, "Forbidden", f"cross-origin sign-in from {origin!r} refused")
    failed, address = request.app[FAILED_AUTH], client_address(request)
    attempt = await failed.attempt(address)  # a failure until its token passes
    retry_after = attempt.retry_after
    if retry_after is not None:
        raise ProblemError(
            429,
            "Too many failed sign-ins",
            f"too many failed sign-ins from {address}; try again in {retry_after}s",
            headers={"Retry-After": str(retry_after)},
        )
    try:
        form = await request.post()
    except ValueError as exc:  # a form aiohttp cannot parse (a multipart body without boundary)
        raise ProblemError(400, "Bad request", f"the sign-in form cannot be read: {exc}") from None
    token = form.get("token")
    pool = request.app[CLIENT].pool
    found = await authenticate(pool, token.strip()) if isinstance(token, str) else None
    if found is None:
        raise web.HTTPSeeOther("/?denied=1")
    await failed.passed(attempt)
    cookie, _, seconds = await open_session(pool, found)
    response = web.HTTPSeeOther("/")
    secure = request.app[OPTIONS].secure_cookies
    response.set_cookie(
        SESSION_COOKIE,
        cookie,
        max_age=int(seconds),
        httponly=True,
        samesite="Strict",
        secure=request.secure if secure is None else secure,
        path="/",
    )
    raise response


async def whoami(request: web.Request) -> web.Response:
    caller = access(request)
    return web.json_response(
        {
            "name": caller.principal.name,
            "principal": attrs.asdict(caller.principal),
            "scopes": sorted(caller.scopes),
            "agents": sorted(caller.agents) if caller.agents is not None else None,
            "csrf": caller.csrf,
        }
    )


async def sign_out(request: web.Request) -> web.Response:
    cookie = request.cookies.get(SESSION_COOKIE)
    if cookie:
        await close_session(request.app[CLIENT].pool, cookie)
    response = web.json_response({"signed_out": True})
    response.del_cookie(SESSION_COOKIE, path="/")
    return response
