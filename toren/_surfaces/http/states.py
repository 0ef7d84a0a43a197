"""Run states for the API: each run folded once, then brought up to date with the events
committed since, in one statement per read; and the routes live workers serve, read at most
once a second.

A journal only grows, so a state folded up to ``seq`` plus the events after ``seq`` is the
state folded from the start; the first read of a run starts from its snapshot. States are kept
for the most recently read runs (an LRU of ``size``); a run that is gone is forgotten.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from datetime import datetime

import asyncpg
from aiohttp import web

from toren._core.codec import decode
from toren._core.journal import ArchiveReader, replay
from toren._core.journal_reads import actor_and_events
from toren._core.rows import ActorRow, actor_row
from toren._core.workers import published_routes
from toren._surfaces.http.common import ProblemError
from toren.runs import RUN_KIND, SNAPSHOT_VERSION, RunState, fold

SNAPSHOTS = (RunState, SNAPSHOT_VERSION)


STATES: web.AppKey[RunStates] = web.AppKey("run_states")
SERVED: web.AppKey[ServedRoutes] = web.AppKey("served_routes")


class RunStates:
    """Folded run states, kept for the ``size`` runs read last."""

    def __init__(self, size: int = 2048, archives: ArchiveReader | None = None) -> None:
        self.size = size
        self.archives = archives  # for a run whose snapshot does not cover its archived events
        self._states: OrderedDict[str, tuple[int, RunState]] = OrderedDict()

    async def read(self, pool: asyncpg.Pool, rid: str) -> tuple[RunState, datetime]:
        """Run ``rid``'s state and creation time.

        Raises:
            ProblemError: 404, no such run.
        """
        state, row = await self.read_row(pool, rid)
        return state, row.created_at

    async def read_row(
        self,
        pool: asyncpg.Pool,
        rid: str,
        fields: tuple[str, ...] = (),
        *,
        mail_kind: str | None = None,
    ) -> tuple[RunState, ActorRow]:
        """Run ``rid``'s state and its row (its small columns and ``fields``; with
        ``mail_kind``, whether such a message waits for it), in the one statement that brings
        the state up to date.

        Raises:
            ProblemError: 404, no such run.
        """
        held = self._states.get(rid)
        if held is None:
            # First read: from the run's snapshot, if it keeps one, then the events since.
            if await actor_row(pool, rid, kind=RUN_KIND) is None:
                raise ProblemError(404, "Not found", f"no run {rid}")
            rebuilt = await replay(
                pool, rid, RunState(), fold, snapshots=SNAPSHOTS, archives=self.archives
            )
            held = (rebuilt.seq, rebuilt.state)
        seq, state = held
        found = await actor_and_events(pool, rid, after=seq, fields=fields, mail_kind=mail_kind)
        if found is None or found[0].kind != RUN_KIND:
            self._states.pop(rid, None)
            raise ProblemError(404, "Not found", f"no run {rid}")
        row, entries = found
        if seq and entries and entries[0].seq != seq + 1:
            # Not the events after ours: the run was replaced under the same id. Start over.
            self._states.pop(rid, None)
            return await self.read_row(pool, rid, fields, mail_kind=mail_kind)
        for entry in entries:
            state = fold(state, decode(entry.type, entry.data))
            seq = entry.seq
        held = self._states.get(rid)
        if held is None or held[0] <= seq:  # a concurrent read may have gone further
            self._states[rid] = (seq, state)
        self._states.move_to_end(rid)
        while len(self._states) > self.size:
            self._states.popitem(last=False)
        return state, row


class ServedRoutes:
    """The routes live workers publish, as read at most ``ttl`` seconds ago.

    A read of a pinned run asks whether a live worker serves its version (a parked run is one
    no worker will claim). Reading the workers' routes once a second instead of with every
    read of a run, a run may be shown parked, or running, up to ``ttl`` late: well within the
    time a dead worker's lease takes to lapse.
    """

    def __init__(self, ttl: float = 1.0) -> None:
        self.ttl = ttl
        self._routes: frozenset[str] | None = None
        self._read_at = -float("inf")

    async def read(self, pool: asyncpg.Pool) -> frozenset[str] | None:
        """Every route a live worker published when last read; ``None`` while one has not
        published yet (what it serves is not known)."""
        now = time.monotonic()
        if now - self._read_at >= self.ttl:
            found = await published_routes(pool)
            self._routes = None if found is None else frozenset(found)
            self._read_at = now
        return self._routes
