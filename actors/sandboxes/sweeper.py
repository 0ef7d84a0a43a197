"""The checkpoint sweep as a worker runs it: every ``checkpoint_sweep_every`` (an hour by
default), one worker of the cluster at a time (the ``checkpoint_sweep`` singleton lock), deletes
from the workspace store the checkpoints no kept actor names and that were written more than
``checkpoint_grace`` ago (:func:`toren.sandboxes.sweep_checkpoints` says why that is safe).

A worker that has no workspace store open (no Docker) does not sweep. All workers of a
database must share one store for their sandboxes (a store per machine cannot be restored by
another worker anyway): a worker sweeps only the store it has open.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import anyio
import asyncpg

from toren import Settings
from toren.actors.sandboxes.runtime import Sandboxes
from toren.kernel import TRANSIENT_DB_ERRORS, singleton
from toren.sandboxes.store import StoreError
from toren.sandboxes.sweep import sweep_checkpoints

log = logging.getLogger("toren.sandbox")

_FAILED: tuple[type[BaseException], ...] = (*TRANSIENT_DB_ERRORS, asyncpg.PostgresError, StoreError)


async def run_sweeper(
    pool: asyncpg.Pool, sandboxes: Sandboxes, settings: Settings, started: Callable[[], None]
) -> None:
    """Sweep every ``checkpoint_sweep_every`` seconds, the first a period after the start (a
    fleet restarting together does not sweep at once), until cancelled. A failed round is
    logged and tried again at the next: the sweep never ends the worker."""
    started()
    listed: dict[str, frozenset[str]] = {}  # manifests' blobs, kept between rounds
    while True:
        await anyio.sleep(settings.checkpoint_sweep_every)
        if not sandboxes.available:
            continue
        _, store = sandboxes.current()
        try:
            async with singleton(pool, "checkpoint_sweep") as mine:
                if mine:
                    await sweep_checkpoints(
                        pool, store, grace=settings.checkpoint_grace, listed=listed
                    )
        except _FAILED as exc:
            log.warning(
                "checkpoint sweep: %s; trying again in %gs", exc, settings.checkpoint_sweep_every
            )
