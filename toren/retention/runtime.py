"""What the retention kind keeps on a worker: its pool, its agents (whose policies the pruners
read), the settings of its batches and, opened when first needed, the archive store."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from toren._agent.registry import Agents

if TYPE_CHECKING:
    import asyncpg

    from toren._agent.retention import Retention


class Pruners:
    """The retention kind's runtime on one worker."""

    def __init__(
        self,
        pool: asyncpg.Pool,
        agents: Agents,
        *,
        batch: int,
        lock_timeout: float,
        every: float,
        store_url: str | None,
    ) -> None:
        self.pool = pool
        self.agents = agents
        self.batch = batch
        self.lock_timeout = lock_timeout
        self.every = every
        self.store_url = store_url
        self._store: Any = None

    def policy(self, agent: str) -> Retention | None:
        """``agent``'s retention policy on this worker (``None``: it has none, or is not run
        here)."""
        found = self.agents.named(agent)
        return found.retention if found is not None else None

    async def store(self) -> Any:
        """The archive store (an ``ObjectStore``), opened on first use; ``None`` when
        ``archive_store`` is not set.

        Raises:
            ConfigError: its URL is not one a store takes (the store's own clear error).
        """
        if self._store is None and self.store_url:
            from toren._core.stores import store_from_url

            self._store = store_from_url(self.store_url, setting="archive_store")
        return self._store

    async def close(self) -> None:
        """Close the archive store if it was opened."""
        if self._store is not None:
            await self._store.close()
            self._store = None
