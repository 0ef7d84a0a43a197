"""A worker: the supervision tree of one process, and the services beside it.

:mod:`.tree` builds the tree (its kinds' actors under supervisors, the services below beside
them); :mod:`.hosts` keeps the actors that live here, :mod:`.dispatcher` claims the mail addressed
to them, :mod:`.lease_keeper` renews what this worker holds, :mod:`.death_watch` takes over from a
peer that died. None of the services is an actor kind.
"""

from toren.supervisors.worker.kinds import KINDS
from toren.supervisors.worker.tree import SessionLost, Worker, run_worker

__all__ = ["KINDS", "SessionLost", "Worker", "run_worker"]
