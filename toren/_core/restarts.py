"""Restart windows: how many times a supervised child restarted within a period.

Supervisors count restarts to decide when to give up (restart intensity). The count must survive
the worker process, or a crash loop that kills its worker would never be seen: the Postgres store
keeps each window in ``toren.restart_windows`` and measures time on the database clock. The memory
store serves supervisors whose children live and die with the process (the worker's own tree).
"""

from __future__ import annotations

import time
from collections import defaultdict, deque
from typing import TYPE_CHECKING, Protocol

import asyncpg
from tenacity import (
    AsyncRetrying,
    retry_if_exception_type,
    stop_after_delay,
    wait_exponential_jitter,
)

from toren._core.db import TRANSIENT_DB_ERRORS

if TYPE_CHECKING:
    from toren._core.rows import Db


def _retrying() -> AsyncRetrying:
    return AsyncRetrying(
        retry=retry_if_exception_type(TRANSIENT_DB_ERRORS),
        wait=wait_exponential_jitter(multiplier=0.05, max=1.0),
        stop=stop_after_delay(10),
        reraise=True,
    )


class RestartStore(Protocol):
    """Where a supervisor records restarts."""

    async def record_restart(self, key: str, period: float) -> int:
        """Record one restart of ``key`` now.

        Returns:
            The number of restarts of ``key`` within the last ``period`` seconds, this one included.
        """

    async def reset(self, key: str) -> None:
        """Forget the restarts of ``key`` (the child was removed for good)."""


class MemoryRestartStore:
    """Restart windows held in this process only, on the monotonic clock."""

    def __init__(self) -> None:
        self._windows: defaultdict[str, deque[float]] = defaultdict(deque)

    async def record_restart(self, key: str, period: float) -> int:
        now = time.monotonic()
        window = self._windows[key]
        window.append(now)
        while window and window[0] <= now - period:
            window.popleft()
        return len(window)

    async def reset(self, key: str) -> None:
        self._windows.pop(key, None)


_RECORD = """
INSERT INTO toren.restart_windows AS w (key, restarts) VALUES ($1, ARRAY[clock_timestamp()])
ON CONFLICT (key) DO UPDATE SET restarts = ARRAY(
    SELECT t FROM unnest(w.restarts || clock_timestamp()) AS t
    WHERE t > clock_timestamp() - make_interval(secs => $2)
    ORDER BY t)
RETURNING cardinality(restarts)
"""


class PostgresRestartStore:
    """Restart windows persisted in Postgres, so that they survive worker restarts.

    A dropped connection is retried for a few seconds (a supervisor that cannot count restarts
    cannot decide anything, so giving up at once would turn a blip into an escalation).
    """

    def __init__(self, pool: asyncpg.Pool) -> None:
        self._pool = pool

    async def record_restart(self, key: str, period: float) -> int:
        async for attempt in _retrying():
            with attempt:
                count: int = await self._pool.fetchval(_RECORD, key, float(period))
        return count

    async def reset(self, key: str) -> None:
        await forget_restarts(self._pool, key)


async def forget_restarts(db: Db, key: str) -> None:
    """Forget the restarts counted in window ``key`` (the next restart opens a new one)."""
    await db.execute("DELETE FROM toren.restart_windows WHERE key = $1", key)
