"""What a Postgres failover costs the runs: a Patroni cluster of two servers with synchronous
replication (:mod:`chaos.ha`), six runs of the chaos agent on two workers connected through a
multi-host URL, and each of the two faults of :mod:`chaos.failover` in the middle of them, a few
trials each:

- **postmaster**: the primary's postmaster SIGKILLed. Figures: seconds from the kill to the
  standby answering as primary (Patroni's failover) and to the first step committed on it (the
  workers' reconnection, new incarnation and claims).
- **patroni**: the primary's Patroni SIGKILLed, its leader key expired at once (its TTL would
  take 20 s more). Figure: seconds from the old primary's last moment of committing (the start
  of the first probe whose commit it never answered) to the first step committed on the new
  primary (the workers' renewals time out, they probe the servers, move, re-register, claim).

Each trial is judged by the chaos oracle too (every run completes, nothing paid twice but the
calls in flight, each effect once); a failing trial fails the section. The section is skipped,
saying why, without etcd, Postgres's binaries or Patroni 4 (``scripts/patroni-venv``), and in
smoke mode (CI runs the same faults as tests: ``chaos/test_failover.py``).
"""

from __future__ import annotations

import statistics

from bench._common import Bench
from chaos import ha
from chaos.failover import Fault, failover
from chaos.harness import Cell, Harness
from chaos.oracle import Expected, Observed

TRIALS = 3


async def run(b: Bench) -> None:
    why = "smoke mode (chaos/test_failover.py runs the faults)" if b.smoke else ha.missing()
    if why is not None:
        b.progress.console.print(f"failover section skipped: {why}", markup=False)
        b.record("failover_skipped", why, "failover section", "skipped", why)
        return
    faults: tuple[Fault, ...] = ("postmaster", "patroni")
    with b.task("failover: cluster, then faults", total=1 + TRIALS * len(faults)) as task:
        async with ha.Cluster() as cluster, Harness(cluster.url(), b.tmp / "failover") as h:
            expected = await _clean(h)
            b.progress.advance(task)
            for fault in faults:
                promoted, first = [], []
                for _ in range(TRIALS):
                    result = await failover(h, cluster, fault, expected)
                    if not result.scenario.passed or result.first_step_after is None:
                        raise RuntimeError(f"failover ({fault}) failed: {result.scenario.problems}")
                    promoted.append(result.promoted_after)
                    first.append(result.first_step_after)
                    b.progress.advance(task)
                _record(b, fault, promoted, first)


async def _clean(h: Harness) -> Expected:
    result, seen = await h.run_cell(Cell("clean", 0, None), None)
    if not isinstance(seen, Observed) or not result.passed:
        raise RuntimeError(f"the clean run failed on the cluster: {result.problems}")
    return Expected(
        output=seen.state.output or "",
        steps=len(seen.state.calls),
        effect_kinds=tuple(sorted(e.kind for e in seen.effects)),
    )


def _record(b: Bench, fault: Fault, promoted: list[float], first: list[float]) -> None:
    since = "the kill" if fault == "postmaster" else "the old primary stopped committing"
    median, worst = statistics.median(first), max(first)
    b.record(
        f"failover_{fault}_first_step_s",
        round(median, 2),
        f"failover ({fault} SIGKILLed): first step after",
        f"{median:.2f} / {worst:.2f} s",
        f"median / worst of {len(first)}, from {since}",
    )
    if fault == "postmaster":
        median, worst = statistics.median(promoted), max(promoted)
        b.record(
            "failover_postmaster_promoted_s",
            round(median, 2),
            "failover (postmaster SIGKILLed): standby promoted after",
            f"{median:.2f} / {worst:.2f} s",
            f"median / worst of {len(promoted)}: Patroni (ttl 20, loop_wait 1)",
        )
