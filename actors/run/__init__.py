"""The run kind's behaviour: an agent's model-call loop as an event-sourced actor.

:mod:`~toren.actors.run.actor` holds the actor; beside it, what its steps use: cross-agent calls
(:mod:`~toren.actors.run.calls`), sandboxed tools (:mod:`~toren.actors.run.sandboxing`),
approvals (:mod:`~toren.actors.run.deciding`), model calls announced before they are made
(:mod:`~toren.actors.run.inflight`), context compaction (:mod:`~toren.actors.run.compaction`) and
the bounded, recordable form of what a run receives (:mod:`~toren.actors.run.bounds`).
"""

from toren.actors.run.actor import RunActor, build_request, close_providers, parameters, verify

__all__ = ["RunActor", "build_request", "close_providers", "parameters", "verify"]
