"""Failed authentications, limited per client address over a moving minute, counted in Postgres.

Every API server process on one database counts into the same table (``toren.auth_failures``,
migration 0017), so ``failed_auth_per_minute`` holds for the fleet: N processes behind one port
(``toren serve --workers N``) or behind a balancer do not make it N times weaker. Only failures
write (one statement, on an unlogged table: no WAL flush); a request whose credentials pass
costs nothing here, because callers ask :meth:`FailedAuth.blocked` only when it decides
something: before checking a credential this process has not seen pass lately, and after one
failed. A block this process learnt of is remembered until it ends (blocks end only with time),
so a flood from a blocked address costs no queries.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from decimal import Decimal

import asyncpg
from aiohttp import web

REMEMBERED = 4096
"""Blocked addresses one process remembers at most (the oldest are forgotten first: a
forgotten one is asked of the database again)."""

# The failure that, a minute old, lets the address try again: the `$3`-th newest of the last
# minute (none: not blocked). Reads at most `$3` index entries.
_BLOCKED = """
SELECT extract(epoch FROM at + interval '1 minute' - now()) FROM toren.auth_failures
WHERE kind = $1 AND address = $2 AND at > now() - interval '1 minute'
ORDER BY at DESC OFFSET $3 - 1 LIMIT 1
"""

# One more failure, and the answer of _BLOCKED counting it. A few expired rows of any address go
# too (without waiting on a sweep in another process), so the table holds about a minute.
_FAILED = """
WITH added AS (
    INSERT INTO toren.auth_failures (kind, address) VALUES ($1, $2) RETURNING at
), swept AS (
    DELETE FROM toren.auth_failures WHERE ctid IN (
        SELECT ctid FROM toren.auth_failures WHERE at <= now() - interval '1 minute'
        LIMIT 100 FOR UPDATE SKIP LOCKED
    )
)
SELECT extract(epoch FROM at + interval '1 minute' - now()) FROM (
    SELECT at FROM toren.auth_failures
    WHERE kind = $1 AND address = $2 AND at > now() - interval '1 minute'
    UNION ALL SELECT at FROM added
) recent
ORDER BY at DESC OFFSET $3 - 1 LIMIT 1
"""


class FailedAuth:
    """Failed authentications of one ``kind`` (``http``, ``webhook``, ``mcp``: counted apart)
    per client address: at ``per_minute`` failures within a minute, from any process, the
    address is refused (429) until the oldest of them that counts is a minute old."""

    def __init__(self, pool: asyncpg.Pool, kind: str, per_minute: int) -> None:
        self._pool = pool
        self.kind = kind
        self.per_minute = per_minute
        self._until: OrderedDict[str, float] = OrderedDict()  # blocked: until when (monotonic)

    async def blocked(self, address: str) -> int | None:
        """Seconds until ``address`` may try again, or None if it may now.

        Raises:
            asyncpg.PostgresError, OSError: the database did not answer.
        """
        held = self._held(address)
        if held is not None:
            return held
        seconds = await self._pool.fetchval(_BLOCKED, self.kind, _key(address), self.per_minute)
        return self._remember(address, seconds)

    async def failed(self, address: str) -> int | None:
        """Count one failure of ``address``; returns what :meth:`blocked` now would."""
        seconds = await self._pool.fetchval(_FAILED, self.kind, _key(address), self.per_minute)
        return self._remember(address, seconds)

    def _held(self, address: str) -> int | None:
        until = self._until.get(address)
        if until is None:
            return None
        left = until - time.monotonic()
        if left <= 0:
            del self._until[address]
            return None
        return max(1, math.ceil(left))

    def _remember(self, address: str, seconds: Decimal | None) -> int | None:
        if seconds is None:  # fewer than per_minute failures in the last minute
            return None
        left = float(seconds)
        if left <= 0:
            return None
        self._until[address] = time.monotonic() + left
        self._until.move_to_end(address)
        while len(self._until) > REMEMBERED:
            self._until.popitem(last=False)
        return max(1, math.ceil(left))


def _key(address: str) -> bytes:
    # An address from X-Forwarded-For is any text (aiohttp decodes odd bytes as surrogates).
    return address.encode("utf-8", "surrogatepass")


FAILED_AUTH: web.AppKey[FailedAuth] = web.AppKey("failed_auth", FailedAuth)
