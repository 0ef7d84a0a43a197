"""docs/architecture.md's walkthrough, done: a kind added in this one file (its messages and
events, its actor, the runtime its actors share on a worker, a service beside them, and its
``Kind``), run on a real worker composed from Toren's kinds and this one, touching no other file.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import anyio
import attrs
import pytest

from tests.conftest import wait_for
from toren import Actor, Client, Context, Settings, message
from toren.kernel import Kind, Service, WorkerEnv
from toren.supervisors.worker import KINDS, Worker

pytestmark = pytest.mark.anyio


# -- the kind's vocabulary: what its actors are sent and what they record ----------------------


@message("tally.count")
@attrs.frozen
class Count:
    word: str


@message("tally.counted")
@attrs.frozen
class Counted:
    word: str
    seen_by_worker: int  # how many words the worker's runtime had seen, this one included


# -- the runtime its actors share on one worker, and a service beside them ---------------------


class Tallies:
    """What a worker's tally actors share: a count of the words they saw, on this worker."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.words = 0
        self.ticks = 0
        self.closed = False

    async def close(self) -> None:
        self.closed = True


async def _open(env: WorkerEnv) -> Tallies:
    return Tallies(env.settings.worker_name)


def _services(env: WorkerEnv, tallies: Tallies) -> Sequence[Service]:
    async def tick(started: Callable[[], None]) -> None:
        started()
        while True:
            tallies.ticks += 1
            await anyio.sleep(0.05)

    return (Service(id="tally-ticker", run=tick),)


# -- the kind's behaviour ----------------------------------------------------------------------


class Tally(Actor[tuple[str, ...]]):
    kind = "test.tally"

    def initial_state(self) -> tuple[str, ...]:
        return ()

    def apply(self, state: tuple[str, ...], event: Any) -> tuple[str, ...]:
        return (*state, event.word) if isinstance(event, Counted) else state

    async def handle(self, ctx: Context[tuple[str, ...]], msg: Any) -> None:
        if isinstance(msg, Count):
            tallies = ctx.resources.get(Tallies)
            tallies.words += 1
            ctx.emit(Counted(word=msg.word, seen_by_worker=tallies.words))


TALLY = Kind(name="tally", actors=(Tally,), open=_open, services=_services)


# -- run it --------------------------------------------------------------------------------------


async def test_a_kind_added_in_one_file_runs_on_a_worker_composed_with_it(
    client: Client, db_url: str
) -> None:
    settings = Settings(
        database_url=db_url,
        lease_seconds=3.0,
        renew_seconds=1.0,
        poll_seconds=0.2,
        grace_seconds=5.0,
        sandboxes=False,
        worker_name="tallier",
    )
    worker = Worker(settings, db_url, kinds=(*KINDS, TALLY))
    await client.spawn(Tally, "tally/1")
    async with anyio.create_task_group() as tg:
        await tg.start(worker.run)
        tallies = worker.resources.get(Tallies)
        assert tallies.name == "tallier"
        for word in ("one", "two", "three"):
            await client.send("tally/1", Count(word=word), dedupe_key=word)

        async def counted() -> bool:
            return len(await client.journal("tally/1")) == 3

        await wait_for(counted, timeout=20, what="three words counted")
        await wait_for(lambda: _true(tallies.ticks > 1), timeout=10, what="the service ticking")
        with anyio.fail_after(15, shield=True):
            await worker.stop()
    events = [(e.type, e.data) for e in await client.journal("tally/1")]
    assert events == [
        ("tally.counted", {"word": w, "seen_by_worker": n})
        for w, n in (("one", 1), ("two", 2), ("three", 3))
    ]
    assert tallies.closed  # the worker closed the kind's runtime at its stop


async def _true(value: bool) -> bool:
    return value
