"""The orphan reaper: removes sandbox containers whose run has ended.

A run that ends sends its sandbox ``sandbox.reap``, which removes the container. When that
cannot happen (the worker hosting the sandbox was killed and the run ended meanwhile, or the
database lost the sandbox), the container is an orphan. Every worker with Docker looks, at start
and every ``sandbox_reap_seconds`` (30 s by default), for the containers of its database whose
run has ended or does not exist, and removes them: an orphan lives at most about that long.

Containers are labelled with a scope (the database's identity), so that workers of another
database sharing the Docker daemon never reap each other's containers.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Mapping
from typing import Any

import anyio
import asyncpg
from aiodocker.exceptions import DockerError

from toren import Client, UnknownActor
from toren.actors.sandboxes.docker import Docker, Info
from toren.kernel import actor_rows
from toren.runs import ENDED
from toren.sandboxes import Reap

log = logging.getLogger("toren.sandbox")


async def orphans(pool: asyncpg.Pool, docker: Docker, scope: str) -> list[Info]:
    """The sandbox containers of this database whose run has ended or is unknown."""
    found = [i for i in await docker.list() if i.scope == scope]
    if not found:
        return []
    status = {r.actor_id: r.run_status for r in await actor_rows(pool, [i.run_id for i in found])}
    ended = [i for i in found if status.get(i.run_id, "gone") in (*ENDED, "gone")]
    # A command still running when its run ended (cancelled) runs to its end: its sandbox
    # reaps the container then, unless the kernel gave up on the sandbox.
    sandboxes = await actor_rows(
        pool, [i.sandbox_id for i in ended], fields=("summary.commands", "summary.finished")
    )
    busy = {s.actor_id for s in sandboxes if s.status == "live" and _running(s.summary_dict)}
    return [i for i in ended if i.sandbox_id not in busy]


def _running(summary: Mapping[str, Any]) -> bool:
    """Whether a sandbox's summary counts more commands sent than finished."""
    commands, finished = summary.get("commands"), summary.get("finished")
    # The sandbox writes both as integers; anything else is read as nothing running.
    return isinstance(commands, int) and isinstance(finished, int) and commands > finished


async def reap(pool: asyncpg.Pool, docker: Docker, scope: str) -> list[Info]:
    """Remove every orphan now, and tell its sandbox actor (if it is still known) so that its
    journal says so; returns those removed."""
    client = Client(pool, "")
    removed = []
    for info in await orphans(pool, docker, scope):
        try:
            await docker.remove(info.container_id)
        except DockerError as exc:
            log.warning("could not remove orphan sandbox %s: %s", info.name, exc)
            continue
        log.info("removed orphan sandbox %s (run %s ended)", info.name, info.run_id)
        removed.append(info)
        with contextlib.suppress(UnknownActor):
            await client.send(info.sandbox_id, Reap(), dedupe_key=f"reap:{info.container_id}")
    return removed


async def run_reaper(
    pool: asyncpg.Pool, docker: Docker, scope: str, every: float, started: Callable[[], None]
) -> None:
    """Reap at once, then every ``every`` seconds, until cancelled. A failed round is logged
    and tried again at the next: the reaper never ends the worker."""
    started()
    while True:
        try:
            await reap(pool, docker, scope)
        except (OSError, DockerError, asyncpg.PostgresError, asyncpg.InterfaceError) as exc:
            log.warning("sandbox reaper: %s; trying again in %gs", exc, every)
        await anyio.sleep(every)
