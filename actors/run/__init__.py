"""The run kind's behaviour: an agent's model-call loop as an event-sourced actor.

:mod:`~toren.actors.run.actor` holds the actor and :mod:`~toren.actors.run.steps` what its steps
are made of; beside them, the request it makes and the digest chain that checks recorded calls
against it (:mod:`~toren.actors.run.request`), its model providers and prices
(:mod:`~toren.actors.run.models`), cross-agent calls (:mod:`~toren.actors.run.calls`), sandboxed
tools (:mod:`~toren.actors.run.sandboxing`), approvals (:mod:`~toren.actors.run.deciding`), model
calls announced before they are made (:mod:`~toren.actors.run.inflight`), context compaction
(:mod:`~toren.actors.run.compaction`, its summaries in :mod:`~toren.actors.run.summarising`) and
the bounded, recordable form of what a run receives (:mod:`~toren.actors.run.bounds`).
"""

from toren.actors.run.actor import RunActor
from toren.actors.run.request import build_request, parameters, verify

__all__ = ["RunActor", "build_request", "parameters", "verify"]
