"""Activation: a run with 16,000 recorded steps brought back from cold, from its snapshot and the
events since, against the same run folded from its whole journal.

The run's journal is what the ``bench`` agent's tool loop records (each step a model call with
text and a tool call, the tool's intent and its result), with the digests the agent's requests
have, written straight into the journal. Its snapshots are written as a worker hosting it
writes them (every 1,000 events, each adding one chunk), except that the last ones are left out
so that the tail to fold is as long as it gets (about 1,000 events or more): the slow case, not
the fast one. Activating is what a worker does when the run's next message arrives: the state
rebuilt in a new actor (nothing of the run in memory), then the resume check that compares the
recorded calls with this code's requests (only the calls not yet checked under the same
parameters). The best of several activations is kept, and the same run folded from its journal
alone (its snapshot set aside, every call checked) is reported beside it.
"""

from __future__ import annotations

import gc
import time
import uuid
from collections.abc import Iterator
from typing import Any

from bench import app
from bench._common import Bench
from bench.fold import step_events
from toren import Client, Context
from toren._core.codec import encode
from toren._core.journal import replay, save_snapshot
from toren.actors.runs import RunActor, build_request, parameters, verify
from toren.kernel import connect
from toren.runs import GENESIS as DIGEST_GENESIS
from toren.runs import RUN_KIND, RunStarted, RunState, chain, fold

EVERY = RunActor.snapshot_every


def journal(steps: int) -> Iterator[Any]:
    """The events of a ``steps``-step tool loop of the ``bench`` agent, with true digests."""
    agent = app.bench
    checked_as = parameters(agent)
    state = fold(RunState(), RunStarted(agent="bench", input="activate", at=1.0))
    yield state, RunStarted(agent="bench", input="activate", at=1.0)
    digest, since = DIGEST_GENESIS, 0
    for i in range(1, steps + 1):
        digest = chain(digest, build_request(agent, state.messages[since:]))
        since = len(state.messages)
        events = step_events(
            i, digest=digest, model=agent.model, messages_len=since, checked_as=checked_as
        )
        for event in events:
            state = fold(state, event)
            yield state, event


async def _record(b: Bench, client: Client, steps: int) -> tuple[str, int, int]:
    """Write the run; ``(run id, events, tail)``."""
    run_id = f"run/{uuid.uuid4()}"
    await client.pool.execute(
        "INSERT INTO toren.actors (actor_id, kind, args, status, route) "
        "VALUES ($1, $2, $3, 'live', 'agent:bench')",
        run_id,
        RUN_KIND,
        {"agent": "bench"},
    )
    actor = RunActor(run_id, {"agent": "bench"})
    total = 1 + 3 * steps  # run.started, then three events a step
    last_snapshot = (total - EVERY) // EVERY * EVERY  # the tail is at least EVERY events long
    rows: list[tuple[Any, ...]] = []
    with b.task(f"activate: recording a {steps}-step run", total) as task:
        for seq, (state, event) in enumerate(journal(steps), start=1):
            name, body = encode(event)
            rows.append((run_id, seq, 1, name, body))
            if len(rows) == 2000 or seq == total:
                await client.pool.executemany(
                    "INSERT INTO toren.journal (actor_id, seq, epoch, type, data) "
                    "VALUES ($1, $2, $3, $4, $5)",
                    rows,
                )
                b.progress.advance(task, len(rows))
                rows = []
            if seq % EVERY == 0 and seq <= last_snapshot:
                await save_snapshot(client.pool, actor, state, seq)
    return run_id, total, total - last_snapshot


async def _activate(client: Client, run_id: str, *, snapshot: bool) -> tuple[float, RunState]:
    """One cold activation: seconds, and the state rebuilt (before the resume check)."""
    gc.collect()
    actor = RunActor(run_id, {"agent": "bench"})
    started = time.perf_counter()
    if snapshot:
        rebuilt = await replay(
            client.pool,
            run_id,
            actor.initial_state(),
            actor.apply,
            snapshots=(RunState, RunActor.snapshot_version),
        )
    else:
        rebuilt = await replay(client.pool, run_id, actor.initial_state(), actor.apply)
    ctx = Context(actor, rebuilt.state, rebuilt.seq, 1, None)
    if snapshot:
        actor._check_resume(ctx, go_on=False)  # what the first message of an activation does
    else:
        verify(ctx, app.bench, go_on=False)  # every call checked, as with no record of checks
    seconds = time.perf_counter() - started
    if any(name == "steps.invalidated" for _, name, _, _ in ctx.events):
        raise RuntimeError(f"activating {run_id} voided recorded steps: the digests differ")
    return seconds, rebuilt.state


async def run(b: Bench) -> None:
    steps = b.count(16_000, 400)
    async with await Client.connect(b.url) as client:
        run_id, total, tail = await _record(b, client, steps)
        conn = await connect(b.url)
        try:
            await conn.execute("ANALYZE toren.journal, toren.snapshots, toren.snapshot_chunks")
        finally:
            await conn.close()
        warm: list[float] = []
        cold: list[float] = []
        with b.task("activate: from the snapshot, and from the journal alone", 8) as task:
            for _ in range(5):
                seconds, state = await _activate(client, run_id, snapshot=True)
                warm.append(seconds)
                b.progress.advance(task)
            for _ in range(3):
                seconds, whole = await _activate(client, run_id, snapshot=False)
                cold.append(seconds)
                b.progress.advance(task)
        if len(state.calls) != steps or state != whole:
            raise RuntimeError("the state activated from the snapshot differs from the fold")
    best, folded = min(warm) * 1000, min(cold) * 1000
    b.results["activate_events"] = total
    b.results["activate_tail_events"] = tail
    b.record(
        "activate_16k_step_run_ms",
        round(best, 1),
        f"activate a {steps}-step run ({total} events, {tail} after its snapshot)",
        f"{best:.0f} ms",
        "best of 5; target < 500 ms",
    )
    b.record(
        "activate_16k_from_journal_ms",
        round(folded, 1),
        f"the same run folded from its journal alone ({total} events)",
        f"{folded:.0f} ms",
        "best of 3; every recorded call checked",
    )
