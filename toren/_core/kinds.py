"""A kind as a worker runs it: one value naming its actor classes, the runtime its actors
share on a worker, the services that run beside them, and its surfaces (named, not imported).

A worker is composed from a list of kinds (``toren.supervisors.worker.KINDS`` for Toren's own;
an app may add its own). At its start it opens each kind's runtime, in order, and lends it to
the actors (``ctx.resources``); each incarnation runs each kind's services under its supervisor;
at its stop it closes the runtimes in reverse order. A kind whose actors need nothing of the
worker is its actor classes alone.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol

import asyncpg
import attrs

from toren._core.actor import Actor
from toren._core.resources import Resources
from toren._core.surfaces import Surfaces


class Runtime(Protocol):
    """What a kind's actors share on one worker (a Docker client, bots, model clients)."""

    async def close(self) -> None:
        """Release what it holds; the worker calls it once, at its stop."""
        ...


@attrs.frozen(kw_only=True)
class WorkerEnv:
    """What a kind's runtime and services are opened with.

    Attributes:
        settings: The worker's settings (``toren.Settings``: each kind reads its own fields).
        pool: The worker's pool.
        resources: What the worker lends its actors, with the runtimes of the kinds before
            this one and the worker's agents.
        on: Whether this worker runs the kind's runtime (a worker may be told not to, as
            ``toren dev`` does not ask Docker when no agent has a sandbox).
    """

    settings: Any
    pool: asyncpg.Pool
    resources: Resources
    on: bool = True


@attrs.frozen(kw_only=True)
class Service:
    """A task a kind runs beside its actors in each incarnation of a worker (supervised with
    them: its failure ends the incarnation). ``run`` calls ``started`` once it is up."""

    id: str
    run: Callable[[Callable[[], None]], Awaitable[None]]


@attrs.frozen(kw_only=True)
class Kind:
    """One kind of actor, as a worker runs it.

    Attributes:
        name: The kind's name (its actors' ``kind``, or the family of them).
        actors: Its actor classes (defining them registers their kinds).
        open: ``(env) -> runtime``, awaited at the worker's start; the runtime is put in the
            worker's resources under its own type and closed at the worker's stop.
        services: ``(env, runtime) -> services`` to run in each incarnation beside the actors.
        surfaces: Its CLI commands, HTTP routes and MCP tools, named by import string and
            resolved by the surface that shows them (:class:`~toren._core.surfaces.Surfaces`).
    """

    name: str
    actors: tuple[type[Actor[Any]], ...]
    open: Callable[[WorkerEnv], Awaitable[Runtime]] | None = None
    services: Callable[[WorkerEnv, Any], Sequence[Service]] | None = None
    surfaces: Surfaces = attrs.field(factory=Surfaces)
