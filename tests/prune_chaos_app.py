"""Agents and an actor for the pruning chaos tests (tests/test_prune_chaos.py).

``keeper`` keeps its ended runs an hour and archives each journal before it is deleted (the tests
age the runs); ``aide`` runs as its child and goes with its tree. ``Ledger`` is a kernel actor
that never ends and lets go of its journal behind each snapshot at once (``journal_keep_for``
0): the truncation's kill point on a real worker, without a model server.
"""

from __future__ import annotations

from typing import Any

import attrs

from toren import Actor, Agent, Context, Retention, message
from toren._core.resources import Resources

MODEL = "anthropic/claude-sonnet-4-6"

keeper = Agent(
    name="keeper",
    model=MODEL,
    system="keeper",
    calls=["aide"],
    retention=Retention(keep_for="1h", archive=True),
)
aide = Agent(name="aide", model=MODEL, system="aide", description="Helps.", accepts=["keeper"])


@message("test.prune_chaos.post")
@attrs.frozen(kw_only=True)
class Post:
    first: int
    count: int


@message("test.prune_chaos.posted")
@attrs.frozen(kw_only=True)
class Posted:
    n: int
    text: str


@attrs.frozen(kw_only=True)
class LedgerState:
    total: int = 0
    last: int = 0


def posted(n: int) -> Posted:
    """The ``n``-th entry of the ledger (text a JSON reader must keep exact)."""
    return Posted(n=n, text=f"entry {n} \x00 \ud800 é")


def apply_posted(state: LedgerState, event: Any) -> LedgerState:
    if isinstance(event, Posted):
        return LedgerState(total=state.total + event.n, last=event.n)
    return state


class Ledger(Actor[LedgerState]):
    kind = "test.prune_chaos.ledger"
    idle_seconds = 0.5
    snapshot_every = 10
    state_type = LedgerState

    def initial_state(self) -> LedgerState:
        return LedgerState()

    def apply(self, state: LedgerState, event: Any) -> LedgerState:
        return apply_posted(state, event)

    async def handle(self, ctx: Context[LedgerState], msg: Any) -> None:
        if isinstance(msg, Post):
            for n in range(msg.first, msg.first + msg.count):
                ctx.emit(posted(n))

    def journal_keep_for(self, state: LedgerState, resources: Resources) -> float | None:
        return 0.0
