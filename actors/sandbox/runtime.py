"""What a worker's sandbox actors share: the Docker client and the workspace store.

The worker opens them at boot (:func:`open_sandboxes`): if Docker answers, it serves the
``sandbox`` route, so sandbox actors are claimed only by workers that can run them, and it logs
whether sandboxes are available and why not.
"""

from __future__ import annotations

import hashlib
import logging

import asyncpg

from toren import ConfigError, Settings
from toren.actors.sandbox.docker import Docker, Unavailable
from toren.runs import serve_route
from toren.sandbox import DEFAULT_IMAGE, SANDBOX_ROUTE
from toren.sandbox.files import open_store
from toren.sandbox.store import WorkspaceStore

log = logging.getLogger("toren.sandbox")

_docker: Docker | None = None
_store: WorkspaceStore | None = None
_why = "sandboxes are not set up in this process"
_scope = ""

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


async def open_sandboxes(settings: Settings, pool: asyncpg.Pool) -> bool:
    """Connect to Docker and open the workspace store; serve the ``sandbox`` route if both
    work. Logs the outcome either way. Returns whether sandboxes are available here."""
    global _docker, _store, _why, _scope
    if not settings.sandboxes:
        _why = "sandboxes are turned off on this worker (sandboxes = false)"
        log.info("%s", _why)
        return False
    try:
        docker = await Docker.connect()
    except Unavailable as exc:
        _why = str(exc)
        log.info("sandboxes unavailable on this worker: %s", exc)
        return False
    try:
        await docker.check_image(DEFAULT_IMAGE)
        image = f"default image {DEFAULT_IMAGE} present"
    except Unavailable as exc:
        image = str(exc)
    try:
        store = open_store(settings)
    except ConfigError as exc:
        await docker.close()
        _why = f"the workspace store cannot be opened: {exc}"
        log.error("sandboxes unavailable on this worker: %s", _why)  # noqa: TRY400
        return False
    _docker, _store = docker, store
    _scope = await database_scope(pool)
    serve_route(SANDBOX_ROUTE)
    log.info(
        "sandboxes available on this worker (Docker answers; %s; workspaces in %r)", image, store
    )
    return True


async def close_sandboxes() -> None:
    """Stop serving sandboxes and close the client and the store."""
    global _docker, _store
    serve_route(SANDBOX_ROUTE, serve=False)
    docker, store = _docker, _store
    _docker = _store = None
    if docker is not None:
        await docker.close()
    if store is not None:
        await store.close()


def current() -> tuple[Docker, WorkspaceStore]:
    """The worker's Docker client and store.

    Raises:
        Unavailable: this process has no sandboxes (the message says why).
    """
    if _docker is None or _store is None:
        raise Unavailable(_why)
    return _docker, _store


def scope() -> str:
    """The label value of this database's containers (see :func:`database_scope`)."""
    return _scope
