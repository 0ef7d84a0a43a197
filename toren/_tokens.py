"""API tokens and console sessions.

A token reads ``trn_<id>_<secret>``: ``id`` finds its row, and the SHA-256 of ``secret`` is
compared in constant time with the one stored (the secret itself is never stored; 32 random
bytes need no slow hash). A console session is a random cookie whose SHA-256 is stored with
the token it was opened with and the CSRF token its writes must carry; revoking the token ends
its sessions.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from collections import OrderedDict
from datetime import datetime

import asyncpg
import attrs

PREFIX = "trn"
SESSION_SECONDS = 12 * 3600


@attrs.frozen
class Principal:
    """Who a request comes from: the token's id and name, and how it was presented."""

    token_id: str
    name: str
    via: str  # "token" (Authorization header) or "session" (console cookie)
    csrf: str | None = None


@attrs.frozen
class TokenRow:
    id: str
    name: str
    created_at: datetime
    revoked_at: datetime | None
    last_used_at: datetime | None


def _sha256(value: str) -> bytes:
    return hashlib.sha256(value.encode()).digest()


async def create_token(conn: asyncpg.Pool | asyncpg.Connection, name: str) -> tuple[str, str]:
    """A new token named ``name``; returns ``(id, token)``. The token is shown once."""
    token_id = secrets.token_hex(6)
    secret = secrets.token_urlsafe(32)
    await conn.execute(
        "INSERT INTO toren.tokens (id, name, secret_sha256) VALUES ($1, $2, $3)",
        token_id,
        name,
        _sha256(secret),
    )
    return token_id, f"{PREFIX}_{token_id}_{secret}"


async def list_tokens(conn: asyncpg.Pool | asyncpg.Connection) -> list[TokenRow]:
    rows = await conn.fetch(
        "SELECT id, name, created_at, revoked_at, last_used_at FROM toren.tokens "
        "ORDER BY created_at"
    )
    return [TokenRow(**dict(r)) for r in rows]


async def revoke_token(conn: asyncpg.Pool | asyncpg.Connection, token_id: str) -> bool:
    """Revoke a token and end its console sessions; False if no live token has that id."""
    revoked: int = await conn.fetchval(
        "WITH revoked AS (UPDATE toren.tokens SET revoked_at = now() "
        "  WHERE id = $1 AND revoked_at IS NULL RETURNING id), "
        "ended AS (DELETE FROM toren.sessions WHERE token_id = $1) "
        "SELECT count(*) FROM revoked",
        token_id,
    )
    return revoked > 0


# `last_used_at` is refreshed at most once a minute, so that authenticating is a read (no commit
# to wait for, no row lock that concurrent requests with one token would queue on).
_AUTHENTICATE = """
WITH live AS (
    SELECT name, secret_sha256 FROM toren.tokens WHERE id = $1 AND revoked_at IS NULL
), touched AS (
    UPDATE toren.tokens SET last_used_at = now()
    WHERE id = $1 AND revoked_at IS NULL
      AND (last_used_at IS NULL OR last_used_at < now() - interval '1 minute')
    RETURNING 1
)
SELECT name, secret_sha256, (SELECT count(*) FROM touched) AS touched FROM live
"""


async def authenticate(pool: asyncpg.Pool, token: str) -> Principal | None:
    """The principal a bearer token stands for, or None (malformed, unknown or revoked)."""
    prefix, _, rest = token.partition("_")
    token_id, _, secret = rest.partition("_")
    if prefix != PREFIX or not token_id or not secret or len(token) > 200:
        return None
    row = await pool.fetchrow(_AUTHENTICATE, token_id)
    if row is None or not hmac.compare_digest(row["secret_sha256"], _sha256(secret)):
        return None
    return Principal(token_id=token_id, name=row["name"], via="token")


async def open_session(pool: asyncpg.Pool, principal: Principal) -> tuple[str, str]:
    """A console session for ``principal``; returns ``(cookie value, csrf token)``."""
    cookie = secrets.token_urlsafe(32)
    csrf = secrets.token_urlsafe(24)
    await pool.execute(
        "INSERT INTO toren.sessions (id_sha256, token_id, csrf, expires_at) "
        "VALUES ($1, $2, $3, now() + make_interval(secs => $4))",
        _sha256(cookie),
        principal.token_id,
        csrf,
        float(SESSION_SECONDS),
    )
    return cookie, csrf


async def session_principal(pool: asyncpg.Pool, cookie: str) -> Principal | None:
    """The principal of a live session cookie, or None."""
    if len(cookie) > 200:
        return None
    row = await pool.fetchrow(
        "SELECT s.token_id, s.csrf, t.name FROM toren.sessions s "
        "JOIN toren.tokens t ON t.id = s.token_id "
        "WHERE s.id_sha256 = $1 AND s.expires_at > now() AND t.revoked_at IS NULL",
        _sha256(cookie),
    )
    if row is None:
        return None
    return Principal(token_id=row["token_id"], name=row["name"], via="session", csrf=row["csrf"])


async def close_session(pool: asyncpg.Pool, cookie: str) -> None:
    await pool.execute("DELETE FROM toren.sessions WHERE id_sha256 = $1", _sha256(cookie))


class TokenCache:
    """Bearer tokens checked against the database at most once per ``ttl`` seconds each.

    A token that passed is trusted for ``ttl`` seconds more, so a revocation takes effect within
    ``ttl``; a token that failed is checked again next time. Tokens are held by their SHA-256.
    """

    def __init__(self, ttl: float = 1.0, size: int = 1024) -> None:
        self.ttl = ttl
        self.size = size
        self._passed: OrderedDict[bytes, tuple[float, Principal]] = OrderedDict()

    async def authenticate(self, pool: asyncpg.Pool, token: str) -> Principal | None:
        """As :func:`authenticate`, answered from the cache while the token's check is fresh."""
        key = _sha256(token)
        now = time.monotonic()
        held = self._passed.get(key)
        if held is not None and held[0] > now:
            return held[1]
        principal = await authenticate(pool, token)
        if principal is None:
            self._passed.pop(key, None)
            return None
        self._passed[key] = (now + self.ttl, principal)
        self._passed.move_to_end(key)
        while len(self._passed) > self.size:
            self._passed.popitem(last=False)
        return principal
