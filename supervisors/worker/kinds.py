"""The kinds a worker runs: the one list a new kind of Toren's is added to."""

from toren.actors.channels.kind import KIND as CHANNEL
from toren.actors.retention.kind import KIND as RETENTION
from toren.actors.runs.kind import KIND as RUN
from toren.actors.sandboxes.kind import KIND as SANDBOX
from toren.actors.schedules.kind import KIND as SCHEDULE

KINDS = (RUN, SANDBOX, CHANNEL, SCHEDULE, RETENTION)
"""Toren's own kinds, in the order their runtimes open (and the reverse of their closing)."""
