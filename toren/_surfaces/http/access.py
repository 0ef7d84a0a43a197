"""The access log: one line per request, written off the request's path.

A request that ends adds its fields to a buffer: no formatting and no I/O while it is answered.
The buffer is written :data:`FLUSH_SECONDS` after its first line (a timer on the event loop, no
task), and when the application stops. Where it goes:

- when the only handler the ``toren.http.access`` logger reaches is Toren's own
  (:func:`toren._core.logs.configure`: ``toren serve``, ``up``, ``dev``), the lines are formatted
  as that handler formats a record, redacted as it redacts, and written to its stream in writes
  of whole lines of at most :data:`WRITE_MOST` bytes;
- otherwise (an application that embeds the API with logging of its own, or pytest's capture)
  each line is handed to the logger as its own record, timed when its request ended.

The logger's level decides as before: nothing is kept while it is not enabled for INFO. The
write is made on the event loop, as every log line's is: a stream that blocks holds the server
up as it did, and a write that fails loses its lines (reported by ``logging``'s handleError). At
most :data:`MOST` lines wait for a write; more are counted and said to be dropped in the next.
"""

from __future__ import annotations

import asyncio
import logging
import time

from toren._core.logs import TorenHandler, line_prefix, redact

FLUSH_SECONDS = 0.1
MOST = 20_000
# A line's format, with method, path, status, client address, principal and milliseconds as
# its arguments: a record made of it is the one a request logged before lines were batched (an
# application's filter or formatter may read its arguments).
LINE = "%s %s %s %s %s %.1fms"
DROPPED = "%d access log lines dropped (stream stalled)"
WRITE_MOST = 4096
"""Bytes of whole lines written at once at most: a pipe keeps a write of up to ``PIPE_BUF``
(4096 on Linux) whole, so the lines of several processes writing to one (``toren serve
--workers N``) never mix."""

logger = logging.getLogger("toren.http.access")

_Fields = tuple[str, str, int, str, str, float]  # as LINE's arguments


class AccessLog:
    """The lines of requests answered and not yet written (see the module)."""

    def __init__(self, log: logging.Logger = logger) -> None:
        self._log = log
        self._pending: list[tuple[float, _Fields]] = []
        self._dropped = 0
        self._timer: asyncio.TimerHandle | None = None

    def add(
        self, method: str, path: str, status: int, address: str, who: str, seconds: float
    ) -> None:
        """Keep one request's line: method, path (never the query), status, client address,
        principal, latency."""
        if not self._log.isEnabledFor(logging.INFO):
            return
        if len(self._pending) >= MOST:
            self._dropped += 1
            return
        self._pending.append((time.time(), (method, path, status, address, who, seconds * 1000)))
        if self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(FLUSH_SECONDS, self.flush)

    def flush(self) -> None:
        """Write every line kept (the timer's callback; also called when the app stops)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        lines, self._pending = self._pending, []
        dropped, self._dropped = self._dropped, 0
        if not lines and not dropped:
            return
        messages: list[tuple[float, str, tuple[object, ...]]] = [
            (at, LINE, fields) for at, fields in lines
        ]
        if dropped:
            messages.append((time.time(), DROPPED, (dropped,)))
        handler = _own_handler(self._log)
        if handler is None:
            for at, msg, args in messages:
                record = self._log.makeRecord(
                    self._log.name, logging.INFO, __file__, 0, msg, args, None
                )
                record.created, record.msecs = at, (at % 1) * 1000
                self._log.handle(record)
            return
        text = redact(
            "".join(
                f"{line_prefix(at)}INFO {self._log.name}: {msg % args}\n"
                for at, msg, args in messages
            )
        )
        if len(text.encode(errors="replace")) <= WRITE_MOST:
            handler.write(text)
            return
        chunk: list[str] = []
        size = 0
        for bare in text.removesuffix("\n").split("\n"):  # not splitlines: only \n ends one
            line = bare + "\n"
            length = len(line.encode(errors="replace"))
            if chunk and size + length > WRITE_MOST:
                handler.write("".join(chunk))
                chunk, size = [], 0
            chunk.append(line)
            size += length
        handler.write("".join(chunk))


def _own_handler(log: logging.Logger) -> TorenHandler | None:
    """Toren's handler, if it is the only one a record of ``log`` reaches and it takes INFO."""
    handlers: list[logging.Handler] = []
    current: logging.Logger | None = log
    while current is not None:
        if current.filters:
            return None  # a filter decides per record: records it gets
        handlers.extend(current.handlers)
        if not current.propagate:
            break
        current = current.parent
    if len(handlers) != 1 or not isinstance(handlers[0], TorenHandler) or handlers[0].filters:
        return None
    return handlers[0] if handlers[0].level <= logging.INFO else None
