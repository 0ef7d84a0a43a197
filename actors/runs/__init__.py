"""The run kind's behaviour: an agent's model-call loop as an event-sourced actor.

:mod:`~toren.actors.runs.actor` holds the actor and :mod:`~toren.actors.runs.steps` what its steps
are made of; beside them, the request it makes and the digest chain that checks recorded calls
against it (:mod:`~toren.actors.runs.request`), its model providers and prices
(:mod:`~toren.actors.runs.models`), cross-agent calls (:mod:`~toren.actors.runs.calls`), sandboxed
tools (:mod:`~toren.actors.runs.sandboxing`), approvals (:mod:`~toren.actors.runs.deciding`), model
calls announced before they are made (:mod:`~toren.actors.runs.inflight`), context compaction
(:mod:`~toren.actors.runs.compaction`, its summaries in :mod:`~toren.actors.runs.summarising`) and
the bounded, recordable form of what a run receives (:mod:`~toren.actors.runs.bounds`).
"""

from toren.actors.runs.actor import RunActor
from toren.actors.runs.request import build_request, parameters, verify

__all__ = ["RunActor", "build_request", "parameters", "verify"]
