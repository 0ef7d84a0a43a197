"""A journal started as a copy of another's: the kernel's statement for forks.

A fork of an actor (a run forked from a step) is a new actor whose journal begins with the
events of another, copied by value in the database (``INSERT ... SELECT``: no event passes
through Python), renumbered from 1, then followed by events of its own. The source's rows are
only read. The copy is written in the caller's transaction, with the new actor's row and its
first message, so that a fork exists whole or not at all.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING

from toren._core.codec import encode
from toren._core.errors import InternalError
from toren._core.json_text import dumps

if TYPE_CHECKING:
    from toren._core.rows import Db

# The copied rows keep the time they were first recorded (a timeline reads when it happened);
# their epoch is 0: no claim of the new actor wrote them.
_COPY = """
WITH copied AS (
    INSERT INTO toren.journal (actor_id, seq, epoch, type, data, created_at)
    SELECT $2, row_number() OVER (ORDER BY j.seq), 0, j.type, j.data, j.created_at
    FROM toren.journal j
    WHERE j.actor_id = $1
      AND (j.seq < $3 OR (j.seq < $4 AND j.type = ANY($5::text[])))
      AND NOT EXISTS (SELECT 1 FROM toren.journal t WHERE t.actor_id = $2)
    RETURNING 1
)
SELECT count(*) FROM copied
"""

_APPEND = """
INSERT INTO toren.journal (actor_id, seq, epoch, type, data)
SELECT $1, $2 + e.n, 0, e.type, e.data::jsonb
FROM unnest($3::text[], $4::text[]) WITH ORDINALITY AS e(type, data, n)
"""


async def copy_journal(
    conn: Db,
    source: str,
    target: str,
    *,
    before: int,
    also: Collection[str] = (),
    until: int = 0,
    then: Sequence[object] = (),
) -> int:
    """Start ``target``'s journal (it must have none) with ``source``'s events whose ``seq`` is
    below ``before``, and those of the types ``also`` whose ``seq`` is below ``until`` (events
    recorded among later ones that the copy must keep), in their order, renumbered from 1; then
    append the events ``then``. Run it in the transaction that creates ``target``.

    Returns:
        The last ``seq`` of ``target``'s journal.

    Raises:
        InternalError: ``target`` already had a journal, or ``source``'s events below
            ``before`` are not a gapless run from 1 (a journal is never trimmed).
    """
    copied: int = await conn.fetchval(_COPY, source, target, before, until, list(also))
    if copied == 0 and before > 1:
        raise InternalError(f"{target} already has a journal, or {source} has none to copy")
    if copied < before - 1:
        raise InternalError(f"the journal of {source} lacks events below seq {before}")
    if then:
        encoded = [encode(event) for event in then]
        await conn.execute(
            _APPEND, target, copied, [t for t, _ in encoded], [dumps(d) for _, d in encoded]
        )
    return copied + len(then)
