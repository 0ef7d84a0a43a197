"""API tokens, what they may do, and console sessions.

A token reads ``trn_<id>_<secret>``: ``id`` finds its row, and the SHA-256 of ``secret`` is
compared in constant time with the one stored (the secret itself is never stored; 32 random
bytes need no slow hash). A token has scopes (``read``; ``operate``: start, send, cancel,
retry; ``approve``: decisions), may be limited to some agents (then it may write only to runs
of those agents) and may expire. A console session is a random cookie whose SHA-256 is stored
with the token it was opened with and the CSRF token its writes must carry; it lasts at most as
long as its token, and revoking the token ends its sessions. A token holds at most
``MAX_SESSIONS`` live sessions: a sign-in past them ends the token's oldest.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
import time
from collections import OrderedDict
from collections.abc import Iterable
from datetime import datetime

import asyncpg
import attrs

from toren._agent.principal import Principal
from toren._core.errors import TorenError

PREFIX = "trn"
SESSION_SECONDS = 12 * 3600
MAX_SESSIONS = 10
"""Live console sessions one token holds at most (each sign-in opens one)."""
SCOPES = ("read", "operate", "approve")
NAME_CAP = 100


class TokenNameTaken(TorenError):
    """A live token already has this name (names identify tokens to people)."""

    def __init__(self, name: str) -> None:
        self.name = name
        super().__init__(f"a live token is already named {name!r}; pick another name")


@attrs.frozen
class Access:
    """An authenticated caller: who (``principal``) and what it may do.

    ``agents`` is None for every agent; otherwise the caller may start, steer and decide only
    runs of those agents (reading is governed by the ``read`` scope alone).
    """

    principal: Principal
    scopes: frozenset[str]
    agents: frozenset[str] | None = None
    expires_at: datetime | None = None
    csrf: str | None = None  # a console session's CSRF token

    def allows(self, scope: str) -> bool:
        return scope in self.scopes

    def may_write(self, agent: str) -> bool:
        """Whether this caller may start, steer or decide a run of ``agent``."""
        return self.agents is None or agent in self.agents

    def expired(self) -> bool:
        return self.expires_at is not None and self.expires_at.timestamp() <= time.time()


@attrs.frozen
class TokenRow:
    id: str
    name: str
    scopes: tuple[str, ...]
    agents: tuple[str, ...] | None
    created_at: datetime
    expires_at: datetime | None
    revoked_at: datetime | None
    last_used_at: datetime | None


def _sha256(value: str) -> bytes:
    # A header can carry any bytes (aiohttp decodes them with surrogateescape): hash them all.
    return hashlib.sha256(value.encode("utf-8", "surrogatepass")).digest()


async def create_token(
    conn: asyncpg.Pool | asyncpg.Connection,
    name: str,
    *,
    scopes: Iterable[str] = ("read",),
    agents: Iterable[str] | None = None,
    expires_in: float | None = None,
) -> tuple[str, str]:
    """A new token named ``name`` with ``scopes``, limited to ``agents`` if given, expiring in
    ``expires_in`` seconds if given; returns ``(id, token)``. The token is shown once.

    Raises:
        ValueError: an unknown scope, no scope, or a name that is empty or too long.
        TokenNameTaken: a live token has that name.
    """
    wanted = sorted(set(scopes), key=SCOPES.index) if set(scopes) <= set(SCOPES) else None
    if not wanted:
        raise ValueError(f"scopes must be some of {', '.join(SCOPES)}")
    if not name or len(name) > NAME_CAP or name != name.strip() or not name.isprintable():
        raise ValueError(f"a token name is 1 to {NAME_CAP} printable characters")
    if expires_in is not None and not 0 < expires_in <= 10 * 365 * 86400:
        raise ValueError("a token expires in a positive time of at most ten years")
    token_id = secrets.token_hex(6)
    secret = secrets.token_urlsafe(32)
    # An expired token holding the name is revoked first: its name is free again.
    await conn.execute(
        "UPDATE toren.tokens SET revoked_at = now() "
        "WHERE name = $1 AND revoked_at IS NULL AND expires_at <= now()",
        name,
    )
    try:
        await conn.execute(
            "INSERT INTO toren.tokens (id, name, secret_sha256, scopes, agents, expires_at) "
            "VALUES ($1, $2, $3, $4, $5, now() + make_interval(secs => $6))",
            token_id,
            name,
            _sha256(secret),
            wanted,
            sorted(set(agents)) if agents is not None else None,
            expires_in,
        )
    except asyncpg.UniqueViolationError as exc:
        raise TokenNameTaken(name) from exc
    return token_id, f"{PREFIX}_{token_id}_{secret}"


async def list_tokens(conn: asyncpg.Pool | asyncpg.Connection) -> list[TokenRow]:
    rows = await conn.fetch(
        "SELECT id, name, scopes, agents, created_at, expires_at, revoked_at, last_used_at "
        "FROM toren.tokens ORDER BY created_at"
    )
    return [
        TokenRow(
            **{
                **dict(r),
                "scopes": tuple(r["scopes"]),
                "agents": tuple(r["agents"]) if r["agents"] is not None else None,
            }
        )
        for r in rows
    ]


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


_LIVE = "revoked_at IS NULL AND (expires_at IS NULL OR expires_at > now())"

# `last_used_at` is refreshed at most once a minute, so that authenticating is a read (no commit
# to wait for, no row lock that concurrent requests with one token would queue on).
_AUTHENTICATE = f"""
WITH live AS (
    SELECT name, secret_sha256, scopes, agents, expires_at FROM toren.tokens
    WHERE id = $1 AND {_LIVE}
), touched AS (
    UPDATE toren.tokens SET last_used_at = now()
    WHERE id = $1 AND {_LIVE}
      AND (last_used_at IS NULL OR last_used_at < now() - interval '1 minute')
    RETURNING 1
)
SELECT live.*, (SELECT count(*) FROM touched) AS touched FROM live
"""


def _access(row: asyncpg.Record, token_id: str, via: str, csrf: str | None = None) -> Access:
    name = row["name"] if 0 < len(row["name"]) <= NAME_CAP else f"token {token_id}"
    return Access(
        principal=Principal(kind="token", id=token_id, name=name, via=via),
        scopes=frozenset(row["scopes"]),
        agents=frozenset(row["agents"]) if row["agents"] is not None else None,
        expires_at=row["expires_at"],
        csrf=csrf,
    )


_TOKEN = re.compile(rf"{PREFIX}_([0-9a-f]{{1,32}})_([A-Za-z0-9_-]{{1,100}})")
_COOKIE = re.compile(r"[A-Za-z0-9_-]{1,100}")


def _parts(token: str) -> tuple[str, str] | None:
    """A token's id and secret, or None if it is not shaped like one this server gave out
    (then it is refused without a query)."""
    match = _TOKEN.fullmatch(token)
    return (match[1], match[2]) if match else None


async def authenticate(pool: asyncpg.Pool, token: str, *, via: str = "http") -> Access | None:
    """What a bearer token may do, or None (malformed, unknown, revoked or expired)."""
    parts = _parts(token)
    if parts is None:
        return None
    token_id, secret = parts
    row = await pool.fetchrow(_AUTHENTICATE, token_id)
    if row is None or not hmac.compare_digest(row["secret_sha256"], _sha256(secret)):
        return None
    return _access(row, token_id, via)


async def open_session(pool: asyncpg.Pool, access: Access) -> tuple[str, str, float]:
    """A console session for ``access`` (ending no later than its token); returns
    ``(cookie value, csrf token, seconds it lasts)``. Past ``MAX_SESSIONS`` live sessions of
    the token, its oldest are ended (and its expired ones dropped) in the same transaction."""
    cookie = secrets.token_urlsafe(32)
    csrf = secrets.token_urlsafe(24)
    seconds = float(SESSION_SECONDS)
    if access.expires_at is not None:
        seconds = max(1.0, min(seconds, access.expires_at.timestamp() - time.time()))
    token_id = access.principal.id
    async with pool.acquire() as conn, conn.transaction():
        # Sign-ins with one token take turns on its row, so that each one counts the sessions
        # the one before it left (two at once never leave MAX_SESSIONS + 1). Read committed:
        # the statements below see what the one before committed.
        await conn.execute("SELECT 1 FROM toren.tokens WHERE id = $1 FOR NO KEY UPDATE", token_id)
        await conn.execute(_TRIM_SESSIONS, token_id, MAX_SESSIONS - 1)
        # clock_timestamp(), not now() (this transaction's start, before it waited its turn):
        # "oldest" is then the order in which sign-ins took their turn.
        await conn.execute(
            "INSERT INTO toren.sessions (id_sha256, token_id, csrf, created_at, expires_at) "
            "VALUES ($1, $2, $3, clock_timestamp(), now() + make_interval(secs => $4))",
            _sha256(cookie),
            token_id,
            csrf,
            seconds,
        )
    return cookie, csrf, seconds


# The token's sessions but its newest live ones ($2 of them): expired ones go too.
_TRIM_SESSIONS = """
DELETE FROM toren.sessions WHERE id_sha256 IN (
    SELECT id_sha256 FROM toren.sessions WHERE token_id = $1
    ORDER BY expires_at > now() DESC, created_at DESC, id_sha256
    OFFSET $2
)
"""


async def session_access(pool: asyncpg.Pool, cookie: str) -> Access | None:
    """What a live session cookie may do, or None."""
    if not _COOKIE.fullmatch(cookie):
        return None
    row = await pool.fetchrow(
        "SELECT s.token_id, s.csrf, t.name, t.scopes, t.agents, t.expires_at "
        "FROM toren.sessions s JOIN toren.tokens t ON t.id = s.token_id "
        "WHERE s.id_sha256 = $1 AND s.expires_at > now() AND t.revoked_at IS NULL "
        "AND (t.expires_at IS NULL OR t.expires_at > now())",
        _sha256(cookie),
    )
    if row is None:
        return None
    return _access(row, row["token_id"], "console", csrf=row["csrf"])


async def close_session(pool: asyncpg.Pool, cookie: str) -> None:
    if not _COOKIE.fullmatch(cookie):
        return
    await pool.execute("DELETE FROM toren.sessions WHERE id_sha256 = $1", _sha256(cookie))


class TokenCache:
    """Bearer tokens checked against the database at most once per ``ttl`` seconds each.

    A token that passed is trusted for ``ttl`` seconds more (never past its expiry), so a
    revocation takes effect within ``ttl``; a token that failed is refused from the cache for
    ``failed_ttl`` seconds (a flood of bad tokens costs no queries). Tokens are held by their
    SHA-256, never in the clear.
    """

    def __init__(self, ttl: float = 1.0, failed_ttl: float = 5.0, size: int = 4096) -> None:
        self.ttl = ttl
        self.failed_ttl = failed_ttl
        self.size = size
        self._held: OrderedDict[tuple[bytes, str], tuple[float, Access | None]] = OrderedDict()
        self._known: OrderedDict[bytes, float] = OrderedDict()  # passed lately: until when

    def known(self, token: str) -> bool:
        """Whether ``token`` passed a check in the last ten minutes (it is still checked: this
        only tells a client that held a good token from one guessing)."""
        until = self._known.get(_sha256(token))
        return until is not None and until > time.monotonic()

    async def authenticate(
        self, pool: asyncpg.Pool, token: str, *, via: str = "http"
    ) -> Access | None:
        """As :func:`authenticate`, answered from the cache while the token's check is fresh."""
        if _parts(token) is None:
            return None  # not shaped like a token: refused without a query or a cache entry
        key = (_sha256(token), via)
        now = time.monotonic()
        held = self._held.get(key)
        if held is not None and held[0] > now:
            access = held[1]
            if access is None or not access.expired():
                return access
        access = await authenticate(pool, token, via=via)
        until = now + (self.ttl if access is not None else self.failed_ttl)
        if access is not None and access.expires_at is not None:
            until = min(until, now + access.expires_at.timestamp() - time.time())
        self._held[key] = (until, access)
        self._held.move_to_end(key)
        while len(self._held) > self.size:
            self._held.popitem(last=False)
        if access is not None:
            self._known[key[0]] = now + 600
            self._known.move_to_end(key[0])
            while len(self._known) > self.size:
                self._known.popitem(last=False)
        return access
