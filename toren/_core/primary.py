"""Which server of a multi-host URL is the primary that commits: a worker's route to it.

A multi-host URL (``postgresql://u:p@h1:5432,h2:5432/db?target_session_attrs=read-write``)
has asyncpg try its servers in order and keep the first that accepts writes. After most
failovers that finds the new primary: the old one is down, or back as a read-only replica. One
failover it does not see through: a primary whose failover manager died (Patroni SIGKILLed)
stays up and read-write after its standby was promoted elsewhere, and its commits wait forever
for the synchronous standby it no longer has. ``read-write`` still picks it.

A :class:`Route` is the order a worker tries its URL's servers in. :meth:`Route.check` asks
each server to commit a write within a deadline: a transactional logical-decoding message
(``pg_logical_emit_message``: a few bytes of WAL in a transaction of its own, touching no
table, allowed to any user), whose commit waits for the synchronous standby like any step's (a
bare ``txid_current()`` would not: a transaction that wrote no WAL before its commit record does
not wait). It puts the servers that commit first, and leaves out those whose commit did not
answer (``stuck``) while one commits. A worker checks its route when an incarnation starts and
when a lease renewal times out; if the server its connections reach changed, it drops them
(:mod:`toren.supervisors.worker.tree`).

A commit that timed out on the client may still have committed on the server (here: locally on
the stale primary, never on the new one): its outcome is unknown, never taken for failed or
done. The worker does not retry it on the new server; it stops its actors, and whoever claims
them next finds each message consumed or still queued, as after any lost answer.
"""

from __future__ import annotations

import logging
from typing import Literal
from urllib.parse import urlsplit, urlunsplit

import anyio
import asyncpg

from toren._core.db import TRANSIENT_DB_ERRORS, redact

log = logging.getLogger("toren.leases")

_PROBE = "SELECT pg_logical_emit_message(true, 'toren', 'does this server commit?')"

_UNREACHABLE: tuple[type[BaseException], ...] = (
    TimeoutError,
    *TRANSIENT_DB_ERRORS,
    asyncpg.PostgresError,
)

Verdict = Literal["writable", "stuck", "read-only", "unreachable"]
_SAYS: dict[Verdict, str] = {
    "stuck": "does not commit (a primary without its synchronous standby?)",
    "unreachable": "does not answer",
    "writable": "commits",
    "read-only": "is a replica",
}


def hosts(url: str) -> list[str]:
    """The ``host:port`` entries of a URL's server list (one for a single-host URL)."""
    netloc = urlsplit(url).netloc
    return [h for h in netloc.rpartition("@")[2].split(",") if h]


def with_hosts(url: str, order: list[str]) -> str:
    """The same URL with its server list in ``order``."""
    parts = urlsplit(url)
    userinfo, at, _ = parts.netloc.rpartition("@")
    return urlunsplit(parts._replace(netloc=f"{userinfo}{at}{','.join(order)}"))


async def probe(url: str, host: str, within: float) -> Verdict:
    """Whether ``host`` (one of ``url``'s servers) commits a write within ``within`` seconds
    (the deadline is the question: a commit that does not answer by then is ``stuck``). The
    connection itself may take twice as long, at least a second: a busy machine is slow to
    connect (and to authenticate) without being a stale primary.

    Returns:
        ``writable``; ``stuck`` (connected, but the commit did not answer: a primary without
        its synchronous standby, or worse); ``read-only`` (a replica); ``unreachable``.
    """
    try:
        with anyio.fail_after(max(1.0, 2 * within)):
            conn = await asyncpg.connect(with_hosts(url, [host]))
    except asyncpg.TargetServerAttributeNotMatched:
        return "read-only"
    except _UNREACHABLE:
        return "unreachable"
    try:
        with anyio.fail_after(within):
            await conn.execute(_PROBE)
    except TimeoutError:
        return "stuck"
    except asyncpg.PostgresError:
        return "read-only"  # no WAL can be written during recovery
    except TRANSIENT_DB_ERRORS:
        return "unreachable"
    finally:
        conn.terminate()  # a stuck commit would keep a close waiting
    return "writable"


class Route:
    """The order a worker tries the servers of its database URL in (see the module docstring).

    With a single-host URL there is nothing to choose: :meth:`check` is not needed and
    :attr:`url` stays the URL given.
    """

    def __init__(self, url: str) -> None:
        self._url = url
        self.order = hosts(url)
        self.avoided: frozenset[str] = frozenset()
        """Servers left out of :attr:`url`: stuck when another committed, at the last check
        (asyncpg would fall back on them whenever the first server is slow to connect)."""

    @property
    def several(self) -> bool:
        """Whether the URL names more than one server."""
        return len(self.order) > 1

    @property
    def url(self) -> str:
        """The URL with its servers in the order to try them, without the avoided ones."""
        if not self.several:
            return self._url
        return with_hosts(self._url, [h for h in self.order if h not in self.avoided])

    async def check(self, within: float, *, avoided_too: bool = True) -> bool:
        """Probe every server at once (each given ``within`` seconds to commit); try the ones
        that commit first, and leave the stuck ones out while one commits (else try them last).
        Without ``avoided_too``, the servers left out are not probed again (each probe of a
        stuck server leaves a backend waiting there): they stay stuck for this check.

        Returns:
            Whether the server that connections reach changed: a server commits, and it is not
            the one they reached (the first server, in the old order, that is not a replica:
            now stuck or unreachable). A server that is merely slow everywhere changes nothing.
        """
        if not self.several:
            return False
        verdicts: dict[str, Verdict] = {}

        async def one(host: str) -> None:
            verdicts[host] = await probe(self._url, host, within)

        async with anyio.create_task_group() as tg:
            for host in self.order:
                if avoided_too or host not in self.avoided:
                    tg.start_soon(one, host)
                else:
                    verdicts[host] = "stuck"
        rank = {"writable": 0, "read-only": 1, "unreachable": 1, "stuck": 2}
        order = sorted(self.order, key=lambda h: rank[verdicts[h]])  # stable: ties keep order
        reached = next((h for h in self.order if verdicts[h] != "read-only"), order[0])
        moved = verdicts[order[0]] == "writable" and reached != order[0]
        if moved:
            log.warning(
                "the database server %s %s; moving to %s (%s)",
                reached,
                _SAYS[verdicts[reached]],
                order[0],
                redact(with_hosts(self._url, order)),
            )
        self.order = order
        writable = verdicts[order[0]] == "writable"
        self.avoided = frozenset(h for h in order if writable and verdicts[h] == "stuck")
        return moved
