"""Connections to Postgres: the embedded server, pools with Toren's codecs, dedicated connections.

With no ``TOREN_DATABASE_URL``, Toren runs Postgres itself through the ``pgserver`` package: a real
Postgres 16 listening on a Unix socket in a data directory of ours. ``fsync`` and
``synchronous_commit`` are left at their defaults, so the embedded server is as durable as any.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote, urlsplit, urlunsplit

import asyncpg

from toren._core.errors import ConfigError, DatabaseUnavailable
from toren._core.json_text import dumps, loads

if TYPE_CHECKING:
    from toren._core.rows import Db

# Errors that say the database, or the way to it, failed (a dropped connection, a restart, a
# refused login, a conflict with a concurrent transaction, a cancelled statement), as opposed to
# a statement that is wrong. Worth retrying after a pause.
TRANSIENT_DB_ERRORS: tuple[type[BaseException], ...] = (
    OSError,
    asyncpg.InterfaceError,
    asyncpg.PostgresConnectionError,
    asyncpg.CannotConnectNowError,
    asyncpg.AdminShutdownError,
    asyncpg.CrashShutdownError,
    asyncpg.TooManyConnectionsError,
    asyncpg.SerializationError,
    asyncpg.DeadlockDetectedError,
    asyncpg.QueryCanceledError,
    # asyncpg reports a connection whose operation was cut mid-way this way on its next use.
    asyncpg.InternalClientError,
)


# What a URL that leads to no usable connection raises: asyncpg's TargetServerAttributeNotMatched
# is a server of each host up, none of the kind ``target_session_attrs`` asks for (with
# ``read-write``: every server a replica, as during a failover).
_CONNECT_ERRORS: tuple[type[BaseException], ...] = (
    OSError,
    ValueError,
    asyncpg.PostgresError,
    asyncpg.InterfaceError,
    asyncpg.TargetServerAttributeNotMatched,
)


@contextlib.asynccontextmanager
async def one_snapshot(db: Db) -> AsyncIterator[Any]:
    """A connection of ``db`` whose statements read one snapshot of the database: a read-only
    ``REPEATABLE READ`` transaction on a connection of the pool ``db``, or on the connection
    ``db``; ``db`` itself if it is in a transaction already (the caller's, whose isolation
    decides)."""
    if isinstance(db, asyncpg.Pool):
        async with (
            db.acquire() as conn,
            conn.transaction(isolation="repeatable_read", readonly=True),
        ):
            yield conn
    elif db.is_in_transaction():
        yield db
    else:
        async with db.transaction(isolation="repeatable_read", readonly=True):
            yield db


async def init_connection(conn: asyncpg.Connection) -> None:
    """Encode and decode ``jsonb`` on every connection Toren opens with :mod:`toren._core.json_text`
    (orjson, lossless for NUL and lone surrogates)."""
    await conn.set_type_codec("jsonb", encoder=dumps, decoder=loads, schema="pg_catalog")


async def _keep_session(conn: asyncpg.Connection) -> None:
    """What a connection going back to the pool needs: nothing beyond asyncpg's own clean-up.

    asyncpg rolls back a transaction left open before calling this; its default reset would
    then send ``RESET ALL; UNLISTEN *; ...``, one more round trip per statement. Toren's pooled
    connections never change session state (its LISTENs and advisory locks live on dedicated
    connections), so there is nothing to reset.
    """


async def create_pool(url: str, *, size: int = 10, name: str = "toren") -> asyncpg.Pool:
    """Open a pool of ``size`` connections, shown as ``name`` in ``pg_stat_activity``.

    A connection borrowed from it must leave the session as it found it (no ``SET``, ``LISTEN``
    or advisory lock outside a transaction): it is not reset when given back.

    Raises:
        DatabaseUnavailable: the server does not answer or refuses the login.
    """
    try:
        pool = await asyncpg.create_pool(
            url,
            min_size=min(2, size),
            max_size=size,
            init=init_connection,
            reset=_keep_session,
            server_settings={"application_name": name},
        )
    except _CONNECT_ERRORS as exc:
        raise _unavailable(url, exc) from _shown_cause(exc)
    return pool


async def connect(url: str, *, name: str = "toren") -> asyncpg.Connection:
    """Open one dedicated (never pooled) connection, shown as ``name`` in ``pg_stat_activity``.

    Dedicated connections carry session state a pool would reset: the worker's advisory lock and
    its LISTEN registrations (asyncpg's pool runs ``pg_advisory_unlock_all()`` on release).

    Raises:
        DatabaseUnavailable: the server does not answer or refuses the login.
    """
    try:
        conn = await asyncpg.connect(url, server_settings={"application_name": name})
    except _CONNECT_ERRORS as exc:
        raise _unavailable(url, exc) from _shown_cause(exc)
    try:
        await init_connection(conn)
    except BaseException:
        conn.terminate()  # cancelled (a worker stopping as it starts) or failed: not leaked
        raise
    return conn


def _unparsed(exc: BaseException) -> bool:
    """Whether ``exc`` is asyncpg failing to parse the URL itself (a plain ``ValueError``; its
    configuration errors are ``InterfaceError`` too, and name a parameter, not its value)."""
    return isinstance(exc, ValueError) and not isinstance(exc, asyncpg.InterfaceError)


def _unavailable(url: str, exc: BaseException) -> DatabaseUnavailable:
    """The error for a URL that did not lead to a connection. A URL that did not even parse
    is described, not quoted: asyncpg's message quotes the piece it failed on, and with an
    unescaped ``@`` or ``:`` in the password that piece is part of the password."""
    if _unparsed(exc):
        exc = ValueError(
            "the URL does not parse (asyncpg's reason is not shown: it may quote the "
            "password); percent-encode any @ : / ? # in the user name or password "
            "(@ is %40, : is %3A)"
        )
    if isinstance(exc, asyncpg.TargetServerAttributeNotMatched):
        exc = ConnectionError(
            "no server of the URL is what its target_session_attrs asks for (with read-write: "
            "every server is a replica, as while a failover is under way)"
        )
    return DatabaseUnavailable(redact(url), exc)


def _shown_cause(exc: BaseException) -> BaseException | None:
    """What a :class:`DatabaseUnavailable` is chained from (a logged traceback shows it):
    nothing for a URL that did not parse, for the reason given in :func:`_unavailable`."""
    return None if _unparsed(exc) else exc


_SECRET_PARAMETERS = frozenset({"password", "sslpassword"})


def redact(url: str) -> str:
    """The URL with any password (``user:PASSWORD@``, ``?password=``, ``?sslpassword=``)
    replaced by ``***``, safe for logs and errors. Text that is not a ``postgresql://`` URL
    (a typo, a ``key=value`` string) is not shown at all: where its password is cannot be
    told."""
    try:
        parts = urlsplit(url)
    except ValueError:
        parts = None
    if parts is None or parts.scheme not in ("postgres", "postgresql"):
        return "<the configured URL, not shown: it does not parse as postgresql://...>"
    userinfo, at, hosts = parts.netloc.rpartition("@")
    user, _, password = userinfo.partition(":")
    netloc = f"{user}:***@{hosts}" if at and password else parts.netloc
    query = "&".join(
        f"{key}=***" if unquote(key).lower() in _SECRET_PARAMETERS else piece
        for piece in parts.query.split("&")
        for key in [piece.partition("=")[0]]
    )
    return urlunsplit(parts._replace(netloc=netloc, query=query))


def with_database(url: str, dbname: str) -> str:
    """The same server URL pointing at another database."""
    parts = urlsplit(url)
    return urlunsplit(parts._replace(path=f"/{dbname}"))


class EmbeddedPostgres:
    """A Postgres server run by this process from a data directory (``pgserver``).

    The server stops when :meth:`stop` is called or the process that started it exits.
    """

    def __init__(self, data_dir: Path, *, keep_running: bool = False) -> None:
        with warnings.catch_warnings():
            # pgserver asks platformdirs for a runtime directory as it is imported; without
            # XDG_RUNTIME_DIR that warns and falls back to /tmp/runtime-<uid>, which works.
            warnings.filterwarnings("ignore", message=".*XDG_RUNTIME_DIR")
            import pgserver  # heavy import: only when the embedded server is used

        data_dir.mkdir(parents=True, exist_ok=True)
        try:
            self._server: Any = pgserver.get_server(  # type: ignore[attr-defined]
                data_dir, cleanup_mode=None if keep_running else "stop"
            )
        except Exception as exc:  # pgserver raises plain Exceptions for a broken data dir
            raise ConfigError(
                f"cannot start the embedded Postgres in {data_dir}: {exc}",
                hint="Remove the directory if it is left over from an old version, or set "
                "TOREN_DATABASE_URL to use a server of your own.",
            ) from exc
        self.data_dir = data_dir
        self.url: str = self._server.get_uri()

    def stop(self) -> None:
        """Stop the server (a no-op if another process still uses it)."""
        self._server.cleanup()
