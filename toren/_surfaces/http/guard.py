"""Failed authentications, limited per client address (``limits``' moving window, in memory).

Each server process counts on its own: with N processes behind a balancer a client address may
fail up to N times the limit per minute.
"""

from __future__ import annotations

import math
import time

from aiohttp import web
from limits import RateLimitItemPerMinute
from limits.storage import MemoryStorage
from limits.strategies import MovingWindowRateLimiter


class FailedAuth:
    """Failed sign-ins per client address: at ``per_minute`` failures within a minute the
    address is refused (429) until the oldest of them is a minute old."""

    def __init__(self, per_minute: int) -> None:
        self._limiter = MovingWindowRateLimiter(MemoryStorage())
        self._item = RateLimitItemPerMinute(per_minute)

    def blocked(self, address: str) -> int | None:
        """Seconds until ``address`` may try again, or None if it may now."""
        if self._limiter.test(self._item, address):
            return None
        reset = self._limiter.get_window_stats(self._item, address).reset_time
        return max(1, math.ceil(reset - time.time()))

    def failed(self, address: str) -> None:
        self._limiter.hit(self._item, address)


FAILED_AUTH: web.AppKey[FailedAuth] = web.AppKey("failed_auth", FailedAuth)
