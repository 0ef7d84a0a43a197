"""Supervision trees: restart children by OTP's rules, on anyio task groups.

:class:`Supervisor` runs a fixed, ordered list of children under a :class:`Strategy`;
:class:`DynamicSupervisor` runs children added at run time, each restarted on its own. Either can
be a child of a :class:`Supervisor`, so trees nest; an escalation reaches the parent as its
child's abnormal exit. Errors raised here::

    toren.TorenError
    ├── toren.SupervisorEscalation  a supervisor (or one dynamic child) exceeded its intensity
    ├── SupervisorNotRunning        start_child() on a dynamic supervisor that is not running
    ├── ChildAlreadyRunning         start_child() with an id the supervisor already holds
    ├── TooManyChildren             start_child() beyond max_children (retryable)
    └── ChildStartFailed            the child exited before calling ctx.started()
"""

from toren.supervisors._backoff import Backoff
from toren.supervisors._dynamic import (
    ChildAlreadyRunning,
    ChildStartFailed,
    DynamicSupervisor,
    SupervisorNotRunning,
    TooManyChildren,
)
from toren.supervisors._supervisor import (
    ChildContext,
    ChildSpec,
    Ready,
    Restart,
    Strategy,
    Supervisor,
)

__all__ = [
    "Backoff",
    "ChildAlreadyRunning",
    "ChildContext",
    "ChildSpec",
    "ChildStartFailed",
    "DynamicSupervisor",
    "Ready",
    "Restart",
    "Strategy",
    "Supervisor",
    "SupervisorNotRunning",
    "TooManyChildren",
]
