"""Restart backoff: how long a supervisor waits before restarting a child that exited."""

from __future__ import annotations

from collections.abc import Callable

import attrs

# 2**64 times any sane base is far beyond any cap; clamping keeps huge attempt counts (a long-lived
# Postgres window) from overflowing the float exponent.
_MAX_EXPONENT = 64


def _not_above_one(_instance: object, attribute: attrs.Attribute[float], value: float) -> None:
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"{attribute.name} must be between 0 and 1, got {value!r}")


@attrs.frozen(kw_only=True)
class Backoff:
    """Doubling delays with jitter, capped.

    The n-th restart within a supervisor's period waits ``min(cap, base * 2**(n - 1))`` seconds,
    scaled by a random factor in ``[1 - jitter, 1 + jitter]`` so that siblings restarted together
    do not retry in lockstep. The jitter applies after the cap, so the longest wait is
    ``cap * (1 + jitter)``.

    Attributes:
        base: Delay before the first restart within the period, in seconds.
        cap: Largest delay before jitter, in seconds; at least ``base``.
        jitter: Relative spread of the random factor, between 0 and 1.

    Raises:
        ValueError: On construction, if a field is negative, ``cap < base``, or ``jitter`` is
            outside ``[0, 1]``.
    """

    base: float = attrs.field(default=0.05, validator=attrs.validators.ge(0.0))
    cap: float = attrs.field(default=5.0)
    jitter: float = attrs.field(default=0.2, validator=_not_above_one)

    @cap.validator
    def _cap_not_below_base(self, _attribute: attrs.Attribute[float], value: float) -> None:
        if value < self.base:
            raise ValueError(f"cap ({value!r}) must not be below base ({self.base!r})")

    def delay(self, attempt: int, random: Callable[[], float]) -> float:
        """The wait before restart number ``attempt`` within the period.

        Args:
            attempt: How many restarts fall within the period, this one included (1 or more).
            random: Returns a float in ``[0, 1)``; ``random.random`` in production, a constant in
                tests.

        Returns:
            The delay in seconds.

        Raises:
            ValueError: If ``attempt`` is below 1.
        """
        if attempt < 1:
            raise ValueError(f"attempt counts from 1, got {attempt}")
        nominal = min(self.cap, self.base * 2.0 ** min(attempt - 1, _MAX_EXPONENT))
        return nominal * (1.0 - self.jitter + 2.0 * self.jitter * random())
