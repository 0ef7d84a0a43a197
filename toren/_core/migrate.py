"""Versioned SQL migrations, applied in order, safe when several workers migrate at once.

Migrations are the files ``toren/_core/migrations/NNNN_name.sql``. Each applies in its own
transaction
under a transaction-level advisory lock, so two processes starting together serialize: the second
waits, then finds nothing left to do. All objects live in schema ``toren``.
"""

from __future__ import annotations

import logging
import re
from importlib import resources

import asyncpg

from toren._core.errors import MigrationError

log = logging.getLogger("toren.migrate")

_LOCK = 0x746F72  # "tor": pg_advisory_xact_lock key guarding migrations
_NAME = re.compile(r"^(\d{4})_(\w+)\.sql$")


def available() -> list[tuple[int, str, str]]:
    """Every migration shipped with this version: (version, name, sql), in order."""
    found = []
    for entry in resources.files("toren._core.migrations").iterdir():
        match = _NAME.match(entry.name)
        if match:
            found.append((int(match[1]), match[2], entry.read_text()))
    return sorted(found)


async def migrate(conn: asyncpg.Connection) -> list[int]:
    """Bring schema ``toren`` up to date.

    Returns:
        The versions applied now (empty when the schema was current).

    Raises:
        MigrationError: a migration failed; it was rolled back and later ones were not tried.
    """
    applied: list[int] = []
    for version, name, sql in available():
        async with conn.transaction():
            await conn.execute("SELECT pg_advisory_xact_lock($1)", _LOCK)
            await conn.execute(
                "CREATE SCHEMA IF NOT EXISTS toren; "
                "CREATE TABLE IF NOT EXISTS toren.schema_migrations ("
                " version integer PRIMARY KEY, name text NOT NULL,"
                " applied_at timestamptz NOT NULL DEFAULT now())"
            )
            done = await conn.fetchval(
                "SELECT true FROM toren.schema_migrations WHERE version = $1", version
            )
            if done:
                continue
            try:
                await conn.execute(sql)
            except asyncpg.PostgresError as exc:
                raise MigrationError(version, name, exc) from exc
            await conn.execute(
                "INSERT INTO toren.schema_migrations (version, name) VALUES ($1, $2)", version, name
            )
            applied.append(version)
            log.info("applied migration %04d_%s", version, name)
    return applied


async def schema_status(conn: asyncpg.Connection | asyncpg.Pool) -> tuple[int, int]:
    """``(applied version, newest version this code ships)``."""
    latest = available()[-1][0]
    exists = await conn.fetchval("SELECT to_regclass('toren.schema_migrations') IS NOT NULL")
    if not exists:
        return 0, latest
    current: int | None = await conn.fetchval("SELECT max(version) FROM toren.schema_migrations")
    return current or 0, latest
