"""A run's model providers, what a call costs, and what a failed call does to the run.

Shared by the run's own model step and compaction's summary call: both ask through the same
provider, price alike and fail alike.
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
import time
from collections.abc import Iterable
from decimal import Decimal

import anyio
import attrs

from toren import ConfigError, Context
from toren.actors.runs.rates import Rates
from toren.kernel import MissingResource
from toren.providers import (
    ModelProvider,
    ProviderError,
    RetryPolicy,
    parse_model,
    provider_for,
)
from toren.providers import price as library_price
from toren.runs import Agent, Continue, ModelResponse, RunFailed, RunRetrying, RunState

log = logging.getLogger("toren.run")

_STEP_RETRY_BASE = 1.0
_STEP_RETRY_CAP = 300.0


class Providers:
    """One worker's model providers, one per model for the worker's life (they pool
    connections). The worker opens it at its start and closes it at its stop; runs find it in
    their worker's resources (:func:`provider`). ``rates``: the worker's shared rate limits,
    if it declares any (:mod:`toren.actors.runs.rates`)."""

    def __init__(self, rates: Rates | None = None) -> None:
        self._open: dict[str, ModelProvider] = {}
        self.rates = rates

    async def get(self, model: str) -> ModelProvider:
        """The provider of ``model``, made at its first use.

        Its retry policy reads ``TOREN_MODEL_RETRY_ATTEMPTS`` (default 6) and
        ``TOREN_MODEL_RETRY_BASE_SECONDS`` (default 0.5); past those the run's own step retry
        (a durable timer, up to the agent's ``max_attempts``) takes over. A model under a
        rate limit stops at a 429 with a retry-after: every worker waits it out
        (:func:`toren.actors.runs.rates.refused`).
        """
        found = self._open.get(model)
        if found is None:
            policy = RetryPolicy.from_env(os.environ)
            if self.rates is not None and self.rates.covering(model):
                policy = attrs.evolve(policy, max_retry_after=0.0)
            # In a thread: the first use imports the provider's SDK, which takes seconds and
            # must not stall the worker's event loop (its lease renewals run there).
            created = await anyio.to_thread.run_sync(lambda: provider_for(model, retry=policy))
            # Runs that started together may each have made one meanwhile: keep the first,
            # close the others (an unclosed one would leak its connections).
            found = self._open.setdefault(model, created)
            if found is not created:
                await created.aclose()
        return found

    async def preload(self, models: Iterable[str]) -> None:
        """Import the SDKs of ``models`` (their providers' modules) in a thread, one after
        another: an SDK's import takes seconds. The worker does it once it serves (registered,
        claiming), so that it starts serving without waiting for them, and a run's first call
        seldom waits for one. A call made meanwhile imports its SDK in its own thread
        (:meth:`get`), which waits for this import to end, never in the event loop.

        An SDK that fails to import is logged here; the calls that need it fail with it.

        An import allocates enough to set off full garbage collections, which stop the event
        loop while they scan the process's objects: ``toren worker`` freezes what it loaded
        before it registers (:func:`toren._cli.boot.boot_app`), so that they scan little.
        """
        names = set()
        for model in models:
            try:
                names.add(parse_model(model)[0])
            except ConfigError:  # the agent's runs report it, at their first call
                continue
        for name in sorted(names):
            module = f"toren.providers.{name}"
            if module in sys.modules:
                continue  # imported already (by a call, or an earlier incarnation)
            started = time.monotonic()
            try:
                await anyio.to_thread.run_sync(importlib.import_module, module)
            # An SDK missing or broken: its agents' calls raise it; the worker serves the rest.
            except Exception:
                log.warning("could not import %s ahead of its first call", module, exc_info=True)
                continue
            took = time.monotonic() - started
            log.info("imported the %s SDK in %.2fs, serving meanwhile", name, took)

    async def close(self) -> None:
        """As :meth:`aclose` (a kind's runtime, :class:`toren.kernel.Runtime`)."""
        await self.aclose()

    async def aclose(self) -> None:
        """Close every provider opened (their connection pools)."""
        providers = list(self._open.values())
        self._open.clear()
        for open_provider in providers:
            await open_provider.aclose()


async def provider(ctx: Context[RunState], model: str) -> ModelProvider:
    """The provider of ``model`` of the worker running ``ctx``'s run (see :class:`Providers`).

    Raises:
        toren.kernel.MissingResource: that worker opened no providers (not a worker's run).
    """
    found = ctx.resources.find(Providers)
    if found is None:
        raise MissingResource(Providers)
    return await found.get(model)


def rates_of(ctx: Context[RunState]) -> Rates | None:
    """The shared rate limits of the worker running ``ctx``'s run, if it declares any."""
    found = ctx.resources.find(Providers)
    return found.rates if found is not None else None


def price(provider: str, model_id: str, response: ModelResponse) -> Decimal | None:
    """The call's price; unpriced (``None``) if the price library cannot tell, whatever the
    usage the provider reported."""
    try:
        return library_price(provider, model_id, response.usage)
    except Exception:
        log.warning("could not price a call to %s/%s", provider, model_id, exc_info=True)
        return None


def failed_attempt(ctx: Context[RunState], agent: Agent, exc: ProviderError) -> None:
    """A model call failed after the provider's own retries: fail the run, or try the step
    again later (a durable timer) until the agent's attempts cap."""
    if not exc.retryable:
        ctx.emit(RunFailed(error_class="provider", message=str(exc)))
        return
    attempt = ctx.state.failed_attempts + 1
    if attempt >= agent.max_attempts:
        ctx.emit(
            RunFailed(
                error_class="attempts",
                message=f"{attempt} failed attempts at step {len(ctx.state.calls) + 1}: {exc}",
            )
        )
        return
    delay = min(_STEP_RETRY_CAP, _STEP_RETRY_BASE * 2 ** (attempt - 1))
    ctx.emit(RunRetrying(attempt=attempt, error=str(exc), delay=delay))
    ctx.set_timer("retry", delay, Continue())
