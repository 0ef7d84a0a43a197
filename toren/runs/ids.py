"""Runs found by what a person types: ``run/<uuid>``, the uuid, or a unique prefix of it
(``8146c6``), with or without ``run/``, in either case, with or without the uuid's hyphens.

A prefix is looked up in one query on the actors' primary key: every run id with that prefix
lies between the prefix padded with ``0`` and the prefix padded with ``f`` (run ids are
lowercase canonical uuids), a range the key's btree answers without reading other rows;
``starts_with`` then keeps exactly the ids with the prefix. A whole id is the same query with
both ends equal. The range is compared in the column's collation (so the key's index serves
it): C and the usual libc and ICU locales order hex digits and ``-`` so that every id with the
prefix lies inside it; a collation that contracts letters among ``a``-``f`` (Danish ``aa``) could
leave one out, never let a wrong one in.
"""

from __future__ import annotations

import re
from datetime import datetime

import asyncpg
import attrs

from toren._core.errors import TorenError
from toren._core.rows import actors_in_range
from toren.runs.audit import audit_record
from toren.runs.events import RUN_KIND

CANDIDATES = 10
"""Runs an ambiguous prefix lists at most."""

_HEX = re.compile(r"[0-9a-f]{1,32}")
_GROUPS = ((0, 8), (8, 12), (12, 16), (16, 20), (20, 32))  # a uuid's hex digits by group


@attrs.frozen(kw_only=True)
class Candidate:
    """A run a prefix names: its id, agent, status and creation time."""

    id: str
    agent: str
    status: str
    created_at: datetime

    def __str__(self) -> str:
        at = self.created_at.isoformat(timespec="seconds")
        return f"{self.id} ({self.agent}, {self.status}, started {at})"


class NotARunId(TorenError):
    """What was given cannot name a run: not hex digits (after ``run/`` and hyphens)."""

    def __init__(self, text: str) -> None:
        self.text = text
        shown = text if len(text) <= 60 else f"{text[:57]}..."  # not all of a pasted page
        super().__init__(
            f"no run {shown!r}: a run is named by run/<uuid>, the uuid, or its first hex "
            "digits (such as 8146c6)"
        )


class RunNotFound(TorenError):
    """No run's id is, or starts with, what was given."""

    def __init__(self, text: str, prefix: str, *, whole: bool) -> None:
        self.text = text
        self.prefix = prefix
        what = f"no run {prefix!r}" if whole else f"no run's id starts with {prefix!r}"
        super().__init__(what if text == prefix else f"{what} (from {text!r})")


class AmbiguousRun(TorenError):
    """Several runs' ids start with what was given."""

    def __init__(self, text: str, prefix: str, candidates: list[Candidate]) -> None:
        self.text = text
        self.prefix = prefix
        self.candidates = candidates
        more = len(candidates) > CANDIDATES
        count = f"more than {CANDIDATES}" if more else str(len(candidates))
        listed = "; ".join(str(c) for c in candidates[:CANDIDATES])
        super().__init__(f"{prefix} names {count} runs: {listed}{'; ...' if more else ''}")


def id_range(text: str) -> tuple[str, str, str]:
    """``(prefix, lowest, highest)``: the canonical prefix (``run/`` and the uuid's hyphens
    where they belong) and the lowest and highest run ids that start with it.

    Raises:
        NotARunId: ``text`` is not a run id or a prefix of one.
    """
    raw = text.strip()
    digits = re.sub(r"^run/", "", raw, flags=re.IGNORECASE).lower().replace("-", "")
    if not _HEX.fullmatch(digits):
        raise NotARunId(text)

    def canonical(hexes: str) -> str:
        return "run/" + "-".join(hexes[a:b] for a, b in _GROUPS if hexes[a:b])

    return (
        canonical(digits),
        canonical(digits.ljust(32, "0")),
        canonical(digits.ljust(32, "f")),
    )


async def find_run(conn: asyncpg.Pool | asyncpg.Connection, text: str) -> str:
    """The id of the one run that ``text`` names: ``run/<uuid>``, the uuid, or a prefix of it
    that only one run's id starts with.

    Raises:
        NotARunId: ``text`` cannot name a run.
        RunNotFound: no run's id is, or starts with, it.
        AmbiguousRun: several runs' ids start with it (the first ``CANDIDATES`` listed).
    """
    prefix, lowest, highest = id_range(text)
    rows = await actors_in_range(
        conn,
        lowest,
        highest,
        kind=RUN_KIND,
        prefix=prefix,
        fields=("args.agent",),
        limit=CANDIDATES + 1,
    )
    if not rows:
        if lowest == highest and await audit_record(conn, lowest) is not None:
            return lowest  # a pruned run, named whole: its audit record answers for it
        raise RunNotFound(text, prefix, whole=lowest == highest)
    if len(rows) > 1:
        found = [
            Candidate(
                id=r.actor_id,
                agent=str(r.args_dict.get("agent") or ""),
                status=r.run_status or "running",
                created_at=r.created_at,
            )
            for r in rows
        ]
        raise AmbiguousRun(text, prefix, found)
    return rows[0].actor_id
