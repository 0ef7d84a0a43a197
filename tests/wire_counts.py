"""Counting what a piece of Toren costs Postgres: a wire-protocol proxy and row counters.

Used by ``tests/test_counts.py``; two instruments, neither a mock (Toren and Postgres are real):

- :func:`counting_proxy`: a proxy on 127.0.0.1 for the Postgres frontend/backend protocol
  (version 3). It forwards every byte unchanged in both directions and parses the message
  streams on the way, counting over a :meth:`WireCounter.window`:

  - statements: each Execute (``E``) message, and each statement a simple Query (``Q``) runs,
    which is the number of CommandComplete (``C``) messages the server answers that Query with
    (a ``Q`` holding ``BEGIN; ...; COMMIT`` counts as each of its statements; an empty one as
    none);
  - round trips: each message after which the client waits for the server: Sync (``S``) and
    Query (``Q``), both answered by ReadyForQuery (``Z``), and Flush (``H``), which asyncpg
    sends after Parse and Describe when it prepares a statement and then waits for the
    description (a prepared statement costs a round trip of its own the first time);
  - transactions ended: a ReadyForQuery whose status is ``I`` (idle) after statements that ran
    in an implicit transaction (status ``I`` before them too), or after an explicit
    transaction (status ``T`` or ``E`` before). It ended in a commit unless an error was
    reported (implicit) or its last command was not ``COMMIT`` (explicit; the server answers
    a ``COMMIT`` of a failed transaction with ``ROLLBACK``);
  - the SQL text of each statement (from the Parse that prepared the named statement it
    executes, or the Query's text), and the ``application_name`` of its connection (from the
    StartupMessage), so that a failing test can print what ran;
  - prepared statements (Parse messages) and notifications delivered (``A``).

  The startup phase is handled as the protocol has it: an SSLRequest or GSSENCRequest is
  forwarded and answered by a single byte; ``N`` goes on in plain text, and a server that
  answers ``S`` (it wants TLS) fails the connection with a clear error (the proxy cannot read
  TLS). A CancelRequest is passed through untouched. The StartupMessage has no type byte.

- :func:`install_row_counters`: in the test's own database, statement-level ``AFTER INSERT``,
  ``UPDATE`` and ``DELETE`` triggers on every table of the ``toren`` schema, with transition
  tables, that add the number of rows per table and operation, with the writing transaction's
  id, to ``toren_counts.written`` (outside the ``toren`` schema). :func:`rows_written` reads
  them since a :func:`rows_mark`.

  Pitfalls of transition tables, and how they are met:

  - a trigger with a transition table may name one event only: three triggers per table;
  - a statement-level trigger fires even when the statement changed no row: the trigger writes
    nothing then (else it would itself make a read-only transaction write, and give it an id);
  - several data-modifying CTEs of one statement acting on the same table with the same
    operation (the step statement deletes from ``toren.mailbox`` twice: the message consumed
    and the timers replaced) share one transition table, and the trigger fires once for all of
    them (Postgres 10.0 on, the SQL standard's reading): rows are right, calls are not
    statements;
  - ``INSERT ... ON CONFLICT DO NOTHING`` shows only the rows inserted; ``ON CONFLICT DO
    UPDATE`` fires the update trigger for the rows it updated; an ``UPDATE ... FROM`` whose
    join matches a row several times updates it once and shows it once;
  - ``TRUNCATE`` has no transition tables and is not counted.
"""

from __future__ import annotations

import collections
import contextlib
import re
from collections.abc import AsyncIterator, Iterable, Iterator
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit, urlunsplit

import anyio
import anyio.abc
import asyncpg
import attrs

_SSL_REQUEST = 80877103
_GSSENC_REQUEST = 80877104
_CANCEL_REQUEST = 80877102
# Client messages after which the client waits for the server.
_WAITS = frozenset(b"SQHF")  # Sync, Query, Flush, FunctionCall


class ProxyError(Exception):
    """The proxy cannot relay this connection (the server wants TLS)."""


@attrs.define
class Statement:
    """One statement the server ran: its SQL and the connection's ``application_name``."""

    sql: str
    application: str
    count: int = 1  # a simple Query: the statements it ran (CommandComplete messages)

    def line(self, width: int = 110) -> str:
        text = " ".join(self.sql.split())
        text = text if len(text) <= width else text[: width - 3] + "..."
        times = f" (x{self.count})" if self.count != 1 else ""
        return f"[{self.application}] {text}{times}"


@attrs.define
class Seen:
    """What the server was asked over one window."""

    statements: list[Statement] = attrs.field(factory=list)
    round_trips: int = 0
    commits: int = 0  # transactions ended by a commit (implicit ones included)
    rollbacks: int = 0
    parses: int = 0  # statements prepared
    notifications: int = 0  # NotificationResponse messages delivered to clients

    @property
    def statement_count(self) -> int:
        return sum(s.count for s in self.statements)

    def texts(self) -> list[str]:
        return [s.sql for s in self.statements]

    def describe(self) -> str:
        """The window for an assertion message: the figures, then one line per statement."""
        lines = [
            f"statements {self.statement_count}, round trips {self.round_trips}, "
            f"commits {self.commits}, rollbacks {self.rollbacks}, prepared {self.parses}, "
            f"notifications {self.notifications}:"
        ]
        lines += [f"  {s.line()}" for s in self.statements]
        return "\n".join(lines)


class _Point:
    """A Sync or Query the client sent, waiting for its ReadyForQuery."""

    def __init__(self, query: Statement | None) -> None:
        self.query = query  # the simple Query's statement, whose count the server's replies set
        self.ran = False
        self.failed = False
        self.last_tag = ""


class _Connection:
    """The parsing state of one proxied connection."""

    def __init__(self, counter: WireCounter, application: str) -> None:
        self.counter = counter
        self.application = application
        self.prepared: dict[str, str] = {}  # statement name -> SQL
        self.portals: dict[str, str] = {}  # portal name -> SQL
        self.status = "I"
        self.points: collections.deque[_Point] = collections.deque()
        self.current = _Point(None)  # the extended-protocol messages since the last Sync

    def frontend(self, kind: int, body: bytes) -> None:
        counter = self.counter
        if kind == ord("P"):
            name, sql, _ = _strings(body, 2)
            self.prepared[name] = sql
            counter.add(self.application, parses=1)
        elif kind == ord("B"):
            portal, name, _ = _strings(body, 2)
            self.portals[portal] = self.prepared.get(name, f"<unknown statement {name!r}>")
        elif kind == ord("E"):
            portal = _strings(body, 1)[0]
            self.current.ran = True
            sql = self.portals.get(portal, f"<unknown portal {portal!r}>")
            counter.statement(Statement(sql, self.application))
        elif kind == ord("C"):
            name = _strings(body[1:], 1)[0]
            (self.prepared if body[:1] == b"S" else self.portals).pop(name, None)
        elif kind == ord("Q"):
            sql = _strings(body, 1)[0]
            query = Statement(sql, self.application, count=0)
            counter.statement(query)
            self.points.append(_Point(query))
        if kind in _WAITS:
            counter.add(self.application, round_trips=1)
        if kind == ord("S"):
            self.points.append(self.current)
            self.current = _Point(None)
        elif kind == ord("F"):  # a FunctionCall (asyncpg sends none) has a ReadyForQuery too
            self.points.append(_Point(None))

    def backend(self, kind: int, body: bytes) -> None:
        point = self.points[0] if self.points else self.current
        if kind == ord("C"):
            point.last_tag = body.rstrip(b"\0").decode(errors="replace")
            if point.query is not None:
                point.query.count += 1
                point.ran = True
        elif kind == ord("E"):
            point.failed = True
        elif kind == ord("A"):
            self.counter.add(self.application, notifications=1)
        elif kind == ord("Z"):
            before, self.status = self.status, chr(body[0])
            if self.points:
                self.points.popleft()
            if self.status != "I":
                return
            if before == "I" and point.ran:
                committed = not point.failed
            elif before in ("T", "E"):
                committed = point.last_tag == "COMMIT"
            else:
                return
            self.counter.add(self.application, commits=int(committed), rollbacks=int(not committed))


def _strings(body: bytes, n: int) -> tuple[Any, ...]:
    """The first ``n`` NUL-terminated strings of ``body``, and what follows them."""
    out = []
    at = 0
    for _ in range(n):
        end = body.index(b"\0", at)
        out.append(body[at:end].decode(errors="replace"))
        at = end + 1
    return (*out, body[at:])


class WireCounter:
    """The proxy's counts; see the module docstring. ``url`` leads to the database through it."""

    def __init__(self, url: str) -> None:
        self.target = url
        self.url = ""  # set once listening
        self._open: list[tuple[Seen, frozenset[str]]] = []
        self.connections = 0
        self.encryption_requests = 0  # SSLRequest and GSSENCRequest messages relayed

    @contextlib.contextmanager
    def window(self, *, ignore: Iterable[str] = ()) -> Iterator[Seen]:
        """Count what every connection (but those whose ``application_name`` is in ``ignore``)
        asks the server while inside."""
        seen = Seen()
        entry = (seen, frozenset(ignore))
        self._open.append(entry)
        try:
            yield seen
        finally:
            self._open.remove(entry)

    def statement(self, statement: Statement) -> None:
        for seen, ignore in self._open:
            if statement.application not in ignore:
                seen.statements.append(statement)

    def add(self, application: str, **counts: int) -> None:
        for seen, ignore in self._open:
            if application not in ignore:
                for name, n in counts.items():
                    setattr(seen, name, getattr(seen, name) + n)

    async def _connect_upstream(self) -> anyio.abc.ByteStream:
        parts = urlsplit(self.target)
        query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
        host = query.get("host") or unquote(parts.hostname or "") or "localhost"
        port = int(query.get("port") or parts.port or 5432)
        if host.startswith("/"):
            return await anyio.connect_unix(f"{host}/.s.PGSQL.{port}")
        return await anyio.connect_tcp(host, port)

    async def serve(self, client: anyio.abc.ByteStream) -> None:
        async with client, await self._connect_upstream() as server:
            self.connections += 1
            try:
                application = await self._startup(client, server)
            except (anyio.EndOfStream, anyio.BrokenResourceError, OSError):
                return  # the client went away during the startup
            if application is None:  # a CancelRequest: pass it through, parse nothing
                async with anyio.create_task_group() as tg:
                    tg.start_soon(_pipe, client, server, None, tg)
                    tg.start_soon(_pipe, server, client, None, tg)
                return
            conn = _Connection(self, application)
            async with anyio.create_task_group() as tg:
                tg.start_soon(_pipe, client, server, conn.frontend, tg)
                tg.start_soon(_pipe, server, client, conn.backend, tg)

    async def _startup(
        self, client: anyio.abc.ByteStream, server: anyio.abc.ByteStream
    ) -> str | None:
        """Relay the startup phase; the connection's ``application_name`` (None: a cancel)."""
        while True:
            head = await _read_exactly(client, 8)
            length, code = int.from_bytes(head[:4], "big"), int.from_bytes(head[4:], "big")
            body = await _read_exactly(client, length - 8)
            await server.send(head + body)
            if code in (_SSL_REQUEST, _GSSENC_REQUEST):
                self.encryption_requests += 1
                answer = await _read_exactly(server, 1)
                if answer != b"N":
                    what = "TLS" if code == _SSL_REQUEST else "GSS encryption"
                    raise ProxyError(
                        f"the server answered {answer!r} to a {what} request: the counting "
                        "proxy reads plain text only; use a server without it (the embedded "
                        "one) or have the client connect with sslmode=disable"
                    )
                await client.send(answer)
                continue
            if code == _CANCEL_REQUEST:
                return None
            fields = body.split(b"\0")
            params = dict(zip(fields[0:-1:2], fields[1::2], strict=False))
            return params.get(b"application_name", b"").decode(errors="replace")


async def _read_exactly(stream: anyio.abc.ByteStream, n: int) -> bytes:
    data = b""
    while len(data) < n:
        data += await stream.receive(n - len(data))
    return data


async def _pipe(
    source: anyio.abc.ByteStream,
    sink: anyio.abc.ByteStream,
    parse: Any,
    tg: anyio.abc.TaskGroup,
) -> None:
    """Forward ``source`` to ``sink`` unchanged; each complete message is parsed (``parse(type,
    body)``) before the bytes that complete it are forwarded, so a count is always taken
    before the other side can act on the message."""
    buffer = bytearray()
    try:
        while True:
            try:
                chunk = await source.receive()
            except (anyio.EndOfStream, anyio.BrokenResourceError, OSError):
                return
            if parse is not None:
                buffer += chunk
                while len(buffer) >= 5:
                    length = int.from_bytes(buffer[1:5], "big")
                    if len(buffer) < 1 + length:
                        break
                    parse(buffer[0], bytes(buffer[5 : 1 + length]))
                    del buffer[: 1 + length]
            try:
                await sink.send(chunk)
            except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
                return
    finally:
        tg.cancel_scope.cancel()  # one side closed: close the other


@contextlib.asynccontextmanager
async def counting_proxy(url: str) -> AsyncIterator[WireCounter]:
    """A :class:`WireCounter` listening on 127.0.0.1, in front of the database at ``url``;
    its ``url`` is ``url`` with host and port pointing at the proxy (``sslmode=disable``)."""
    counter = WireCounter(url)
    listener = await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=0)
    port = listener.extra(anyio.abc.SocketAttribute.local_port)
    parts = urlsplit(url)
    userinfo = parts.netloc.rpartition("@")[0]
    netloc = f"{userinfo}@127.0.0.1:{port}" if userinfo else f"127.0.0.1:{port}"
    kept = [p for p in parts.query.split("&") if p and p.split("=")[0] not in ("host", "port")]
    query = "&".join([*kept, "sslmode=disable"])
    counter.url = urlunsplit(parts._replace(netloc=netloc, query=query))
    async with listener, anyio.create_task_group() as tg:
        tg.start_soon(listener.serve, counter.serve, tg)
        try:
            yield counter
        finally:
            tg.cancel_scope.cancel()


# --- rows written, counted by the server --------------------------------------------------

_INSTALL = """
CREATE SCHEMA toren_counts;
CREATE TABLE toren_counts.written (
    id bigserial PRIMARY KEY,
    tbl text NOT NULL,
    op text NOT NULL,
    n bigint NOT NULL,
    xid xid8 NOT NULL
);
-- Nothing is written for a statement that changed no row: a read stays a read. Every trigger
-- names its transition table (new rows, or old rows for a delete) `changed`.
CREATE FUNCTION toren_counts.count_rows() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO toren_counts.written (tbl, op, n, xid)
    SELECT TG_TABLE_NAME, lower(TG_OP), count(*), pg_current_xact_id() FROM changed
    HAVING count(*) > 0;
    RETURN NULL;
END $$;
"""

_TRIGGERS = """
CREATE TRIGGER zz_count_insert AFTER INSERT ON toren.{t} REFERENCING NEW TABLE AS changed
    FOR EACH STATEMENT EXECUTE FUNCTION toren_counts.count_rows();
CREATE TRIGGER zz_count_update AFTER UPDATE ON toren.{t} REFERENCING NEW TABLE AS changed
    FOR EACH STATEMENT EXECUTE FUNCTION toren_counts.count_rows();
CREATE TRIGGER zz_count_delete AFTER DELETE ON toren.{t} REFERENCING OLD TABLE AS changed
    FOR EACH STATEMENT EXECUTE FUNCTION toren_counts.count_rows();
"""


async def install_row_counters(conn: asyncpg.Connection | asyncpg.Pool) -> list[str]:
    """Count rows written to every table of the ``toren`` schema (see the module docstring).

    Returns:
        The tables counted.
    """
    tables: list[str] = [
        r["relname"]
        for r in await conn.fetch(
            "SELECT c.relname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
            "WHERE n.nspname = 'toren' AND c.relkind IN ('r', 'p') AND NOT c.relispartition "
            "ORDER BY c.relname"
        )
    ]
    if not all(re.fullmatch(r"[a-z_]+", t) for t in tables):
        raise ValueError(f"unexpected table names in toren: {tables}")
    await conn.execute(_INSTALL + "".join(_TRIGGERS.format(t=t) for t in tables))
    return tables


async def rows_mark(conn: asyncpg.Connection | asyncpg.Pool) -> int:
    """Where the counts stand now (pass it to :func:`rows_written`)."""
    mark: int = await conn.fetchval("SELECT coalesce(max(id), 0) FROM toren_counts.written")
    return mark


@attrs.frozen
class Rows:
    """Rows written since a mark: per ``(table, operation)``, and the writing transactions."""

    by_table: dict[tuple[str, str], int]
    transactions: int

    def describe(self) -> str:
        shown = ", ".join(f"{t} {op} {n}" for (t, op), n in sorted(self.by_table.items()))
        return f"rows written: {shown or 'none'}; writing transactions: {self.transactions}"


async def rows_written(conn: asyncpg.Connection | asyncpg.Pool, mark: int) -> Rows:
    rows = await conn.fetch(
        "SELECT tbl, op, sum(n)::bigint AS n FROM toren_counts.written WHERE id > $1 "
        "GROUP BY tbl, op",
        mark,
    )
    xids: int = await conn.fetchval(
        "SELECT count(DISTINCT xid) FROM toren_counts.written WHERE id > $1", mark
    )
    return Rows({(r["tbl"], r["op"]): r["n"] for r in rows}, xids)
