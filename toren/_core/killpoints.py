"""Named kill points: places in the kernel and the run actor where a chaos harness can freeze a
worker process, to fault it exactly there.

Disarmed (the default), :func:`kill_point` is one comparison and a return. A harness arms one
point per process through the environment:

- ``TOREN_KILL_POINT=name#k``: the ``k``-th time (default 1) this process reaches ``name``, it
  writes ``hit`` (a JSON line: point, occurrence, pid) into ``TOREN_KILL_POINT_DIR`` and blocks,
  the whole process with it, until a file named ``go`` appears there. Meanwhile the harness
  applies its fault: ``SIGKILL``, ``pg_terminate_backend`` on the worker's sessions, ``SIGSTOP``.
  The process is frozen at the point, so the fault lands there and nowhere else.
- ``TOREN_KILL_POINT_TRACE=path``: append the name of every point reached to ``path`` (a clean
  run traced this way tells a harness which points a scenario reaches, and how often).

The points are listed in :data:`POINTS` and documented in ``docs/chaos.md``. Besides those,
every event type ``t`` has two: ``committing:t`` (a step holding an event of type ``t`` is about
to commit) and ``committed:t`` (it did).
"""

from __future__ import annotations

import logging
import os
import time
from collections import Counter
from collections.abc import Iterable, Mapping
from pathlib import Path

import orjson

log = logging.getLogger("toren.killpoints")

POINTS: dict[str, str] = {
    "actor.claiming": "a worker is about to run its claim statement (every poll and wake-up)",
    "actor.claimed": "a claim statement returned at least one actor, not yet hosted",
    "actor.rebuilt": "a host rebuilt an actor's state from its journal, before on_start",
    "snapshot.writing": "a host is about to write an actor's snapshot (its step committed)",
    "snapshot.written": "a host wrote an actor's snapshot, before its next message",
    "truncation.archived": "a journal range was archived and verified, its rows not yet "
    "deleted nor the range recorded",
    "message.claimed": "a host claimed a message (delivery count raised), before handling it",
    "timer.fired": "the message claimed is a due durable timer, before handling it",
    "step.committing": "a message was handled; its step is about to commit",
    "step.committed": "a step committed: message consumed, events appended, sends inserted",
    "batch.sending": "a worker's group commit is about to send a batch of steps (more than one)",
    "batch.committed": "a batch's commit returned, no member of it told yet",
    "outbox.inserted": "a step that inserted messages (sends, timers) committed",
    "outbox.consumed": "a step consumed a message another actor's step had inserted",
    "lease.renewing": "the lease keeper is about to renew the leases it holds (at least one)",
    "lease.renewed": "the renewal statement returned",
    "deadletters.archived": "a batch of old dead letters is archived and checked, not deleted",
    "dev.postgres_starting": "toren dev is about to start its embedded Postgres (in a thread)",
    "dev.migrating": "toren dev has its database, about to apply the migrations",
    "shutdown.draining": "the worker received SIGTERM and is about to drain",
    "shutdown.released": "the worker drained and released its leases, about to exit",
    "model.sending": "a run is about to send a model request (no transaction open)",
    "model.received": "a run has the model's response, not yet recorded",
    "tool.running": "a run is about to run a tool whose intent is recorded",
    "decision.received": "a run is handling an approval decision, not yet recorded",
    "compaction.summarising": "a run is about to send a compaction's summary request",
    "compaction.summarised": "a run has a compaction's summary, not yet recorded",
    "child.starting": "a run is about to start a child run (a cross-agent call), not yet recorded",
    "child.finished": "a run is recording a child run's end, not yet committed",
    "sandbox.creating": "a sandbox is about to create its container (none found by its labels)",
    "sandbox.starting": "a sandbox is about to start its container (new, or stopped)",
    "sandbox.executing": "a sandbox is about to run a command whose intent is recorded",
    "sandbox.executed": "a sandbox ran a command, its result not yet recorded",
    "sandbox.checkpointing": "a sandbox uploaded a checkpoint, not yet recorded",
    "telegram.polled": "a channel has updates from getUpdates, not yet recorded",
    "telegram.sending": "a channel is about to send a message whose record is queued",
    "telegram.sent": "Telegram accepted a channel's message, its delivery not yet recorded",
    "telegram.enqueued": "the webhook route enqueued an update for its channel, not yet answered",
    "prune.read": "a prune batch read (and archived) its trees, before its deleting transaction",
    "prune.deleting": "a prune batch wrote its audit records and deleted, not yet committed",
}

ENV_POINT = "TOREN_KILL_POINT"
ENV_DIR = "TOREN_KILL_POINT_DIR"
ENV_TRACE = "TOREN_KILL_POINT_TRACE"

_WAIT_LIMIT = 600.0  # a harness that never says go does not hang the worker for ever


class _Armed:
    def __init__(self, point: str | None, occurrence: int, folder: Path, trace: Path | None):
        self.point = point
        self.occurrence = occurrence
        self.folder = folder
        self.trace = trace
        self.seen: Counter[str] = Counter()


_armed: _Armed | None = None


def arm(environ: Mapping[str, str] = os.environ) -> None:
    """Arm (or disarm) this process from ``environ``; the worker calls it once at boot.

    Raises:
        ValueError: ``TOREN_KILL_POINT`` is malformed, or set without ``TOREN_KILL_POINT_DIR``.
    """
    global _armed
    spec = environ.get(ENV_POINT, "").strip()
    trace = environ.get(ENV_TRACE, "").strip()
    if not spec and not trace:
        _armed = None
        return
    point, occurrence = None, 1
    if spec:
        point, _, k = spec.partition("#")
        occurrence = int(k) if k.isdigit() else (1 if not k else 0)
        if occurrence < 1 or not point:
            raise ValueError(  # the value is not shown: a misplaced secret must not be printed
                f"{ENV_POINT} must be 'name' or 'name#k' with k >= 1 (the value is not shown)"
            )
        if not environ.get(ENV_DIR):
            raise ValueError(f"{ENV_POINT} is set but {ENV_DIR} is not")
    _armed = _Armed(
        point, occurrence, Path(environ.get(ENV_DIR, ".")), Path(trace) if trace else None
    )
    if point:
        log.warning("kill point armed: %s (occurrence %d)", point, occurrence)


def kill_point(name: str) -> None:
    """Mark that this process reached kill point ``name``; blocks there if armed for it."""
    if _armed is None:
        return
    _reach(_armed, name)


def kill_points_for(prefix: str, types: Iterable[str]) -> None:
    """Reach ``prefix + t`` for each distinct event type ``t`` (in first-seen order)."""
    if _armed is None:
        return
    for t in dict.fromkeys(types):
        _reach(_armed, prefix + t)


def _reach(armed: _Armed, name: str) -> None:
    armed.seen[name] += 1
    if armed.trace is not None:
        with armed.trace.open("a") as f:
            f.write(name + "\n")
    if name != armed.point or armed.seen[name] != armed.occurrence:
        return
    report = {"point": name, "occurrence": armed.occurrence, "pid": os.getpid(), "at": time.time()}
    tmp = armed.folder / f"hit.{os.getpid()}"
    tmp.write_bytes(orjson.dumps(report))
    tmp.rename(armed.folder / "hit")
    log.warning(
        "kill point %s reached (occurrence %d); frozen until told to go", name, armed.seen[name]
    )
    go = armed.folder / "go"
    deadline = time.monotonic() + _WAIT_LIMIT
    # Blocking on purpose: the whole process stands still at this point, as a killed one would.
    while not go.exists() and time.monotonic() < deadline:
        time.sleep(0.002)
    log.warning("kill point %s: going on", name)
