"""The actor the benchmarks run in their worker processes (``--app bench.app``)."""

from __future__ import annotations

import os
from typing import Any

import anyio
import attrs

from toren import Actor, Context, message


@message("bench.hold")
@attrs.frozen(kw_only=True)
class Hold:
    """Handled by sleeping on first delivery (a message in hand at the kill), at once after."""

    seconds: float
    marker: str


@message("bench.held")
@attrs.frozen(kw_only=True)
class Held:
    pid: int
    deliveries: int


class Holder(Actor[int]):
    kind = "bench.holder"
    idle_seconds = 60.0

    def initial_state(self) -> int:
        return 0

    def apply(self, state: int, event: Any) -> int:
        return state + 1

    async def handle(self, ctx: Context[int], msg: Any) -> None:
        if ctx.envelope is None:
            raise RuntimeError("handle() without an envelope")
        if ctx.envelope.deliveries == 1:
            await anyio.Path(msg.marker).write_text(str(os.getpid()))
            await anyio.sleep(msg.seconds)
        ctx.emit(Held(pid=os.getpid(), deliveries=ctx.envelope.deliveries))
