"""Mutations for the run fuzzer: each removes one of issue 11's fixes from this process, the way
``chaos/mutations.py`` removes a protection from a worker process, and restores it on exit.

- ``nul-handling``: Toren's lossless JSON (:mod:`toren._core.json_text`) replaced by plain orjson
wherever
  it is used (the ``jsonb`` codec, events, messages, digests, canonical arguments): NUL reaches
  Postgres as ``\\u0000`` and lone surrogates cannot be written at all. The codec is installed
  when a pool's connections open, so apply this before the worker and clients start.
- ``python-arguments``: tool arguments are recorded as pydantic's Python-mode dump and handed to
  the tool (and to its approval predicate) as recorded, without being validated again.
- ``unbound-decisions``: a decision is applied to the first waiting call (sorted by id),
  whichever call it names, as the run did before decisions were addressed.

Each is a context manager: ``with MUTATIONS["nul-handling"](): ...``.
"""

from __future__ import annotations

import contextlib
import importlib
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import orjson

MUTATION_NAMES = ("nul-handling", "python-arguments", "unbound-decisions")


@contextlib.contextmanager
def _patched(patches: list[tuple[object, str, Any]]) -> Iterator[None]:
    """Set each ``(owner, attribute, value)``; put the originals back on exit. An attribute the
    owner did not hold itself (a package's name imported on first use, a method inherited) is
    taken off again, not set: set, it would keep what it was read as, which may be another
    patch's value (``toren.runs.judge_decision`` read after ``toren.runs.state``'s is patched)."""
    saved = []
    try:
        for owner, name, value in patches:
            if not hasattr(owner, name):
                raise RuntimeError(f"mutation no longer applies: {owner!r} has no {name!r}")
            saved.append((owner, name, getattr(owner, name), name in vars(owner)))
            setattr(owner, name, value)
        yield
    finally:
        for owner, name, value, held in reversed(saved):
            if held:
                setattr(owner, name, value)
            else:
                delattr(owner, name)


def _plain_dumps(value: Any, *, sort_keys: bool = False) -> str:
    return orjson.dumps(value, option=orjson.OPT_SORT_KEYS if sort_keys else 0).decode()


def _plain_loads(text: str | bytes) -> Any:
    return orjson.loads(text)


@contextlib.contextmanager
def nul_handling() -> Iterator[None]:
    """Plain orjson for every JSON text Toren writes to or reads from Postgres."""
    modules = {
        name: importlib.import_module(name)
        for name in (
            "toren._core.db",
            "toren._core.actor",
            "toren._core.mailbox",
            "toren._agent.digest",
            "toren.runs.client",
            "toren.kernel",
            "toren.actors.runs.bounds",
            "toren.runs._fold",
            "toren._core.snapshots",
        )
    }
    patches: list[tuple[object, str, Any]] = [
        (modules["toren._core.db"], "dumps", _plain_dumps),
        (modules["toren._core.db"], "loads", _plain_loads),
        (modules["toren._core.actor"], "dumps", _plain_dumps),
        (modules["toren._core.actor"], "loads", _plain_loads),
        (modules["toren._core.mailbox"], "dumps", _plain_dumps),
        (modules["toren._agent.digest"], "dumps", _plain_dumps),
        (modules["toren.runs.client"], "dumps", _plain_dumps),
        (modules["toren.kernel"], "json_text", _plain_dumps),
        (modules["toren.actors.runs.bounds"], "json_text", _plain_dumps),
        (modules["toren.runs._fold"], "dumps", _plain_dumps),  # canonical arguments
        (modules["toren._core.snapshots"], "dumps", _plain_dumps),
        (modules["toren._core.snapshots"], "loads", _plain_loads),
    ]
    with _patched(patches):
        yield


@contextlib.contextmanager
def python_arguments() -> Iterator[None]:
    """Record Python-mode arguments, and call tools and predicates with them as recorded."""
    from toren._agent.agents import Tool

    def validate(self: Tool, arguments: Mapping[str, Any] | None) -> dict[str, Any]:
        return self.arguments.model_validate(arguments or {}).model_dump()

    def bind(self: Tool, recorded: Mapping[str, Any]) -> dict[str, Any]:
        return dict(recorded)

    with _patched([(Tool, "validate", validate), (Tool, "bind", bind)]):
        yield


@contextlib.contextmanager
def unbound_decisions() -> Iterator[None]:
    """Apply any decision to the first waiting call, sorted, ignoring the call it names (and
    answer as if the named call had been decided: only the journal tells)."""
    import toren.runs
    from toren.actors.runs import deciding
    from toren.runs import ApprovalDecided, Continue, DecisionOutcome, RunState, author, waiting_on
    from toren.runs import state as run_state

    judge = run_state.judge_decision

    def unbound_judge(state: RunState, decision: Any) -> DecisionOutcome:
        if not waiting_on(state):
            return judge(state, decision)
        verdict = "approve" if decision.approved else "deny"
        return DecisionOutcome(
            call_id=decision.call_id, outcome="applied", detail=f"{verdict}d {decision.call_id}"
        )

    decide = deciding.decide

    def unbound_decide(ctx: Any, msg: Any) -> None:
        waiting = sorted(c.id for c in waiting_on(ctx.state))
        if not waiting:
            decide(ctx, msg)
            return
        outcome = unbound_judge(ctx.state, msg)
        ctx.emit(
            ApprovalDecided(
                call_id=waiting[0],
                approved=msg.approved,
                who=author(msg)[0],
                reason=msg.reason,
                channel=author(msg)[1],
                at=time.time(),
                by=msg.by,
            )
        )
        ctx.send(ctx.actor_id, Continue())
        ctx.reply(outcome)

    patches: list[tuple[object, str, Any]] = [
        (run_state, "judge_decision", unbound_judge),
        (toren.runs, "judge_decision", unbound_judge),
        (deciding, "judge_decision", unbound_judge),
        (deciding, "decide", unbound_decide),
    ]
    with _patched(patches):
        yield


MUTATIONS: dict[str, Callable[[], contextlib.AbstractContextManager[None]]] = {
    "nul-handling": nul_handling,
    "python-arguments": python_arguments,
    "unbound-decisions": unbound_decisions,
}


# The step statement's ``limits`` fragment without the release and hand-off (still typed by
# {release}): an actor under limits keeps its permits after it parks or ends.
_KEPT_PERMITS = """lim AS (
    SELECT {release}::bool OR true AS runs FROM fence
    WHERE fence.limits IS NOT NULL AND EXISTS (SELECT 1 FROM consumed)
)"""

# The claim's ``limits`` fragment without the cap check: user mail is claimed without permits.
_NO_CAP = """held AS (
    SELECT true AS runs FROM fence WHERE fence.limits IS NOT NULL
)"""


@contextlib.contextmanager
def no_limit_handoff() -> Iterator[None]:
    """``no-limit-handoff``: a step after which an actor under concurrency limits no longer
    runs keeps its permits; the runs queued behind it never start (tests/test_limits.py)."""
    from toren._core import mailbox, step_sql

    statement = step_sql.step_statement({**step_sql.STEP_FRAGMENTS, "limits": _KEPT_PERMITS})
    with _patched([(mailbox, "_COMMIT", statement)]):
        yield


@contextlib.contextmanager
def no_limit_check() -> Iterator[None]:
    """``no-limit-check``: the claim of an actor's next message takes no permit and checks no
    cap: a parked run woken while its cap is full runs beside the others."""
    from toren._core import mailbox, step_sql

    statement = step_sql.claim_statement({**step_sql.CLAIM_FRAGMENTS, "limits": _NO_CAP})
    with _patched([(mailbox, "_CLAIM_NEXT", statement)]):
        yield


LIMIT_MUTATIONS: dict[str, Callable[[], contextlib.AbstractContextManager[None]]] = {
    "no-limit-handoff": no_limit_handoff,
    "no-limit-check": no_limit_check,
}
"""Mutations of the kernel's limits, by fragment name; not the fuzzer's (MUTATION_NAMES)."""
