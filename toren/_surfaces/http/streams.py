"""Live event streams (``text/event-stream``), bounded in number, in time and by their caller.

A stream sends every event in order with its sequence number as the SSE ``id``, so a client
that reconnects with ``Last-Event-ID`` resumes without gaps or repeats, and a ``: ping`` comment
every 15 s keeps proxies from closing a quiet connection.

A stream that has sent everything there is reads the journal again only when woken: by the
``toren_journal`` notification the run's new events commit with (through the server's one
listening connection, :meth:`Client.watch_journal`), or when that connection drops. So an idle
stream runs no query, except a safety re-read every :data:`SAFETY` seconds in case a
notification was lost unseen. Its bounds:

- At most ``streams_max`` streams open at once in a server process, and at most
  ``streams_per_token`` per principal (a token and the console sessions opened with it count
  together). Past either the request is answered 429 with ``Retry-After``, before any stream
  starts. Each server process counts on its own: with N processes (``toren serve --workers
  N``, or behind a balancer) a client may hold up to N times these. A stream works on any
  process: each has its own listening connection.
- The caller's credentials are checked again at least every ``stream_recheck_seconds``
  (through the token cache, itself at most a second stale), and the stream closes once its
  token is revoked or expires, or its console session ends.
- A stream that has sent no event for ``stream_idle_seconds`` closes.

A stream closed by the server ends with ``event: toren.closed`` carrying ``{"reason": ...}``:
``revoked`` (the token was revoked or the console session ended), ``expired`` (the token
expired), ``idle``, ``stopping`` (the server is shutting down) or ``error`` (reading the journal
failed; the server logs why). That event has no ``id``, so the client's last event id stays its
last run event's, and reconnecting with it loses nothing.
"""

from __future__ import annotations

import contextlib
import logging
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator, Sequence
from typing import Literal

import anyio
import orjson
from aiohttp import web
from aiohttp_sse import EventSourceResponse, sse_response

from toren._core.client import JournalWatch
from toren._surfaces.http.auth import recheck
from toren._surfaces.http.common import CLIENT, OPTIONS, ProblemError, access, to_json
from toren._surfaces.http.models import Event
from toren._surfaces.tokens import Access

log = logging.getLogger("toren.http")

SAFETY = 5.0
"""Seconds between reads of the journal of a stream that nothing woke: the bound on how late an
event is if its notification was lost (the listening connection died without the server
seeing it)."""
GONE = 0.25
"""Seconds between checks that the client is still there while a stream waits (no query: the
connection's own state), so a client that left gives its slot back promptly."""
BATCH = 500
"""Events read at a time; a full batch is followed by the next without waiting."""
PING = 15.0
WRITE_TIMEOUT = 10.0
"""Seconds one write may wait on a client that does not read; then it is taken to have left."""
RETRY_AFTER = 5
CLOSED = "toren.closed"

Reason = Literal["revoked", "expired", "idle", "stopping", "error"]
Page = Callable[[int], Awaitable[Sequence[Event]]]
"""The events after a sequence number, in order, at most :data:`BATCH` of them."""


class Streams:
    """The streams open in this server process, in all and per principal, and whether the
    server is stopping (open streams then close)."""

    def __init__(self, most: int, per_principal: int) -> None:
        self.most = most
        self.per_principal = per_principal
        self.stopping = False
        self._open: Counter[str] = Counter()
        self._watches: set[JournalWatch] = set()

    def open(self, who: str | None = None) -> int:
        """Streams open, in all or held by principal ``who``."""
        return self._open.total() if who is None else self._open[who]

    @contextlib.contextmanager
    def slot(self, who: str) -> Iterator[None]:
        """Hold one stream for principal ``who`` while inside; it is given back however the
        block ends.

        Raises:
            ProblemError: 429 with ``Retry-After``, if this process or ``who`` already holds
                as many streams as allowed.
        """
        if self.open() >= self.most:
            raise _too_many(
                f"this server already holds {self.most} event streams open (streams_max); "
                f"reconnect in a few seconds"
            )
        if self._open[who] >= self.per_principal:
            raise _too_many(
                f"{who} already holds {self.per_principal} event streams open on this server "
                f"(streams_per_token); close one first"
            )
        self._open[who] += 1
        try:
            yield
        finally:
            self._open[who] -= 1
            if not self._open[who]:
                del self._open[who]

    @contextlib.contextmanager
    def waking(self, watch: JournalWatch) -> Iterator[None]:
        """Wake ``watch`` when the server starts stopping, while inside."""
        self._watches.add(watch)
        try:
            yield
        finally:
            self._watches.discard(watch)

    def stop(self) -> None:
        """Close every open stream (each sends ``toren.closed`` with ``stopping``)."""
        self.stopping = True
        for watch in self._watches:
            watch.wake()


def _too_many(detail: str) -> ProblemError:
    return ProblemError(429, "Too many streams", detail, headers={"Retry-After": str(RETRY_AFTER)})


STREAMS: web.AppKey[Streams] = web.AppKey("streams", Streams)


def install(app: web.Application) -> None:
    """Count ``app``'s streams (with its :data:`OPTIONS`' caps); close them when it stops."""
    options = app[OPTIONS]
    app[STREAMS] = Streams(options.streams_max, options.streams_per_token)
    app.on_shutdown.append(_stopping)


async def _stopping(app: web.Application) -> None:
    # aiohttp runs this before it waits for handlers to finish, so open streams can say why
    # they end instead of being cut off.
    app[STREAMS].stop()


async def stream(request: web.Request, actor_id: str, after: int, page: Page) -> web.StreamResponse:
    """Stream the events of ``actor_id`` after ``after`` (read with ``page``) to the caller
    until it leaves or a bound closes the stream (then with a ``toren.closed`` event saying why).

    Raises:
        ProblemError: 429, too many streams open (nothing has been sent yet).
    """
    caller = access(request)
    streams = request.app[STREAMS]
    with streams.slot(f"{caller.principal.kind}:{caller.principal.id}"):
        async with (
            request.app[CLIENT].watch_journal(actor_id) as watch,
            sse_response(request, ping_interval=PING) as sse,
        ):
            with streams.waking(watch):
                reason = await _follow(request, sse, after, page, caller, watch)
            if reason is not None:
                # The client may have left meanwhile: then there is no one to tell.
                try:
                    with anyio.fail_after(WRITE_TIMEOUT):
                        await sse.send(orjson.dumps({"reason": reason}).decode(), event=CLOSED)
                except (ConnectionResetError, TimeoutError):
                    if request.transport is not None:
                        request.transport.abort()
    return sse


async def _follow(
    request: web.Request,
    sse: EventSourceResponse,
    after: int,
    page: Page,
    caller: Access,
    watch: JournalWatch,
) -> Reason | None:
    """Send events until a bound says to stop (returns which) or the client leaves (None)."""
    options = request.app[OPTIONS]
    streams = request.app[STREAMS]
    last_sent = anyio.current_time()
    next_check = last_sent + options.stream_recheck_seconds
    next_read = last_sent  # at once
    try:
        while _connected(request, sse):
            if streams.stopping:
                return "stopping"
            if caller.expired():
                return "expired"
            if anyio.current_time() >= next_check:
                rechecked = await recheck(request)
                if rechecked is None:
                    return "expired" if caller.expired() else "revoked"
                caller = rechecked
                next_check = anyio.current_time() + options.stream_recheck_seconds
            if watch.woken or anyio.current_time() >= next_read:
                # Armed before the read: an event committed after it wakes the stream.
                await watch.arm()
                events = await page(after)
                for event in events:
                    # A client that stops reading would hold the write, and with it every bound.
                    with anyio.fail_after(WRITE_TIMEOUT):
                        await sse.send(to_json(event), id=str(event.seq), event=event.type)
                    after = event.seq
                now = anyio.current_time()
                if events:
                    last_sent = now
                next_read = now if len(events) == BATCH else now + SAFETY
            now = anyio.current_time()
            if now - last_sent >= options.stream_idle_seconds:
                return "idle"
            # Every bound keeps its time while the stream waits for a notification.
            until = min(next_read, next_check, last_sent + options.stream_idle_seconds, now + GONE)
            if until > now:
                with anyio.move_on_after(until - now):
                    await watch.wait()
    except (ConnectionResetError, TimeoutError):  # the client left, or stopped reading
        if request.transport is not None:
            request.transport.abort()  # nothing more is written to a client that is not there
        return None
    except Exception:
        log.exception("the event stream of %s failed", request.path)
        return "error"
    return None


def _connected(request: web.Request, sse: EventSourceResponse) -> bool:
    """Whether the client is still there: a lost connection is seen at once, not only when a
    write (the next event or ping) fails, so its stream's slot is given back promptly."""
    transport = request.transport
    return sse.is_connected() and transport is not None and not transport.is_closing()
