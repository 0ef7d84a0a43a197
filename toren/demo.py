"""The demo app ``toren dev`` runs when no ``--app`` is given: a heartbeat actor on a timer.

It shows the kernel at work: a durable timer fires every few seconds, each beat is an event in
the actor's journal, and a killed ``toren dev`` resumes the count where it stopped.
"""

from __future__ import annotations

import logging

import attrs

from toren import Actor, Context, message

log = logging.getLogger("toren.demo")

BEAT_SECONDS = 5.0


@message("demo.beat")
@attrs.frozen
class Beat:
    """Timer message: time for the next beat."""


@message("demo.beaten")
@attrs.frozen(kw_only=True)
class Beaten:
    """Event: one more beat happened."""

    n: int


class Heartbeat(Actor[int]):
    """Counts beats; re-arms its own durable timer on each one."""

    kind = "demo.heartbeat"

    def initial_state(self) -> int:
        return 0

    def apply(self, state: int, event: object) -> int:
        return event.n if isinstance(event, Beaten) else state

    async def handle(self, ctx: Context[int], msg: object) -> None:
        if isinstance(msg, Beat):
            ctx.emit(Beaten(n=ctx.state + 1))
            ctx.set_timer("beat", BEAT_SECONDS, Beat())
            log.info("%s: beat %d (journal seq %d)", ctx.actor_id, ctx.state, ctx.seq)
