"""The client: spawn actors, send and ask them, read their state, journals and dead letters.

A :class:`Client` is what a program (a web handler, a script, the CLI, a test) uses to talk to
actors from outside. Everything it does is a row in Postgres: a send is a mailbox insert (which can
join the caller's own transaction), a spawn is an actor row, an ask is a send whose reply comes
back through ``toren.replies`` and a notification. A reader can also wait for an actor's journal to
grow (:meth:`Client.watch_journal`) instead of polling it.
"""

from __future__ import annotations

import contextlib
import logging
import math
import uuid
from collections.abc import AsyncIterator, Mapping, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any, TypeAlias

import anyio
import asyncpg
import attrs

from toren._core import mailbox as _mailbox
from toren._core.actor import Actor, AskFailed, actor_class
from toren._core.codec import decode
from toren._core.db import connect, create_pool
from toren._core.errors import (
    ActorAlreadyExists,
    AskTimeout,
    TorenError,
    UnknownActor,
    UnknownActorKind,
)
from toren._core.journal import ArchiveReader, JournalEntry, read_journal, rebuild

_ASK_POLL = 0.5
JOURNAL_CHANNEL = "toren_journal"
"""Notified, with the actor id as payload, in the transaction that appends to the journal of an
actor someone watches (:class:`JournalWatch`), and whenever the kernel records a dead letter or
a failure."""
WATCH_SECONDS = 60.0
"""How long a watch set on an actor's row lasts; a follower renews it at half that."""
# A row marked for three quarters of that or more is not written again: every stream opened on
# a run (a read token may open them in a loop) would otherwise write the run's row, whose lock
# a claim skips and a step's fence waits for. Such a mark still outlasts the follower's own
# next renewal (at half, plus at most a stream's safety re-read).
_WATCH = """
UPDATE toren.actors
SET watched_until = now() + make_interval(secs => $2)
WHERE actor_id = $1
  AND status = 'live'  -- a failed or stopped actor takes no step until it is live again
  AND (watched_until IS NULL OR watched_until < now() + make_interval(secs => $2 * 3 / 4))
"""

log = logging.getLogger("toren.client")

if TYPE_CHECKING:
    from asyncpg.pool import PoolConnectionProxy

    # A connection of the caller's (its own, or one borrowed from a pool), in its transaction.
    Connection: TypeAlias = asyncpg.Connection | PoolConnectionProxy[Any]


class AskError(TorenError):
    """The asked actor could not handle the message (it was dead-lettered)."""

    def __init__(self, actor_id: str, error: str) -> None:
        self.actor_id = actor_id
        self.error = error
        super().__init__(f"{actor_id} could not handle the message: {error}")


@attrs.frozen(kw_only=True)
class DeadLetter:
    """A message its actor gave up on."""

    id: int
    actor_id: str
    sender: str | None
    kind: str
    body: Any
    deliveries: int
    attempts: int
    error: str
    dead_at: Any


class JournalWatch:
    """Wakes whoever follows an actor's journal when the journal may have grown.

    It is woken by a ``toren_journal`` notification naming the actor, and also when the
    client's listening connection drops (notifications sent while it is down are lost, so a
    follower should read again). Use it as: :meth:`arm`, read the journal, :meth:`wait`; an
    append committed after :meth:`arm` returned always wakes it while the connection holds.

    Steps notify only for actors someone watches: :meth:`arm` marks the actor's row as watched
    (``watched_until``, for :data:`WATCH_SECONDS`, renewed at half that) after the listener is
    up and before the caller reads. A step locks that row as its fence and reads the mark from
    the version it locked, so a step in flight while the mark is set either sees it (and
    notifies) or holds the lock until it has committed (and the read that follows sees its
    events): nothing falls between. A row already marked for most of that time is left as it
    is (no write, no lock): a step that locked it before that mark was set had committed before
    the mark was, and any later one sees it.
    """

    def __init__(self, client: Client, actor_id: str) -> None:
        self.actor_id = actor_id
        self._client = client
        self._event = anyio.Event()
        self._renew_at = -math.inf

    @property
    def woken(self) -> bool:
        """Whether something happened since :meth:`arm` that calls for reading again."""
        return self._event.is_set()

    def wake(self) -> None:
        self._event.set()

    async def arm(self) -> None:
        """Forget earlier wake-ups and make sure the client listens for notifications,
        reopening its listening connection if it dropped. Call it before reading the journal.

        Raises:
            DatabaseUnavailable: the listening connection cannot be reopened.
        """
        if self._event.is_set():
            self._event = anyio.Event()
        await self._client._ensure_listener(journals=True)
        if anyio.current_time() >= self._renew_at:
            await self._client.pool.execute(_WATCH, self.actor_id, WATCH_SECONDS)
            self._renew_at = anyio.current_time() + WATCH_SECONDS / 2

    async def wait(self) -> None:
        """Until woken (at once if woken since :meth:`arm`). Bound it with a cancel scope."""
        await self._event.wait()


class Client:
    """A connection pool plus the public actor API.

    Use :meth:`connect` and close it when done (or ``async with``).
    """

    def __init__(self, pool: asyncpg.Pool, url: str) -> None:
        self.pool = pool
        self.url = url
        # Where a run's archived events are read when its snapshot does not cover them (a long
        # conversation's journal truncated): set by the CLI and the API from archive_store.
        self.archives: ArchiveReader | None = None
        self._listener: asyncpg.Connection | None = None
        self._waiters: dict[str, anyio.Event] = {}
        self._watches: dict[str, set[JournalWatch]] = {}
        self._listening_journals = False
        self._listener_lock = anyio.Lock()
        self._closing = False

    @classmethod
    async def connect(cls, url: str, *, pool_size: int = 5) -> Client:
        """Open a client on the database at ``url`` (schema already migrated).

        Raises:
            DatabaseUnavailable: Postgres cannot be reached.
        """
        return cls(await create_pool(url, size=pool_size), url)

    async def close(self) -> None:
        """Close the pool and the listening connection."""
        self._closing = True
        if self._listener is not None:
            await self._listener.close()
            self._listener = None
        await self.pool.close()

    async def __aenter__(self) -> Client:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def spawn(
        self,
        kind: str | type[Actor[Any]],
        actor_id: str,
        args: Mapping[str, Any] | None = None,
        *,
        parent: str | None = None,
        max_depth: int = 10000,
        route: str | None = None,
        conn: Connection | None = None,
        limits: Sequence[str] = (),
    ) -> bool:
        """Persist a new actor. It runs when its first message arrives.

        Spawning an existing id of the same kind is a no-op, so spawn is safe to repeat. With a
        ``route``, only workers serving that route claim the actor. With ``limits`` (names of
        concurrency limits, :mod:`toren._core.limits`), it runs only while it holds a permit of
        each, taken at its claim. Pass ``conn`` (a connection inside your transaction) to make
        the spawn part of it.

        Returns:
            True if the actor was created now, False if it existed.

        Raises:
            ActorAlreadyExists: ``actor_id`` belongs to an actor of another kind.
        """
        kind_name = kind if isinstance(kind, str) else kind.kind
        db = conn or self.pool
        # The column is named only when used: a spawn without limits is the statement it was.
        with_limits = ", limits" if limits else ""
        created = await db.fetchval(
            f"INSERT INTO toren.actors (actor_id, kind, args, parent, max_depth, route"
            f"{with_limits}) VALUES ($1, $2, $3, $4, $5, $6{', $7' if limits else ''}) "
            "ON CONFLICT (actor_id) DO NOTHING RETURNING true",
            actor_id,
            kind_name,
            dict(args or {}),
            parent,
            max_depth,
            route,
            *([list(limits)] if limits else []),
        )
        if created:
            return True
        existing = await db.fetchval("SELECT kind FROM toren.actors WHERE actor_id = $1", actor_id)
        if existing != kind_name:
            raise ActorAlreadyExists(actor_id, kind_name, str(existing))
        return False

    async def spawned(self, actor_id: str, *, conn: Connection) -> asyncpg.Record | None:
        """The kind and args of actor ``actor_id``, or ``None`` if there is none, in ``conn``'s
        transaction. A spawn of that id that another transaction has made and not yet committed
        is waited for (its row is found if it commits, not if it rolls back), as a spawn of the
        same id would wait: a read alone would miss it, and a caller deciding from it would act
        as if it did not exist. ``conn``'s transaction must be read committed (the default): in
        a stricter one, a row committed while it waited fails it with a serialization error.
        """
        # Only an insert waits for another transaction's uncommitted row of the same key. The
        # probe row is inserted in a savepoint rolled back at once: it is never seen or kept.
        probe = conn.transaction()
        await probe.start()
        try:
            free = await conn.fetchval(
                "INSERT INTO toren.actors (actor_id, kind) VALUES ($1, '') "
                "ON CONFLICT (actor_id) DO NOTHING RETURNING true",
                actor_id,
            )
        finally:
            await probe.rollback()
        if free:
            return None
        row: asyncpg.Record | None = await conn.fetchrow(
            "SELECT kind, args FROM toren.actors WHERE actor_id = $1", actor_id
        )
        return row

    async def send(
        self,
        to: str,
        msg: Any,
        *,
        dedupe_key: str | None = None,
        system: bool = False,
        delay: timedelta | float = 0.0,
        conn: Connection | None = None,
    ) -> int | None:
        """Persist ``msg`` in ``to``'s mailbox.

        Pass ``conn`` (a connection inside your transaction) to make the send part of it: the
        message exists if and only if your transaction commits.

        Returns:
            The message id, or ``None`` if ``dedupe_key`` was already used for ``to``.

        Raises:
            UnknownActor: no such actor.
            MailboxFull: the mailbox is at its depth limit (retryable).
        """
        seconds = delay.total_seconds() if isinstance(delay, timedelta) else float(delay)
        return await _mailbox.send(
            conn or self.pool, to, msg, system=system, dedupe_key=dedupe_key, delay=seconds
        )

    # The deadline is part of what ask() means (STYLE: timeouts as cancel scopes, except there).
    async def ask(
        self,
        to: str,
        msg: Any,
        *,
        timeout: float,  # noqa: ASYNC109
        system: bool = False,
    ) -> Any:
        """Send ``msg`` (on the system lane with ``system``) and wait for the handler's
        ``ctx.reply(...)``.

        Raises:
            AskTimeout: no reply within ``timeout`` seconds (the message may still be handled).
            AskError: the message was dead-lettered.
            UnknownActor, MailboxFull: as for :meth:`send`.
        """
        correlation = uuid.uuid4()
        key = str(correlation)
        await self._ensure_listener()
        event = self._waiters[key] = anyio.Event()
        try:
            await _mailbox.send(self.pool, to, msg, reply_to=correlation, system=system)
            with anyio.move_on_after(timeout):
                while True:
                    row = await self.pool.fetchrow(
                        "DELETE FROM toren.replies WHERE correlation_id = $1 RETURNING kind, body",
                        correlation,
                    )
                    if row is not None:
                        reply = decode(row["kind"], row["body"])
                        if isinstance(reply, AskFailed):
                            raise AskError(to, reply.error)
                        return reply
                    with anyio.move_on_after(_ASK_POLL):
                        await event.wait()
                    event = self._waiters[key] = anyio.Event()
        finally:
            self._waiters.pop(key, None)
        raise AskTimeout(to, timeout)

    @contextlib.asynccontextmanager
    async def watch_journal(self, actor_id: str) -> AsyncIterator[JournalWatch]:
        """A :class:`JournalWatch` on ``actor_id``'s journal while inside.

        Appends are notified while the actor is watched (:meth:`JournalWatch.arm` marks it),
        and so are the dead letters and failures the kernel records; the steps of actors
        nobody watches notify nothing (a notification takes a lock at commit that serializes
        every notifying commit in the database). A follower should still read again now and
        then: a notification is lost if the connection fails in a way the client does not see.
        """
        watch = JournalWatch(self, actor_id)
        self._watches.setdefault(actor_id, set()).add(watch)
        try:
            yield watch
        finally:
            watches = self._watches.get(actor_id)
            if watches is not None:
                watches.discard(watch)
                if not watches:
                    del self._watches[actor_id]

    async def _ensure_listener(self, *, journals: bool = False) -> None:
        async with self._listener_lock:
            conn = self._listener
            if conn is None or conn.is_closed():
                conn = await connect(self.url, name="toren-listener")
                try:
                    await conn.add_listener("toren_reply", self._on_reply)
                except BaseException:
                    conn.terminate()
                    raise
                conn.add_termination_listener(self._on_listener_lost)
                self._listener = conn
                self._listening_journals = False
            if journals and not self._listening_journals:
                await conn.add_listener(JOURNAL_CHANNEL, self._on_journal)
                self._listening_journals = True

    def _on_reply(self, _conn: object, _pid: int, _channel: str, payload: object) -> None:
        event = self._waiters.get(str(payload))
        if event is not None:
            event.set()

    def _on_journal(self, _conn: object, _pid: int, _channel: str, payload: object) -> None:
        for watch in self._watches.get(str(payload), ()):
            watch.wake()

    def _on_listener_lost(self, _conn: object) -> None:
        if self._closing:
            return
        # Whatever was notified while the connection was down is lost: everyone waiting reads
        # again (reopening the connection first), rather than at their next safety re-read.
        log.warning("the client's listening connection closed; reopening it")
        for watches in self._watches.values():
            for watch in watches:
                watch.wake()
        for event in self._waiters.values():
            event.set()

    async def journal(
        self, actor_id: str, *, after: int = 0, limit: int | None = None
    ) -> list[JournalEntry]:
        """The actor's stored events after ``after`` (the first ``limit`` of them, if given)."""
        return await read_journal(self.pool, actor_id, after=after, limit=limit)

    async def state(self, actor_id: str) -> tuple[Any, int]:
        """The actor's current state, read here (its snapshot, if it keeps them, and the events
        since, folded), and its last seq.

        Raises:
            UnknownActor: no such actor.
            UnknownActorKind: this process has no class for the actor's kind.
        """
        row = await self.pool.fetchrow(
            "SELECT kind, args FROM toren.actors WHERE actor_id = $1", actor_id
        )
        if row is None:
            raise UnknownActor(actor_id)
        cls = actor_class(row["kind"])
        if cls is None:
            raise UnknownActorKind(row["kind"], [])
        rebuilt = await rebuild(self.pool, cls(actor_id, row["args"]))
        return rebuilt.state, rebuilt.seq

    async def actor(self, actor_id: str) -> asyncpg.Record:
        """The actor's row: kind, status, failure, owner, epoch, lease.

        Raises:
            UnknownActor: no such actor.
        """
        row: asyncpg.Record | None = await self.pool.fetchrow(
            "SELECT * FROM toren.actors WHERE actor_id = $1", actor_id
        )
        if row is None:
            raise UnknownActor(actor_id)
        return row

    async def deadletters(
        self, *, actor_id: str | None = None, limit: int = 100
    ) -> list[DeadLetter]:
        """Dead-lettered messages, newest first."""
        rows = await self.pool.fetch(
            "SELECT * FROM toren.deadletters WHERE $1::text IS NULL OR actor_id = $1 "
            "ORDER BY dead_at DESC, id DESC LIMIT $2",
            actor_id,
            limit,
        )
        return [
            DeadLetter(
                id=r["id"],
                actor_id=r["actor_id"],
                sender=r["sender"],
                kind=r["kind"],
                body=r["body"],
                deliveries=r["deliveries"],
                attempts=r["attempts"],
                error=r["error"],
                dead_at=r["dead_at"],
            )
            for r in rows
        ]

    async def requeue(self, ids: list[int]) -> list[int]:
        """Put dead letters back at the end of their mailboxes, with fresh counts.

        Returns:
            The new message ids (dead letters that no longer exist are skipped).
        """
        new_ids: list[int] = await self.pool.fetchval(
            """
            WITH moved AS (
                DELETE FROM toren.deadletters WHERE id = ANY($1::bigint[]) RETURNING *
            ), ins AS (
                INSERT INTO toren.mailbox (actor_id, lane, sender, kind, body, reply_to)
                SELECT actor_id, lane, sender, kind, body, reply_to FROM moved ORDER BY id
                RETURNING id, actor_id
            )
            SELECT coalesce(array_agg(id ORDER BY id), '{}')
            FROM (SELECT id, pg_notify('toren_mail', actor_id) FROM ins) AS n
            """,
            ids,
        )
        return new_ids
