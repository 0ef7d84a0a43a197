"""What a worker's sandbox actors share: the Docker client and the workspace store.

The worker opens them at boot (:func:`open_sandboxes`): if Docker answers, it serves the
``sandbox`` route, so sandbox actors are claimed only by workers that can run them, and it logs
whether sandboxes are available and why not.
"""

from __future__ import annotations

import hashlib
import logging
from typing import Any

import asyncpg

from toren import ConfigError, Context, Settings
from toren.actors.sandboxes.docker import Docker, Unavailable
from toren.runs import Agents
from toren.sandboxes import DEFAULT_IMAGE, SANDBOX_ROUTE
from toren.sandboxes.files import open_store
from toren.sandboxes.store import WorkspaceStore

log = logging.getLogger("toren.sandbox")

SCOPE_LABEL = "toren.scope"


async def database_scope(pool: asyncpg.Pool) -> str:
    """The identity of the database (its cluster's system identifier and its name), as a short
    label value: containers of one database are never taken for another's."""
    row = await pool.fetchrow(
        "SELECT (SELECT system_identifier FROM pg_control_system())::text AS system, "
        "current_database() AS name"
    )
    text = f"{row['system'] if row else ''}/{row['name'] if row else ''}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


class Sandboxes:
    """One worker's sandbox runtime: its Docker client and workspace store, or why it has none.

    Opened at the worker's start (:func:`open_sandboxes`), closed at its stop (:meth:`close`);
    sandbox actors find it in their worker's resources (:func:`of`).
    """

    def __init__(
        self,
        docker: Docker | None = None,
        store: WorkspaceStore | None = None,
        *,
        agents: Agents | None = None,
        why: str = "sandboxes are not set up in this process",
        scope: str = "",
    ) -> None:
        self._agents = agents  # whose routes serve ``sandbox`` while this runtime is open
        self._docker = docker
        self._store = store
        self.why = why
        self.scope = scope
        """The label value of this database's containers (see :func:`database_scope`)."""

    @property
    def available(self) -> bool:
        """Whether this worker runs sandboxes (Docker answers, the store is open)."""
        return self._docker is not None and self._store is not None

    def current(self) -> tuple[Docker, WorkspaceStore]:
        """The worker's Docker client and store.

        Raises:
            Unavailable: this worker has no sandboxes (the message says why).
        """
        if self._docker is None or self._store is None:
            raise Unavailable(self.why)
        return self._docker, self._store

    async def close(self) -> None:
        """Stop serving sandboxes and close the client and the store."""
        if self._agents is not None:
            self._agents.serve_route(SANDBOX_ROUTE, serve=False)
        docker, store = self._docker, self._store
        self._docker = self._store = None
        self.why = "this worker's sandboxes are closed"
        if docker is not None:
            await docker.close()
        if store is not None:
            await store.close()


def of(ctx: Context[Any]) -> Sandboxes:
    """The sandbox runtime of the worker hosting ``ctx``'s actor (one that says why there are
    no sandboxes, if that worker opened none)."""
    return ctx.resources.find(Sandboxes) or Sandboxes()


async def open_sandboxes(settings: Settings, pool: asyncpg.Pool, agents: Agents) -> Sandboxes:
    """Connect to Docker and open the workspace store; serve the ``sandbox`` route (among
    ``agents``' routes) if both work. Logs the outcome either way. The runtime returned says
    whether sandboxes are available here (:attr:`Sandboxes.available`) and why not."""
    if not settings.sandboxes:
        why = "sandboxes are turned off on this worker (sandboxes = false)"
        log.info("%s", why)
        return Sandboxes(why=why)
    try:
        docker = await Docker.connect()
    except Unavailable as exc:
        log.info("sandboxes unavailable on this worker: %s", exc)
        return Sandboxes(why=str(exc))
    try:
        await docker.check_image(DEFAULT_IMAGE)
        image = f"default image {DEFAULT_IMAGE} present"
    except Unavailable as exc:
        image = str(exc)
    try:
        store = open_store(settings)
    except ConfigError as exc:
        await docker.close()
        why = f"the workspace store cannot be opened: {exc}"
        log.error("sandboxes unavailable on this worker: %s", why)  # noqa: TRY400
        return Sandboxes(why=why)
    scope = await database_scope(pool)
    opened = Sandboxes(docker, store, agents=agents, why="", scope=scope)
    agents.serve_route(SANDBOX_ROUTE)
    log.info(
        "sandboxes available on this worker (Docker answers; %s; workspaces in %r)", image, store
    )
    return opened
