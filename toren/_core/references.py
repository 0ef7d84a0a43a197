"""Which of some names the database still mentions: the mark of a mark-and-sweep.

Content kept outside the database (a sandbox's checkpoints in an object store) is named from
inside it: by journal events, by an actor's arguments or summary, by the state a snapshot
keeps, by a message waiting in a mailbox or a dead letter. :func:`mentioned` reads them all,
within one snapshot of the database, and says which of the given names any of them holds as a
token (a run of characters matching ``pattern``, anywhere in their JSON text). It knows no
kind: what a name looks like is its caller's, and a name found where nobody meant it (a digest
that happens to equal a checkpoint's id) only keeps something longer, never deletes it.

One snapshot (a ``REPEATABLE READ`` transaction, read only): a name that moves between rows
while the mark reads them (a fork copying its source's journal, then the source deleted) is
seen where the snapshot has it. The transaction holds no lock but keeps that snapshot for as
long as it reads, which holds back vacuum of what is deleted meanwhile: it reads every
journal once, so it is run rarely (``checkpoint_sweep_every``).
"""

from __future__ import annotations

from collections.abc import Collection

import asyncpg

HEX64 = "[0-9a-f]{64}"
"""A sha256 in hexadecimal: what checkpoints' manifests and blobs are named by."""

# Each statement gives the tokens of one table's JSON that are among $2; the text form of a
# jsonb value is the one Postgres prints (strings quoted and escaped: a hex token is intact).
_MENTIONED = [
    f"""
    SELECT DISTINCT m[1] FROM {source}, regexp_matches({column}::text, $1, 'g') AS m
    WHERE m[1] = ANY($2::text[])
    """
    for source, column in (
        ("toren.journal", "data"),
        ("toren.snapshots", "state"),
        ("toren.actors", "args"),
        ("toren.actors", "coalesce(summary, 'null')"),
        ("toren.mailbox", "body"),
        ("toren.deadletters", "body"),
    )
]


async def mentioned(
    pool: asyncpg.Pool, names: Collection[str], *, pattern: str = HEX64
) -> set[str]:
    """Those of ``names`` that a journal, a snapshot, an actor's arguments or summary, a
    message waiting or a dead letter holds as a token matching ``pattern`` (a POSIX regular
    expression each name matches whole), all read in one snapshot of the database.

    Raises:
        asyncpg.PostgresError: the database failed; nothing is known then, so nothing may be
            swept.
    """
    wanted = sorted(set(names))
    if not wanted:
        return set()
    found: set[str] = set()
    async with pool.acquire() as conn, conn.transaction(isolation="repeatable_read", readonly=True):
        for statement in _MENTIONED:
            found.update(r[0] for r in await conn.fetch(statement, pattern, wanted))
            if len(found) == len(wanted):
                break
    return found
