"""Work that one worker of a cluster does at a time: a named session advisory lock, tried.

Every worker runs the housekeeping loops (the checkpoint sweep, the dead letters' archive), and
each round first tries the lock of its name: the worker that gets it does the round, the others
skip it (they try again at their next round). The lock is a session lock on a pooled
connection held for the round, and the round's statements run on that connection (a worker
with a pool of one connection must not wait for a second while it holds the first): it is
released when the round ends, and Postgres releases it if the worker dies (its connection
closes), so a killed worker never leaves it held. The pool does
not reset connections given back (:func:`toren._core.db.create_pool`): the lock is released
before, shielded from cancellation, and a connection that could not release it is closed.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any, TypeAlias

import anyio
import asyncpg

if TYPE_CHECKING:
    from asyncpg.pool import PoolConnectionProxy

    Connection: TypeAlias = asyncpg.Connection | PoolConnectionProxy[Any]

# one bigint key per name, apart from the two-integer keys of workers' sessions
_TRY = "SELECT pg_try_advisory_lock(hashtextextended('toren.singleton:' || $1, 0))"
_UNLOCK = "SELECT pg_advisory_unlock(hashtextextended('toren.singleton:' || $1, 0))"


@contextlib.asynccontextmanager
async def singleton(pool: asyncpg.Pool, name: str) -> AsyncIterator[Connection | None]:
    """Hold the cluster-wide lock ``name`` for the block if no one holds it: yields the
    connection that holds it, for the block's statements, or None (another worker is doing
    this work now; the block should skip it)."""
    async with pool.acquire() as conn:
        held: bool = await conn.fetchval(_TRY, name)
        try:
            yield conn if held else None
        finally:
            if held:
                with anyio.CancelScope(shield=True):
                    try:
                        await conn.execute(_UNLOCK, name)
                    except (asyncpg.PostgresError, asyncpg.InterfaceError, OSError):
                        conn.terminate()  # closing the session releases its locks
