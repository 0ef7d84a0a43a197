"""The runs below a run that it waits on (the child runs of its cross-agent calls, theirs...),
and the run a decision sent on a run's page goes to: a child's approvals are decided from its
parent's page."""

from __future__ import annotations

from toren._core.client import Client
from toren._core.errors import TorenError
from toren._core.rows import ActorRow, actor_row, descendants
from toren.runs.audit import unknown_run
from toren.runs.client import RunNotInState
from toren.runs.events import RUN_KIND


async def runs_below(client: Client, run_id: str) -> list[tuple[str, str, list[str]]]:
    """The runs below ``run_id`` that it waits on (the child runs of its cross-agent calls that
    have not ended, theirs...), nearest first: ``(run id, agent, call ids waiting for a
    decision)``, from their rows: the child runs its summary lists as running (children it
    started by cross-agent calls and has not taken the end of), theirs, and so on. A child
    whose end its parent already took is not below it any more."""
    rows = await descendants(
        client.pool, run_id, kind=RUN_KIND, fields=("args.agent", "summary.waiting_on")
    )
    return [(r.actor_id, str(r.args_dict.get("agent") or ""), _waiting(r)) for r, _ in rows]


def _waiting(row: ActorRow) -> list[str]:
    """The call ids that run ``row`` waits on a decision for, from its summary."""
    waiting = row.summary_dict.get("waiting_on")
    return [str(c) for c in waiting] if isinstance(waiting, list) else []


async def waiting_below(client: Client, run_id: str) -> list[tuple[str, str, list[str]]]:
    """Those of :func:`runs_below` that wait for decisions."""
    return [below for below in await runs_below(client, run_id) if below[2]]


class AmbiguousDecision(TorenError):
    """A decision sent on a run's page names a call id that waits in more than one run (the run
    and a child run, or two child runs): it must name the run it decides."""

    def __init__(self, call_id: str, runs: list[str]) -> None:
        self.call_id = call_id
        self.runs = runs
        super().__init__(
            f"call {call_id!r} waits in {len(runs)} runs ({', '.join(runs)}); "
            "name the run the decision is for"
        )


async def decision_target(
    client: Client, run_id: str, call_id: str, run: str | None = None
) -> tuple[str, str]:
    """The run a decision on ``call_id`` sent on ``run_id``'s page goes to, with its agent: the
    run itself if the call waits there, or the run below it (a child of its cross-agent calls
    that it waits on) where it waits; ``run`` names it when the call id waits in several. A
    call that waits nowhere is left to ``run_id`` (which refuses it). Authorization is by the
    agent of the run decided, whichever page shows the call.

    Raises:
        UnknownActor: no such run.
        RunNotInState: ``run`` is neither ``run_id`` nor a run below it that it waits on.
        AmbiguousDecision: ``run`` is not given and the call waits in more than one run.
    """
    row = await actor_row(
        client.pool, run_id, kind=RUN_KIND, fields=("args.agent", "summary.waiting_on")
    )
    if row is None:
        raise await unknown_run(client.pool, run_id)
    own = (run_id, str(row.args_dict.get("agent") or ""))
    if run == run_id:
        return own
    below = await runs_below(client, run_id)
    if run is not None:
        for found, agent, _ in below:
            if found == run:
                return found, agent
        raise RunNotInState(run, f"is not {run_id} or a run below it that it waits on")
    waiting = call_id in _waiting(row)
    candidates = [own] if waiting else []
    candidates += [(found, agent) for found, agent, calls in below if call_id in calls]
    if len(candidates) > 1:
        raise AmbiguousDecision(call_id, [found for found, _ in candidates])
    return candidates[0] if candidates else own
