"""Shared provider rate limits, as a run's model step meets them.

Before a model call the step takes one request and its tokens from every limit covering the
call (its model's and its provider's, ``[rate_limits.NAME]``; see :mod:`toren._core.rates`),
reserving the announced estimate of its input (``model.calling``) plus its ``max_tokens``. If a
limit is full or blocked, nothing is sent: the step records ``rate.waited`` (which limit, why,
until when), sets a durable timer (``rate``) for then, and ends. The run stays ``running`` and
holds no lease meanwhile (the actor passivates); :class:`~toren.runs.RateWake` makes the step
again. The call stays announced and was not sent: the wake's message is a new one (claimed
once), so it is never counted as lost in flight (:mod:`toren.actors.runs.inflight`).

A provider's 429 with a retry-after on a call under a limit ends the provider's own retries at
once (its providers are made with ``max_retry_after`` 0), blocks every limit covering the call
until the worker's clock plus the retry-after, for every worker, and the run waits as above. A
429 without a retry-after, or on a call no limit covers, is retried as before.

Times are the worker's clock's (:class:`toren.kernel.Clock`): the window is computed from it
and passed to SQL; the timer is a delay (``until - now``) that Postgres adds to its own time.
A worker with no limits declared takes nothing and writes nothing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import attrs

from toren import Context
from toren.kernel import Clock, RateLimit, Refusal, block_rate, take_rate
from toren.providers import PROVIDERS, ProviderError
from toren.runs import Agent, ModelRequest, RateWaited, RateWake, RunState, estimate_tokens

if TYPE_CHECKING:
    import asyncpg

TIMER = "rate"


@attrs.frozen(kw_only=True)
class Rates:
    """A worker's declared rate limits, the pool they are taken through and its clock."""

    limits: tuple[RateLimit, ...]
    pool: asyncpg.Pool
    clock: Clock

    def covering(self, model: str) -> tuple[RateLimit, ...]:
        """The limits a call to ``model`` takes from, its provider's first."""
        provider = model.partition("/")[0]
        found = [limit for limit in self.limits if limit.name in (model, provider)]
        return tuple(sorted(found, key=lambda limit: limit.name not in PROVIDERS))


def waiting(state: RunState) -> bool:
    """Whether the run's announced model call waits on a rate limit."""
    return state.status == "running" and state.rate_wait is not None and state.calling is not None


async def held_back(
    ctx: Context[RunState], rates: Rates | None, agent: Agent, sent: ModelRequest
) -> bool:
    """Take from the limits covering ``sent``; ``True``: refused, the run waits (recorded)."""
    limits = rates.covering(agent.model) if rates is not None else ()
    if rates is None or not limits:
        return False
    calling = ctx.state.calling
    estimate = calling.input_tokens if calling is not None else estimate_tokens(sent)
    refusal = await take_rate(
        rates.pool, limits, now=rates.clock.now(), tokens=estimate + sent.max_tokens
    )
    if refusal is None:
        return False
    _wait(ctx, rates, refusal)
    return True


BLOCK_CAP = 3600.0
"""Seconds a 429's retry-after blocks a limit at most."""


async def refused(
    ctx: Context[RunState], rates: Rates | None, agent: Agent, exc: ProviderError
) -> bool:
    """After a 429 with a retry-after on a call under limits: block them for every worker and
    wait; ``False``: not such a failure (it is handled as before)."""
    limits = rates.covering(agent.model) if rates is not None else ()
    if rates is None or not limits or exc.status != 429 or exc.retry_after is None:
        return False
    # A provider's word, bounded: a block outlives no hour, and no run waits longer for it.
    until = rates.clock.now() + min(exc.retry_after, BLOCK_CAP)
    await block_rate(rates.pool, [limit.name for limit in limits], until)
    _wait(ctx, rates, Refusal(limit=limits[0], reason="blocked", until=until))
    return True


def _wait(ctx: Context[RunState], rates: Rates, refusal: Refusal) -> None:
    ctx.emit(
        RateWaited(
            limit=refusal.limit.name,
            caps=refusal.limit.caps(),
            reason=refusal.reason,
            until=refusal.until,
        )
    )
    ctx.set_timer(TIMER, max(0.0, refusal.until - rates.clock.now()), RateWake())
