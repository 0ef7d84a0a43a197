"""The kernel API that the worker's own processes (``actors/``, ``supervisors/``) are built on.

Application code rarely needs this module: it uses :class:`toren.Actor`, :class:`toren.Client`
and the worker. The lease keeper, the dispatcher and the worker tree use what is exported here,
and only this, so that the kernel's internals can change without touching them.
"""

from toren._db import EmbeddedPostgres, connect, create_pool, record_dev_url, recorded_dev_url
from toren._host import ActorHost, MessageDeadLettered
from toren._leases import (
    Claim,
    WorkerSession,
    claim,
    code_version,
    forget_dead_workers,
    live_workers,
    mark_failed,
    open_death_watch,
    release,
    renew,
    waiting,
    watch_successor,
)
from toren._migrate import migrate, schema_status

__all__ = [
    "ActorHost",
    "Claim",
    "EmbeddedPostgres",
    "MessageDeadLettered",
    "WorkerSession",
    "claim",
    "code_version",
    "connect",
    "create_pool",
    "forget_dead_workers",
    "live_workers",
    "mark_failed",
    "migrate",
    "open_death_watch",
    "record_dev_url",
    "recorded_dev_url",
    "release",
    "renew",
    "schema_status",
    "waiting",
    "watch_successor",
]
