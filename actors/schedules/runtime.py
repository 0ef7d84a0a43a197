"""What the schedule kind keeps on a worker: a client on its pool (reconciling the declared
schedules at its start, and a schedule's look at whether a slot's run exists)."""

from __future__ import annotations

import asyncpg

from toren import Client
from toren.runs import Agents


class Schedules:
    """The schedule kind's runtime on one worker."""

    def __init__(self, client: Client, agents: Agents) -> None:
        self.client = client
        self.agents = agents

    @property
    def pool(self) -> asyncpg.Pool:
        return self.client.pool

    async def close(self) -> None:
        """Nothing to release: the pool is the worker's."""
