"""The checkpoint sweep as a worker runs it: every ``checkpoint_sweep_every`` (an hour by
default), one worker of the cluster at a time (a singleton lock per store), deletes
from the workspace store the checkpoints no kept actor names and that were written more than
``checkpoint_grace`` ago (:func:`toren.sandboxes.sweep_checkpoints` says why that is safe).

A worker that has no workspace store open (no Docker) does not sweep. A worker sweeps the store
it has open, and the lock is the store's: workers sharing an S3 bucket take turns, and each
machine with a local store (``toren dev``, one machine) sweeps its own.
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
from toren.sandboxes.sweep import lock_name, sweep_checkpoints

log = logging.getLogger("toren.sandbox")

# what a round may meet without a bug: the database or the store not answering
_EXPECTED: tuple[type[BaseException], ...] = (
    *TRANSIENT_DB_ERRORS,
    asyncpg.PostgresError,
    StoreError,
)


async def run_sweeper(
    pool: asyncpg.Pool, sandboxes: Sandboxes, settings: Settings, started: Callable[[], None]
) -> None:
    """Sweep every ``checkpoint_sweep_every`` seconds, the first a period after the start (a
    fleet restarting together does not sweep at once), until cancelled. A failed round is
    logged and tried again at the next: the sweep never ends the worker."""
    started()
    listed: dict[str, bytes] = {}  # manifests' blobs, kept between rounds
    while True:
        await anyio.sleep(settings.checkpoint_sweep_every)
        if not sandboxes.available:
            continue
        try:
            _, store = sandboxes.current()
            async with singleton(pool, lock_name(store)) as conn:
                if conn is not None:  # else another worker sweeps this store now
                    await sweep_checkpoints(
                        conn, store, grace=settings.checkpoint_grace, listed=listed
                    )
        except _EXPECTED as exc:
            log.warning(
                "checkpoint sweep: %s; trying again in %gs", exc, settings.checkpoint_sweep_every
            )
        except Exception:  # a bug, or a store refusing a delete: never the worker's end
            log.exception(
                "checkpoint sweep failed; trying again in %gs", settings.checkpoint_sweep_every
            )
