"""The surfaces of Toren's own kinds, in the order of ``toren.supervisors.worker.KINDS``.

Each kind's ``Kind`` carries its ``Surfaces`` (``KIND.surfaces``); this list holds the same
values without the kinds' actors and runtimes, which the surfaces may not import and the CLI
should not pay for (``tests/test_floors.py`` checks the two lists agree). The CLI registers
their command groups, the HTTP app installs their routes, the MCP server adds their tools.
"""

from toren.channels.surfaces import SURFACES as CHANNEL
from toren.retention.surfaces import SURFACES as RETENTION
from toren.runs.surfaces import SURFACES as RUN
from toren.sandboxes.surfaces import SURFACES as SANDBOX
from toren.schedules.surfaces import SURFACES as SCHEDULE

SURFACES = (RUN, SANDBOX, CHANNEL, SCHEDULE, RETENTION)
"""The surfaces of Toren's kinds: run, sandbox, channel, schedule, retention."""
