"""What must hold after a batch cell (:mod:`chaos.batches`): every run judged as a plain cell
judges one (:func:`chaos.oracle.judge`), and a run whose journal cannot even be folded (a hole in
its seqs) named as such, with the hole; and what the workers' logs say of their batches.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from decimal import Decimal

import attrs

from chaos.oracle import Expected, Observed, Row, journal_problems, judge, lost_note
from toren import Client

# What a worker logs of its batches at DEBUG (toren._core.group_commit).
SENDING = re.compile(r"sending a batch of (\d+) steps: \[([^\]]*)\]")
COMMITTED = re.compile(r"a batch of (\d+) steps committed")


@attrs.frozen
class BatchObserved:
    """Every run of a batch cell as it ended, and the batches its workers committed."""

    runs: tuple[Observed, ...]
    # runs whose journal cannot be folded: (index, the error, the journal's problems)
    unreadable: tuple[tuple[int, str, tuple[str, ...]], ...]
    batches: int  # batches committed, by every worker of the cell (their logs)
    batched: int  # steps in them
    members: tuple[str, ...]  # the faulted batch's steps' actors (empty: the clean cell)

    def runs_by_index(self) -> list[tuple[int, Observed]]:
        """The readable runs, each with its index among the cell's runs."""
        skipped = {i for i, _, _ in self.unreadable}
        indices = [i for i in range(len(self.runs) + len(skipped)) if i not in skipped]
        return list(zip(indices, self.runs, strict=True))


def batches_in(logs: Iterable[str]) -> tuple[int, int]:
    """The batches the workers' logs show committed, and the steps in them."""
    sizes = [int(m.group(1)) for log in logs for m in COMMITTED.finditer(log)]
    return len(sizes), sum(sizes)


def judge_batch(seen: BatchObserved, expected: Expected) -> tuple[list[str], int, Decimal]:
    """Each run judged as a plain cell's; the problems name the run."""
    problems: list[str] = []
    for i, error, found in seen.unreadable:
        problems.append(f"run {i}: its journal cannot be read ({error})")
        problems.extend(f"run {i}: {p}" for p in found)
    calls, usd = 0, Decimal(0)
    for i, run in seen.runs_by_index():
        verdict = judge(run, expected)
        problems.extend(f"run {i}: {p}" for p in verdict.problems)
        calls += verdict.duplicate_calls
        usd += verdict.duplicate_usd
    return problems, calls, usd


def note(seen: BatchObserved, landed: str) -> str:
    lost = [n for n in (lost_note(r.journal, r.arrivals) for r in seen.runs) if n]
    parts = [f"{seen.batches} batches of {seen.batched} steps"]
    if seen.members:
        parts.append(f"{len(seen.members)} steps in the faulted batch")
    if landed:
        parts.append(landed)
    if lost:
        parts.append(f"runs with calls lost in flight: {len(lost)}")
    return ", ".join(parts)


async def journal_problems_of(client: Client, run: str) -> tuple[str, ...]:
    """What :func:`chaos.oracle.journal_problems` finds in a run's journal, read as stored."""
    rows = await client.pool.fetch(
        "SELECT seq, epoch, type, data, extract(epoch FROM created_at)::float8 AS at "
        "FROM toren.journal WHERE actor_id = $1 ORDER BY seq",
        run,
    )
    journal = tuple(Row(r["seq"], r["epoch"], r["type"], r["data"], r["at"]) for r in rows)
    return tuple(journal_problems(journal, None))
