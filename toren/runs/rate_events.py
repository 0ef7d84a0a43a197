"""A run's waits on shared provider rate limits: the event that records one and the message that
ends it (see :mod:`toren.actors.runs.rates`). A module of their own: ``events`` is full."""

from __future__ import annotations

import attrs

from toren._core.codec import message
from toren.runs.events import FORMAT


@message("rate.waited")
@attrs.frozen(kw_only=True)
class RateWaited:
    """The step's model call was not sent: the shared rate limit ``limit`` (caps ``caps``,
    such as ``50 requests/min``) is full of ``reason`` (``requests`` or ``tokens``) for this
    minute, or ``blocked`` after a provider's 429. The run holds no lease meanwhile; a timer
    tries again at ``until`` (seconds since the epoch, of the worker's clock)."""

    limit: str
    caps: str
    reason: str
    until: float
    v: int = FORMAT


@message("run.rate_wake")
@attrs.frozen
class RateWake:
    """Try the model call a rate limit held back again (its timer fired, or someone woke the
    run). Ignored unless the run waits on a rate limit (``rate.waited``)."""
