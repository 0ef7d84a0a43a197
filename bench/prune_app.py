"""What the prune benchmark's worker runs (``--app bench.prune_app``): the kernel step's
:class:`~bench.app.Counter`, and ``bench_retained``, an agent whose ended runs are kept for a
day and archived first, so that the worker runs its pruner (``retention/bench_retained``) beside
the steps, as a worker of an agent with a retention policy does. Its runs are written straight
into the tables by :mod:`bench.prune`; it never calls its model.

A module of its own so that the other sections' workers (``bench.app``) run no pruner.
"""

from __future__ import annotations

from bench.app import Counter, Tick, lookup
from toren import Agent, Retention

__all__ = ["Counter", "Tick", "bench_retained"]

bench_retained = Agent(
    name="bench_retained",
    model="anthropic/claude-sonnet-4-6",
    tools=[lookup],
    retention=Retention(keep_for="1d", archive=True),
)
