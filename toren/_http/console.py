"""The console: one static page over the API, and the session it signs in with.

``POST /session`` takes a token (a form field, as a plain HTML form sends it) and answers with
an HttpOnly, SameSite=Strict session cookie; ``GET /session`` tells the page who it is and the
CSRF token its writes must carry; ``DELETE /session`` signs out.
"""

from __future__ import annotations

from pathlib import Path
from urllib.parse import urlsplit

from aiohttp import web

from toren._http.common import CLIENT, ProblemError, principal
from toren._tokens import SESSION_SECONDS, authenticate, close_session, open_session

STATIC = Path(__file__).parent / "static"
SESSION_COOKIE = "toren_session"


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
    return web.FileResponse(STATIC / "index.html", headers=_page_headers())


def _page_headers() -> dict[str, str]:
    return {
        "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; "
        "frame-ancestors 'none'; form-action 'self'",
        "X-Content-Type-Options": "nosniff",
        "Referrer-Policy": "same-origin",  # "no-referrer" makes form posts send Origin: null
        "Cache-Control": "no-store",
    }


async def sign_in(request: web.Request) -> web.StreamResponse:
    origin = request.headers.get("Origin")
    if origin is not None and urlsplit(origin).netloc != request.host:
        raise ProblemError(403, "Forbidden", f"cross-origin sign-in from {origin} refused")
    form = await request.post()
    token = form.get("token")
    pool = request.app[CLIENT].pool
    found = await authenticate(pool, token.strip()) if isinstance(token, str) else None
    if found is None:
        raise web.HTTPSeeOther("/?denied=1")
    cookie, _ = await open_session(pool, found)
    response = web.HTTPSeeOther("/")
    response.set_cookie(
        SESSION_COOKIE,
        cookie,
        max_age=SESSION_SECONDS,
        httponly=True,
        samesite="Strict",
        secure=request.secure,
        path="/",
    )
    raise response


async def whoami(request: web.Request) -> web.Response:
    who = principal(request)
    return web.json_response({"name": who.name, "csrf": who.csrf})


async def sign_out(request: web.Request) -> web.Response:
    cookie = request.cookies.get(SESSION_COOKIE)
    if cookie:
        await close_session(request.app[CLIENT].pool, cookie)
    response = web.json_response({"signed_out": True})
    response.del_cookie(SESSION_COOKIE, path="/")
    return response
