"""Failed authentications, limited per client address over a moving minute, counted in Postgres.

Every API server process on one database counts into the same table (``toren.auth_failures``,
migration 0017), so ``failed_auth_per_minute`` holds for the fleet: N processes behind one port
(``toren serve --workers N``) or behind a balancer do not make it N times weaker, and attempts
racing at once do not pass a limit between a check and a count. An attempt that decides
something (a credential this process has not seen pass lately) is counted as a failure before
its credential is checked, in one statement under a lock of its address
(``toren.auth_attempt``: one after another from every process), and uncounted if the
credential passes: a limit of N lets exactly N failures through in any minute. A credential
this process saw pass lately is checked without asking, and counted only if it fails. Writes go
to an unlogged table (no WAL flush). A block this process learnt of is remembered until it ends
(blocks end only with time), so a flood from a blocked address costs no queries.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from datetime import datetime

import asyncpg
import attrs
from aiohttp import web

REMEMBERED = 4096
"""Blocked addresses one process remembers at most (the oldest are forgotten first: a
forgotten one is asked of the database again)."""

_ATTEMPT = "SELECT retry_after, counted_at FROM toren.auth_attempt($1, $2, $3)"
_PASSED = "DELETE FROM toren.auth_failures WHERE kind = $1 AND address = $2 AND at = $3"


@attrs.frozen
class Attempt:
    """An attempt of one address: refused (``retry_after``: seconds until it may try again), or
    counted as a failure until :meth:`FailedAuth.passed` says its credential passed."""

    address: str
    retry_after: int | None
    counted_at: datetime | None


class FailedAuth:
    """Failed authentications of one ``kind`` (``http``, ``webhook``, ``mcp``: counted apart)
    per client address: at ``per_minute`` failures within a minute, from any process, the
    address is refused (429) until the oldest of them that counts is a minute old."""

    def __init__(self, pool: asyncpg.Pool, kind: str, per_minute: int) -> None:
        self._pool = pool
        self.kind = kind
        self.per_minute = per_minute
        self._until: OrderedDict[str, float] = OrderedDict()  # blocked: until when (monotonic)

    async def attempt(self, address: str) -> Attempt:
        """Count an attempt of ``address`` as a failure, unless it is blocked (then nothing is
        counted): call :meth:`passed` if its credential passes.

        Raises:
            asyncpg.PostgresError, OSError: the database did not answer.
        """
        held = self._held(address)
        if held is not None:
            return Attempt(address, held, None)
        row = await self._pool.fetchrow(_ATTEMPT, self.kind, _key(address), self.per_minute)
        assert row is not None  # the function returns one row
        return Attempt(address, self._remember(address, row["retry_after"]), row["counted_at"])

    async def passed(self, attempt: Attempt) -> None:
        """The attempt's credential passed: it is not a failure."""
        if attempt.counted_at is not None:
            await self._pool.execute(_PASSED, self.kind, _key(attempt.address), attempt.counted_at)

    async def failed(self, address: str) -> int | None:
        """A credential checked without :meth:`attempt` failed: count it. Returns the seconds
        until ``address`` may try again if it was blocked already (nothing counted), else None."""
        return (await self.attempt(address)).retry_after

    def _held(self, address: str) -> int | None:
        until = self._until.get(address)
        if until is None:
            return None
        left = until - time.monotonic()
        if left <= 0:
            del self._until[address]
            return None
        return max(1, math.ceil(left))

    def _remember(self, address: str, seconds: float | None) -> int | None:
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
