"""Pruning (issue 32): how fast ended runs go, and what a prune beside the steps costs them.

The ended runs are written straight into the tables (as :mod:`bench.activate` writes its
journal): each one what the ``bench`` agent's tool loop records for a 6-step run, with its true
digests (``run.started``, six steps of a model call with text and a tool call, the tool's
intent and result, the answer, ``run.completed``: 21 events), its row's summary as its last
step leaves it, ended two days ago. Its agent keeps ended runs for a day, so every one may go.

- Throughput: 1,000 such runs pruned batch after batch (:func:`toren.runs.prune.prune_batch`
  with its defaults, 100 runs a batch and a 200 ms lock timeout, as ``toren jobs prune`` runs
  it, in this process): events/s and runs/s over the batches' wall time, and each batch's
  deleting transaction (lock, check, audit records, delete: ``PruneResult.held``), median and
  max. Once without archiving, once with (each journal written to a local directory as gzipped
  JSON Lines and read back before its rows go), 1,000 other runs each time.
- Steps beside a prune: a ``toren worker`` (``--app bench.prune_app``) runs chains of kernel
  steps (:class:`bench.app.Counter`, as the kernel section) while its own pruner, the
  housekeeping actor a worker runs for an agent with a retention policy, archives and deletes
  100 such runs of that agent (one batch), woken as ``toren jobs prune`` wakes it; and the same
  chains without a prune, 500 steps before each of five such turns and after the last. Each
  step's time is the gap between consecutive events' timestamps of one chain (``created_at``,
  ``now()`` of each step's transaction, by Postgres' clock); the steps whose both ends fall
  between a wake and its last run gone are set against those of the chains without a prune:
  median and p99, and their ratios.
"""

from __future__ import annotations

import statistics
import time
import uuid
from collections.abc import Iterator
from typing import Any

import anyio
import asyncpg

from bench import app
from bench._common import Bench, median_ms, p99_ms
from bench.app import Counter, Tick
from bench.fold import step_events
from toren import Client, Retention
from toren._agent.principal import Principal
from toren._core.codec import encode
from toren._core.json_text import dumps
from toren._core.stores import store_from_url
from toren.actors.runs import build_request
from toren.retention import prune_now, pruner_id
from toren.runs import (
    GENESIS,
    RUN_KIND,
    ModelCalled,
    ModelResponse,
    RunCompleted,
    RunStarted,
    RunState,
    Text,
    Usage,
    chain,
    fold,
    summary,
)
from toren.runs.prune import PRUNE_BATCH, PruneResult, prune_batch

RUNS = 1000  # ended runs pruned without archiving, and with (21,000 events each)
ROUNDS = 5  # turns of steps without a prune, then beside one
BESIDE_RUNS = 100  # ended runs the worker's pruner prunes in each turn (a batch; archiving)
STEPS = 6  # tool steps a run makes before its answer: 21 events
CHAIN = 250  # kernel steps one chain of Counter ticks makes
WRITE = 500  # runs written per statement
AGE = 2 * 86_400  # how long ago the runs were made: past their agent's keep_for of a day
KEEP = Retention(keep_for="1d")
BESIDE = "bench_retained"  # bench.prune_app's agent, pruned by the worker's own pruner


def journal(agent: str, steps: int) -> tuple[list[tuple[str, str]], dict[str, Any]]:
    """A ``steps``-step tool loop that answered, as ``(type, data as JSON text)`` rows, and its
    row's summary."""
    started = RunStarted(
        agent=agent,
        input=f"steps={steps + 1} a run to prune",
        at=time.time() - AGE,
        by=Principal.os_user(via="cli"),
    )
    state = fold(RunState(), started)
    events: list[Any] = [started]
    digest, since = GENESIS, 0
    for i in range(1, steps + 2):
        digest = chain(digest, build_request(app.bench, state.messages[since:]))
        since = len(state.messages)
        if i <= steps:
            step = step_events(i, digest=digest, model=app.bench.model, messages_len=since)
        else:
            answer = ModelResponse(
                content=(Text(text=f"Done after {i} steps."),),
                stop_reason="end",
                usage=Usage(input_tokens=100 + i, output_tokens=10),
                model="bench",
            )
            called = ModelCalled(
                step=i,
                digest=digest,
                model=app.bench.model,
                response=answer,
                cost_usd="0.00011",
                latency_ms=5,
                messages_len=since,
            )
            step = (called, RunCompleted(output=f"Done after {i} steps.", at=started.at + 2))
        for event in step:
            state = fold(state, event)
            events.append(event)
    if state.status != "completed":
        raise RuntimeError(f"the written run folds to {state.status}, not completed")
    rows = [(name, dumps(body)) for name, body in map(encode, events)]
    return rows, summary(state)


async def write_runs(pool: asyncpg.Pool, agent: str, n: int) -> int:
    """``n`` ended runs of ``agent``, made ``AGE`` ago and a second apart; returns the events
    written."""
    rows, kept = journal(agent, STEPS)
    types = [t for t, _ in rows]
    datas = [d for _, d in rows]
    for first in range(0, n, WRITE):
        ids = [f"run/{uuid.uuid4()}" for _ in range(min(WRITE, n - first))]
        async with pool.acquire() as conn, conn.transaction():
            await conn.execute(
                "INSERT INTO toren.actors (actor_id, kind, args, route, summary, created_at) "
                "SELECT x.id, $2, jsonb_build_object('agent', $3::text, 'start', md5(x.id)), "
                "'agent:' || $3, $4, now() - make_interval(secs => $5::int + $6::int - x.i) "
                "FROM unnest($1::text[]) WITH ORDINALITY AS x(id, i)",
                ids,
                RUN_KIND,
                agent,
                kept,
                AGE,
                n - first,
            )
            await conn.execute(
                "INSERT INTO toren.journal (actor_id, seq, epoch, type, data, created_at) "
                "SELECT a.actor_id, e.seq, 1, e.type, e.data::jsonb, "
                "       a.created_at + make_interval(secs => e.seq * 0.05) "
                "FROM toren.actors a, unnest($2::text[], $3::text[]) WITH ORDINALITY "
                "     AS e(type, data, seq) "
                "WHERE a.actor_id = ANY($1::text[])",
                ids,
                types,
                datas,
            )
    await pool.execute("ANALYZE toren.actors, toren.journal")
    return n * len(rows)


async def _remaining(pool: asyncpg.Pool, agent: str) -> int:
    count: int = await pool.fetchval(
        "SELECT count(*) FROM toren.actors WHERE route = 'agent:' || $1::text AND kind = $2",
        agent,
        RUN_KIND,
    )
    return count


async def run(b: Bench) -> None:
    async with await Client.connect(b.url) as client:
        for archive in (False, True):
            await _throughput(b, client, archive=archive)
        await _beside(b, client)


async def _throughput(b: Bench, client: Client, *, archive: bool) -> None:
    n = b.count(RUNS, 20)
    side = "archived" if archive else "plain"
    agent = f"bench_prune_{side}"
    written = await write_runs(client.pool, agent, n)
    policy = Retention(keep_for=KEEP.keep_for, archive=archive)
    store = store_from_url(str(b.tmp / "archive")) if archive else None
    results: list[PruneResult] = []
    try:
        with b.task(f"prune: {n:,} runs, {side}", n) as task:
            started = time.perf_counter()
            while True:
                result = await prune_batch(client.pool, agent, policy, store=store)
                results.append(result)
                b.progress.advance(task, result.runs)
                if len(result.trees) < PRUNE_BATCH:
                    break
            wall = time.perf_counter() - started
    finally:
        if store is not None:
            await store.close()
    runs = sum(r.runs for r in results)
    events = sum(r.events for r in results)
    left = await _remaining(client.pool, agent)
    if runs != n or events != written or left or any(r.skipped for r in results):
        raise RuntimeError(
            f"prune of {n} runs ({written} events): pruned {runs} ({events} events), "
            f"{left} left, {sum(r.skipped for r in results)} skipped"
        )
    held = [r.held for r in results if r.runs]
    rate = events / wall
    b.results[f"prune_{side}_wall_s"] = round(wall, 2)
    b.results[f"prune_{side}_batches"] = len(held)
    b.record(
        f"prune_{side}_events_per_s",
        round(rate),
        f"prune {n:,} ended runs of {written // n} events, "
        + ("archived first" if archive else "no archive"),
        f"{rate:,.0f} events/s ({runs / wall:,.0f} runs/s)",
        f"batches of {PRUNE_BATCH}, in {wall:.1f} s"
        + ("; each journal gzipped to a local directory, read back" if archive else ""),
    )
    b.results[f"prune_{side}_runs_per_s"] = round(runs / wall, 1)
    if archive:
        b.ratio(
            "prune_archived_vs_plain",
            rate,
            "prune_plain_events_per_s",
            "prune throughput, archived first / not",
            "the same runs' size, in the same run",
        )
    b.record(
        f"prune_{side}_delete_tx_median_ms",
        round(median_ms(held), 2),
        f"prune, {'archived' if archive else 'no archive'}: a batch's deleting transaction",
        f"{median_ms(held):.1f} ms median, {max(held) * 1000:.1f} ms max",
        f"{len(held)} batches: lock {PRUNE_BATCH} runs, audit records, delete",
    )
    b.results[f"prune_{side}_delete_tx_max_ms"] = round(max(held) * 1000, 2)
    b.results[f"prune_{side}_batch_median_ms"] = round(
        statistics.median(r.took for r in results if r.runs) * 1000, 1
    )


async def _chain(client: Client, actor_id: str, steps: int) -> None:
    """One chain of ``steps`` kernel steps, to its end."""
    await client.spawn(Counter, actor_id)
    await client.send(actor_id, Tick(n=1, last=steps))
    deadline = time.monotonic() + 60
    while (
        await client.pool.fetchval(
            "SELECT count(*) FROM toren.journal WHERE actor_id = $1", actor_id
        )
        < steps
    ):
        if time.monotonic() > deadline:
            raise RuntimeError(f"{actor_id} did not make its {steps} steps in 60 s")
        await anyio.sleep(0.02)


async def _gaps(
    pool: asyncpg.Pool, prefix: str, windows: list[tuple[float, float]] | None = None
) -> list[float]:
    """Seconds between consecutive events of each chain under ``prefix`` (only those with both
    ends in one of ``windows``, if given: database clock, unix seconds)."""
    rows = await pool.fetch(
        "SELECT t - lag(t) OVER (PARTITION BY actor_id ORDER BY seq) AS gap, "
        "       lag(t) OVER (PARTITION BY actor_id ORDER BY seq) AS since, t "
        "FROM (SELECT actor_id, seq, extract(epoch FROM created_at)::float8 AS t "
        "      FROM toren.journal WHERE starts_with(actor_id, $1)) j",
        prefix,
    )
    return [
        r["gap"]
        for r in rows
        if r["gap"] is not None
        and (windows is None or any(a <= r["since"] <= r["t"] <= z for a, z in windows))
    ]


def _chains(prefix: str) -> Iterator[str]:
    for i in range(1_000_000):
        yield f"{prefix}{i:06d}"


async def _beside(b: Bench, client: Client) -> None:
    rounds = b.count(ROUNDS, 1)
    n = b.count(BESIDE_RUNS, 20)
    steps = b.count(CHAIN, 50)
    tag = uuid.uuid4().hex[:8]
    base, beside = f"bench/prune/{tag}/base/", f"bench/prune/{tag}/beside/"
    bases, besides = _chains(base), _chains(beside)
    windows: list[tuple[float, float]] = []
    written = 0
    env = {"TOREN_ARCHIVE_STORE": str(b.tmp / "archive-worker"), "ANTHROPIC_API_KEY": "unused"}
    worker = b.start_toren(["worker", "--app", "bench.prune_app"], env)
    try:
        await b.wait_registered(client.pool, worker)
        await _pruner_idle(client.pool)
        with b.task(
            f"prune: kernel steps, without and beside a prune, {rounds} turns", rounds
        ) as task:
            for _ in range(rounds):
                written += await write_runs(client.pool, BESIDE, n)
                for _ in range(2):
                    await _chain(client, next(bases), steps)
                windows.append(await _prune_beside(client, besides, steps))
                await _pruner_idle(client.pool)
                b.progress.advance(task)
            for _ in range(2):
                await _chain(client, next(bases), steps)
    finally:
        b.stop_workers()
    batches, deleted = await client.pool.fetchrow(
        "SELECT count(*), coalesce(sum(events), 0) FROM toren.prune_log WHERE agent = $1",
        BESIDE,
    ) or (0, 0)
    if deleted != written:
        raise RuntimeError(f"the worker's pruner deleted {deleted} of {written} events")
    baseline = await _gaps(client.pool, base)
    during = await _gaps(client.pool, beside, windows)
    if len(during) < 2:  # (smoke: the prune may be over before a chain's second step)
        during = await _gaps(client.pool, beside)
    took = sum(z - a for a, z in windows)
    b.results["prune_beside_events_per_s"] = round(written / took)
    b.results["prune_beside_steps"] = len(during)
    b.results["prune_baseline_steps"] = len(baseline)
    b.results["prune_baseline_step_median_ms"] = round(median_ms(baseline), 3)
    b.results["prune_baseline_step_p99_ms"] = round(p99_ms(baseline), 3)
    b.results["prune_baseline_step_max_ms"] = round(max(baseline) * 1000, 3)
    b.results["prune_beside_step_max_ms"] = round(max(during) * 1000, 3)
    b.record(
        "prune_beside_step_median_ms",
        round(median_ms(during), 3),
        "kernel step with the worker's pruner pruning beside it (median)",
        f"{median_ms(during):.3f} ms",
        f"{len(during):,} steps; without: {median_ms(baseline):.3f} ms "
        f"({len(baseline):,} steps; {rounds} turns each)",
    )
    b.ratio(
        "prune_beside_step_median_ratio",
        median_ms(during),
        "prune_baseline_step_median_ms",
        "kernel step median, pruning beside / not",
        "same worker, same run, taking turns",
    )
    b.record(
        "prune_beside_step_p99_ms",
        round(p99_ms(during), 3),
        "kernel step with the worker's pruner pruning beside it (p99)",
        f"{p99_ms(during):.3f} ms",
        f"without: {p99_ms(baseline):.3f} ms; the pruner: {rounds} x {n:,} runs archived and "
        f"deleted in {took:.1f} s ({written / took:,.0f} events/s, {batches} batches)",
    )
    b.ratio(
        "prune_beside_step_p99_ratio",
        p99_ms(during),
        "prune_baseline_step_p99_ms",
        "kernel step p99, pruning beside / not",
        "same worker, same run, taking turns",
    )


async def _pruner_idle(pool: asyncpg.Pool) -> None:
    """Wait for the agent's pruner to be asleep on its timer (minutes away) with nothing else in
    its mailbox: spawned and its first wake over, after a worker's start; its batches over, after
    a wake."""
    deadline = time.monotonic() + 60
    while not await pool.fetchval(
        "SELECT bool_and(timer_name = 'prune' AND visible_at > now() + interval '1 minute') "
        "FROM toren.mailbox WHERE actor_id = $1",
        pruner_id(BESIDE),
    ):
        if time.monotonic() > deadline:
            raise RuntimeError("the worker's pruner was not asleep on its timer within 60 s")
        await anyio.sleep(0.02)


async def _prune_beside(client: Client, chains: Iterator[str], steps: int) -> tuple[float, float]:
    """Wake the worker's pruner and run chains of steps until it has pruned every run; returns
    the window from the wake to the last run gone (database clock)."""
    clock = "SELECT extract(epoch FROM clock_timestamp())::float8"
    end = 0.0
    start: float = await client.pool.fetchval(clock)
    await prune_now(client, BESIDE)

    async def watch() -> None:
        nonlocal end
        deadline = time.monotonic() + 120
        while (left := await _remaining(client.pool, BESIDE)) > 0:
            if time.monotonic() > deadline:
                raise RuntimeError(f"the worker's pruner left {left} runs after 120 s")
            await anyio.sleep(0.02)
        end = await client.pool.fetchval(clock)

    async with anyio.create_task_group() as tg:
        tg.start_soon(watch)
        for actor_id in chains:
            await _chain(client, actor_id, steps)
            if end:
                break
    return start, end
