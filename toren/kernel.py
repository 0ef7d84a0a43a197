"""The kernel API that the worker's own processes (``actors/``, ``supervisors/``) are built on.

Application code rarely needs this module: it uses :class:`toren.Actor`, :class:`toren.Client`
and the worker. The lease keeper, the dispatcher and the worker tree use what is exported here,
and only this, so that the kernel's internals can change without touching them.
"""

from toren._core.actor import actor_kinds
from toren._core.clock import Clock, ShiftedClock
from toren._core.codec import decode
from toren._core.db import (
    TRANSIENT_DB_ERRORS,
    EmbeddedPostgres,
    connect,
    create_pool,
)
from toren._core.deadletters import archive_old_deadletters
from toren._core.group_commit import BatchOutcomeUnknown, GroupCommit
from toren._core.host import ActorHost, MessageDeadLettered
from toren._core.journal_reads import events, events_after, last_seq
from toren._core.json_text import dumps as json_text
from toren._core.json_text import safe_text, utf8_size
from toren._core.killpoints import kill_point
from toren._core.kinds import Kind, Runtime, Service, WorkerEnv
from toren._core.leases import (
    Claim,
    LeaseClock,
    claim,
    mark_failed,
    release,
    release_claim,
    renew,
    waiting,
)
from toren._core.migrate import migrate, schema_status
from toren._core.primary import Route
from toren._core.rates import RateLimit, Refusal, rate_windows, window_of
from toren._core.rates import block as block_rate
from toren._core.rates import take as take_rate
from toren._core.resources import MissingResource, Resources
from toren._core.rows import ActorRow, actor_row, actor_rows, actors_of_kind, set_args
from toren._core.session import WorkerSession, code_version
from toren._core.singletons import singleton
from toren._core.surfaces import Surfaces
from toren._core.terminal import printable
from toren._core.truncation import Archives
from toren._core.workers import (
    housekeep,
    live_workers,
    open_death_watch,
    ring_position,
    successor,
    wait_for_death,
)

__all__ = [
    "TRANSIENT_DB_ERRORS",
    "ActorHost",
    "ActorRow",
    "Archives",
    "BatchOutcomeUnknown",
    "Claim",
    "Clock",
    "EmbeddedPostgres",
    "GroupCommit",
    "Kind",
    "LeaseClock",
    "MessageDeadLettered",
    "MissingResource",
    "RateLimit",
    "Refusal",
    "Resources",
    "Route",
    "Runtime",
    "Service",
    "ShiftedClock",
    "Surfaces",
    "WorkerEnv",
    "WorkerSession",
    "actor_kinds",
    "actor_row",
    "actor_rows",
    "actors_of_kind",
    "archive_old_deadletters",
    "block_rate",
    "claim",
    "code_version",
    "connect",
    "create_pool",
    "decode",
    "events",
    "events_after",
    "housekeep",
    "json_text",
    "kill_point",
    "last_seq",
    "live_workers",
    "mark_failed",
    "migrate",
    "open_death_watch",
    "printable",
    "rate_windows",
    "release",
    "release_claim",
    "renew",
    "ring_position",
    "safe_text",
    "schema_status",
    "set_args",
    "singleton",
    "successor",
    "take_rate",
    "utf8_size",
    "wait_for_death",
    "waiting",
    "window_of",
]
