"""The housekeeper: the worker's tidying that needs more than one statement.

The dispatcher runs the kernel's housekeeping statement every minute or so
(:func:`toren.kernel.housekeep`: dead workers' rows, old dedupe keys and replies, expired
sessions, dead tokens). What needs the archive store runs here, every ``EVERY`` seconds, the
first round that long after the start (a fleet restarting together does not do it at once): the
dead letters older than ``deadletter_keep_for`` are archived and deleted, one worker of the
cluster at a time (:func:`toren.kernel.archive_old_deadletters`).

Tidying never costs the worker more than a log line: a failed round is logged and tried again
at the next; the housekeeper never ends its incarnation.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import anyio
import asyncpg

from toren import Settings
from toren.kernel import archive_old_deadletters

log = logging.getLogger("toren.housekeeping")

EVERY = 600.0
"""Seconds between two rounds of a worker's housekeeper."""


async def run_housekeeper(
    pool: asyncpg.Pool, settings: Settings, started: Callable[[], None], *, every: float = EVERY
) -> None:
    """Tidy every ``every`` seconds until cancelled."""
    started()
    while True:
        await anyio.sleep(every)
        try:
            await archive_old_deadletters(pool, settings)
        except Exception:  # a store or a database that fails: tried again next round
            log.warning("archiving old dead letters failed; will try again later", exc_info=True)
