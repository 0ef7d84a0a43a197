"""Retention (issue 32): a batch prunes ended run trees whole, keeps an audit record of each run,
never touches a run that works, waits, is queued or has mail, keeps the newest ``keep_last``,
answers a retried keyed start with the pruned run, and takes its locks as documented.

Runs here are written as a worker would leave them (their journal, their row's summary), so that
each test builds in milliseconds what a model server would take seconds for; the pruner actor
and the surfaces are tested end to end in tests/test_costs.py.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Awaitable, Callable
from decimal import Decimal
from pathlib import Path
from typing import Any

import anyio
import attrs
import pytest

from tests.conftest import WorkerFactory, person, wait_for
from toren import Agent, Client, ConfigError, Retention, Settings
from toren._agent.model import ModelResponse, Text, Usage
from toren._agent.registry import Agents
from toren._core.codec import encode
from toren._core.pruning import (
    _TREES,
    DELETE_STATEMENT,
    LOCK_STATEMENT,
    delete_trees,
    lock_timeout_statement,
    lock_trees,
)
from toren.retention import NoPruner, prune_now
from toren.runs import RUN_KIND, start_run
from toren.runs.audit import RunPruned, audit_record, insert_audit
from toren.runs.client import (
    IdempotencyConflict,
    cancel,
    decide,
    keyed_run_id,
    read_run,
    retry,
    say,
    start_args,
)
from toren.runs.events import (
    ApprovalDecided,
    ModelCalled,
    RunCompleted,
    RunFailed,
    RunStarted,
    ToolIntended,
)
from toren.runs.fork import InvalidFork, fork_run
from toren.runs.prune import PRUNE_BATCH, PRUNE_LOCK_TIMEOUT, _read_tree, candidates, prune_batch
from toren.runs.state import RunState, fold, summary

pytestmark = pytest.mark.anyio

ALL = Retention(keep_last=0)  # every ended run may go at once


async def ended_run(
    client: Client,
    agent: str,
    *,
    status: str = "completed",
    usd: str = "0.25",
    parent: str | None = None,
    run_id: str | None = None,
    input: str = "go",
    args: dict[str, Any] | None = None,
    error: str = "x",
    decided: str | None = None,
) -> str:
    """A run as a worker leaves it: started by alice, one paid model call, ended."""
    run_id = run_id or f"run/{uuid.uuid4()}"
    response = ModelResponse(
        content=(Text(text="done"),),
        stop_reason="end",
        usage=Usage(input_tokens=100, output_tokens=7),
        model="m",
    )
    ending: Any = (
        RunCompleted(output="done", at=2.0)
        if status == "completed"
        else RunFailed(error_class="cancelled" if status == "cancelled" else "tool", message=error)
    )
    decisions: list[Any] = []
    if decided is not None:  # a refund approved by bob, with ``decided`` as his reason
        decisions = [
            ToolIntended(call_id="c1", name="refund", arguments={}, idempotency_key="k"),
            ApprovalDecided(
                call_id="c1",
                approved=True,
                who="bob",
                reason=decided,
                channel="test",
                at=1.5,
                by=person("bob"),
            ),
        ]
    events = [
        RunStarted(agent=agent, input=input, at=1.0, by=person("alice"), parent=parent or ""),
        ModelCalled(step=1, digest="d", model="m", response=response, cost_usd=usd, latency_ms=5),
        *decisions,
        ending,
    ]
    await client.spawn(
        RUN_KIND,
        run_id,
        args or {"agent": agent, **({"parent": parent} if parent else {})},
        route=f"agent:{agent}",
        parent=parent,
    )
    state = RunState()
    rows = []
    for seq, event in enumerate(events, 1):
        name, data = encode(event)
        rows.append((run_id, seq, name, data))
        state = fold(state, event)
    await client.pool.executemany(
        "INSERT INTO toren.journal (actor_id, seq, epoch, type, data) VALUES ($1, $2, 1, $3, $4)",
        rows,
    )
    await client.pool.execute(
        "UPDATE toren.actors SET summary = $2 WHERE actor_id = $1", run_id, summary(state)
    )
    return run_id


async def exists(client: Client, actor_id: str) -> bool:
    return bool(
        await client.pool.fetchval(
            "SELECT count(*) FROM toren.actors WHERE actor_id = $1", actor_id
        )
    )


async def journal_rows(client: Client, actor_id: str) -> int:
    n: int = await client.pool.fetchval(
        "SELECT count(*) FROM toren.journal WHERE actor_id = $1", actor_id
    )
    return n


async def test_a_parent_and_its_children_are_pruned_together_with_their_audit_records(
    client: Client,
) -> None:
    root = await ended_run(client, "desk", usd="0.5")
    child = await ended_run(client, "researcher", parent=root, usd="0.125")
    hostile = "bad \x00 text \ud800 here"
    grandchild = await ended_run(
        client, "researcher", parent=child, status="failed", error=hostile, decided=hostile
    )
    # the child's sandbox, stopped: it goes with its run
    await client.spawn("toren.sandbox", "sandbox/x", {}, parent=child)
    before = await read_run(client, root)

    result = await prune_batch(client.pool, "desk", ALL)

    assert (result.trees, result.runs, result.events, result.skipped) == ((root,), 3, 11, 0)
    assert result.bytes > 0
    for gone in (root, child, grandchild, "sandbox/x"):
        assert not await exists(client, gone)
        assert await journal_rows(client, gone) == 0
    record = await audit_record(client.pool, root)
    assert record is not None
    assert (record.agent, record.status, record.root_id, record.parent) == (
        "desk",
        "completed",
        root,
        None,
    )
    assert record.started_by == {
        "kind": "os_user",
        "id": "test-alice",
        "name": "alice",
        "via": "test",
    }
    assert Decimal(record.receipt["usd_paid"]) == before.usd_paid == Decimal("0.5")
    assert (record.receipt["calls_made"], record.events) == (1, 3)
    assert (record.args, record.archive) == ({"agent": "desk"}, None)
    kid = await audit_record(client.pool, grandchild)
    assert kid is not None
    assert (kid.root_id, kid.parent, kid.status) == (root, child, "failed")
    assert kid.error == "bad \\u0000 text \\ud800 here"  # a text column: escaped readably
    [decision] = kid.decisions  # jsonb: kept exactly
    assert (decision["tool"], decision["who"], decision["reason"]) == ("refund", "bob", hostile)
    assert decision["by"]["id"] == "test-bob"
    # the batch is logged
    logged = await client.pool.fetchrow("SELECT runs, events FROM toren.prune_log")
    assert (logged["runs"], logged["events"]) == (3, 11)
    # pruning again finds nothing and writes nothing
    again = await prune_batch(client.pool, "desk", ALL)
    assert (again.runs, again.trees) == (0, ())
    assert await client.pool.fetchval("SELECT count(*) FROM toren.run_audit") == 3


async def test_working_waiting_queued_and_mailed_runs_are_never_pruned(client: Client) -> None:
    running = await start_run(client, "desk", "work")  # a start waiting in its mailbox
    parked = await ended_run(client, "desk")
    await client.pool.execute(
        'UPDATE toren.actors SET summary = summary || \'{"status": "parked"}\' WHERE actor_id = $1',
        parked,
    )
    mailed = await ended_run(client, "desk")
    await say(client, mailed, "one more thing", by=person("bob"))  # continues the conversation
    # a tree with one run still working below an ended root
    root = await ended_run(client, "desk")
    working_child = await ended_run(client, "researcher", parent=root)
    await client.pool.execute(
        'UPDATE toren.actors SET summary = summary || \'{"status": "running"}\' '
        "WHERE actor_id = $1",
        working_child,
    )
    # a channel's conversation run: never pruned by age or count
    await client.spawn("toren.channel", "channel/telegram/bot", {})
    chat = await ended_run(client, "desk", parent="channel/telegram/bot")
    done = await ended_run(client, "desk")

    result = await prune_batch(client.pool, "desk", ALL)

    assert result.trees == (done,)
    for kept in (running, parked, mailed, root, working_child, chat):
        assert await exists(client, kept), kept


async def test_keep_last_and_keep_for_keep_what_they_say(client: Client) -> None:
    runs = [await ended_run(client, "desk") for _ in range(5)]
    failed = await ended_run(client, "desk", status="failed")
    # their creation in order; the journals of the first three ended two days ago
    for n, run_id in enumerate([*runs, failed]):
        await client.pool.execute(
            "UPDATE toren.actors SET created_at = now() - make_interval(hours => 100 - $2) "
            "WHERE actor_id = $1",
            run_id,
            n,
        )
    await client.pool.execute(
        "UPDATE toren.journal SET created_at = now() - interval '2 days' "
        "WHERE actor_id = ANY($1::text[])",
        [*runs[:3], failed],
    )
    # keep_for a day, failed runs a week: the three old completed runs go, the failed one stays
    by_age = await prune_batch(client.pool, "desk", Retention(keep_for="1d", keep_failed_for="7d"))
    assert by_age.trees == tuple(runs[:3])
    # keep the newest 2 of the ended runs left (runs[3], runs[4], failed): runs[3] goes
    by_count = await prune_batch(client.pool, "desk", Retention(keep_last=2))
    assert by_count.trees == (runs[3],)
    # both rules: only what both let go (the failed run is old but among the newest 2)
    both = await prune_batch(client.pool, "desk", Retention(keep_for="1d", keep_last=2))
    assert both.trees == ()
    # another agent's runs are not this agent's to prune
    assert (await prune_batch(client.pool, "other", ALL)).trees == ()
    # a dry run says what would go and deletes nothing
    dry = await prune_batch(client.pool, "desk", ALL, dry_run=True)
    assert dry.dry_run
    assert set(dry.trees) == {runs[4], failed}
    assert await exists(client, failed)


async def test_a_keyed_start_retried_after_pruning_answers_with_the_pruned_run(
    client: Client,
) -> None:
    run_id = keyed_run_id("desk", "order-17")
    args = {**start_args("desk", "refund order 17"), "concurrency_key": "c"}
    await ended_run(client, "desk", run_id=run_id, input="refund order 17", args=args)
    assert (await prune_batch(client.pool, "desk", ALL)).trees == (run_id,)

    again = await start_run(
        client, "desk", "refund order 17", idempotency_key="order-17", concurrency_key="c"
    )
    assert again == run_id
    assert not await exists(client, run_id)  # no second run: the insert was undone
    assert await client.pool.fetchval("SELECT count(*) FROM toren.mailbox") == 0
    with pytest.raises(IdempotencyConflict):
        await start_run(client, "desk", "something else", idempotency_key="order-17")
    with pytest.raises(IdempotencyConflict):  # the same input without its concurrency key
        await start_run(client, "desk", "refund order 17", idempotency_key="order-17")
    # the same key for another agent is that agent's own run
    assert await start_run(client, "other", "x", idempotency_key="order-17") != run_id
    # a pruned run takes nothing more, and says why
    for act in (
        lambda: say(client, run_id, "hello"),
        lambda: cancel(client, run_id),
        lambda: retry(client, run_id),
        lambda: decide(client, run_id, call_id="c1", approved=True),
        lambda: read_run(client, run_id),
    ):
        with pytest.raises(RunPruned, match=r"was pruned on \d{4}-\d\d-\d\d"):
            await act()
    with pytest.raises(InvalidFork, match=r"run was pruned on \d{4}-\d\d-\d\d; restore it first"):
        await fork_run(client, run_id, at=1, message="again")


async def test_a_batch_locks_with_skip_locked_under_a_short_lock_timeout(client: Client) -> None:
    """Structural: the numbers and the statements, not timing."""
    assert (PRUNE_BATCH, PRUNE_LOCK_TIMEOUT) == (100, 0.2)
    assert lock_timeout_statement(200) == "SET LOCAL lock_timeout = '200ms'"
    assert "FOR UPDATE OF a SKIP LOCKED" in LOCK_STATEMENT
    assert "FOR UPDATE" not in DELETE_STATEMENT  # the delete takes only the rows locked before
    assert not re.search(r"\bFOR (UPDATE|SHARE|NO KEY|KEY)\b", _TREES)  # selecting locks none
    # What a batch's transaction sets and takes, seen from inside it: a run another transaction
    # holds (a step's statement locks its row) is skipped, never waited for.
    held = await ended_run(client, "desk")
    free = await ended_run(client, "desk")
    seen: list[str] = []
    original = client.pool.acquire

    async with client.pool.acquire() as step, step.transaction():
        await step.execute("SELECT 1 FROM toren.actors WHERE actor_id = $1 FOR UPDATE", held)

        class Spy:
            def __init__(self, conn: Any) -> None:
                self._conn = conn

            def __getattr__(self, name: str) -> Any:
                return getattr(self._conn, name)

            async def fetch(self, sql: str, *args: Any) -> Any:
                if "SKIP LOCKED" in sql:
                    seen.append(await self._conn.fetchval("SHOW lock_timeout"))
                return await self._conn.fetch(sql, *args)

        class Acquired:
            def __init__(self) -> None:
                self._cm = original()

            async def __aenter__(self) -> Any:
                return Spy(await self._cm.__aenter__())

            async def __aexit__(self, *exc: Any) -> Any:
                return await self._cm.__aexit__(*exc)

        class SpyPool:
            def __getattr__(self, name: str) -> Any:
                return getattr(client.pool, name)

            def acquire(self) -> Any:
                return Acquired()

        result = await prune_batch(SpyPool(), "desk", ALL, lock_timeout=0.2)  # type: ignore[arg-type]

    assert seen == ["200ms"]
    assert (result.trees, result.skipped) == ((free,), 1)
    assert await exists(client, held)
    assert (await prune_batch(client.pool, "desk", ALL)).trees == (held,)  # later, it goes


def test_a_retention_policy_that_is_not_one_is_refused() -> None:
    with pytest.raises(ConfigError, match="needs keep_for, keep_failed_for, keep_last"):
        Retention()
    with pytest.raises(ConfigError, match="keep_last must be a whole number"):
        Retention(keep_last=-1)
    with pytest.raises(ConfigError, match="not a duration"):
        Retention(keep_for="a while")
    with pytest.raises(ConfigError, match="conversation_keep_for needs archive"):
        Retention(conversation_keep_for="1d")
    assert Retention(keep_for="30d").keep_for == 30 * 86400.0
    assert Retention.from_json(Retention(keep_last=3, archive=True).to_json()) == Retention(
        keep_last=3, archive=True
    )


async def _racing_a_prune(
    client: Client, run_id: str, racer: Callable[[], Awaitable[None]], *, waits_on: str, what: str
) -> None:
    """Prune ``run_id``'s tree in a transaction held open until ``racer``, started meanwhile,
    waits for a lock in a statement that names ``waits_on``; then commit the prune."""
    [tree] = await candidates(client.pool, "desk", ALL)
    read = await _read_tree(client.pool, tree, None)
    async with client.pool.acquire() as conn:
        prune = conn.transaction()
        await prune.start()
        assert set(await lock_trees(conn, [run_id], lock_timeout_ms=200)) == {run_id}
        await insert_audit(conn, [r.record for r in read if r.record is not None])
        await delete_trees(conn, [run_id])

        async def waiting() -> bool:
            n = await client.pool.fetchval(
                "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                "AND query LIKE $1",
                f"%{waits_on}%",
            )
            return bool(n)

        async with anyio.create_task_group() as tg:
            tg.start_soon(racer)
            await wait_for(waiting, what=what)
            await prune.commit()


async def test_a_keyed_start_racing_a_prune_waits_for_it_and_answers_with_the_pruned_run(
    client: Client,
) -> None:
    run_id = keyed_run_id("desk", "k")
    await ended_run(client, "desk", run_id=run_id, input="go", args=start_args("desk", "go"))
    answers: list[str] = []

    async def start() -> None:
        answers.append(await start_run(client, "desk", "go", idempotency_key="k"))

    # the start's insert waits on the row the prune deleted
    await _racing_a_prune(
        client,
        run_id,
        start,
        waits_on="INSERT INTO toren.actors",
        what="the start waiting for the prune",
    )
    assert answers == [run_id]
    assert not await exists(client, run_id)  # no second run under the key
    assert await client.pool.fetchval("SELECT count(*) FROM toren.mailbox") == 0


def test_the_retention_table_merges_into_the_codes_policy_and_bad_ones_are_refused(
    tmp_path: Path,
) -> None:
    config = tmp_path / "toren.toml"
    code = Agent(
        name="boss", model="anthropic/claude-sonnet-4-6", retention=Retention(keep_for="1h")
    )
    config.write_text('[agents.boss.retention]\nkeep_last = 5\nkeep_failed_for = "30d"\n')
    settings = Settings.load(config_file=config, env={})
    (merged,) = Agents().register([code], settings.agents)
    assert merged.retention == Retention(keep_for=3600, keep_last=5, keep_failed_for="30d")
    # a table alone gives an agent without one in its code a policy
    (plain_agent,) = Agents().register([attrs.evolve(code, retention=None)], settings.agents)
    assert plain_agent.retention == Retention(keep_last=5, keep_failed_for="30d")
    bad = {
        'keep_last = "many"': "keep_last must be a whole number",
        'keep_for = "soon"': "not a duration",
        "keep_for = -3": "duration must be positive",
        "archive = 1": "archive must be true or false",
        "forever = true": r"unknown key\(s\) in the retention table",
    }
    for line, message in bad.items():
        config.write_text(f"[agents.boss.retention]\n{line}\n")
        with pytest.raises(ConfigError, match=message):
            Settings.load(config_file=config, env={})
    # the settings of the batches, with the numbers docs/operations.md gives
    defaults = Settings()
    assert (defaults.prune_batch, defaults.prune_lock_timeout, defaults.prune_every) == (
        100,
        0.2,
        600.0,
    )
    env = {"TOREN_PRUNE_LOCK_TIMEOUT": "50ms", "TOREN_PRUNE_EVERY": "1h"}
    config.write_text("")
    loaded = Settings.load(config_file=config, env=env)
    assert (loaded.prune_lock_timeout, loaded.prune_every) == (0.05, 3600.0)
    with pytest.raises(ConfigError, match="prune_batch must be"):
        Settings(prune_batch=0)


async def test_a_pruner_killed_or_cut_off_mid_batch_loses_nothing_and_resumes(
    client: Client, workers: WorkerFactory, tmp_path: Path
) -> None:
    """SIGKILL, then ``pg_terminate_backend``, at ``prune.deleting`` (audit records written and
    rows deleted, not committed): nothing is pruned by the cut batch, and the pruner (taken over
    by another worker, or retried on its own) prunes it all once."""
    trees = [await ended_run(client, "boss") for _ in range(3)]
    children = [await ended_run(client, "helper", parent=t) for t in trees]
    for table in ("journal", "actors"):
        await client.pool.execute(
            f"UPDATE toren.{table} SET created_at = now() - interval '2 hours'"
        )
    points = tmp_path / "killed"
    points.mkdir()
    armed = {"kill_point": "prune.deleting", "kill_point_dir": str(points)}

    first = workers("tests.retention_app", **armed)
    await wait_for(lambda: _exists(points / "hit"), timeout=30, what="the batch at its commit")
    first.kill()
    assert await client.pool.fetchval("SELECT count(*) FROM toren.run_audit") == 0
    for run_id in trees + children:
        assert await exists(client, run_id)
        assert await journal_rows(client, run_id) == 3

    (points / "hit").unlink()
    workers("tests.retention_app", **armed)
    await wait_for(lambda: _exists(points / "hit"), timeout=30, what="the retried batch")
    assert await client.pool.fetchval(
        "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
        "WHERE application_name LIKE 'toren-worker%' AND datname = current_database()"
    )
    (points / "go").touch()

    async def pruned() -> bool:
        n = await client.pool.fetchval("SELECT count(*) FROM toren.run_audit")
        return n == 6 and not await exists(client, trees[0])

    await wait_for(pruned, timeout=30, what="the pruner resumed")
    for run_id in trees + children:
        assert not await exists(client, run_id)
        assert await journal_rows(client, run_id) == 0
    assert await client.pool.fetchval("SELECT sum(runs) FROM toren.prune_log") == 6


async def _exists(path: Path) -> bool:
    return path.exists()


async def test_a_message_racing_a_prune_waits_for_it_and_is_refused_as_pruned(
    client: Client,
) -> None:
    run_id = await ended_run(client, "desk")
    refused: list[BaseException] = []

    async def send() -> None:
        try:
            await say(client, run_id, "one more thing")
        except RunPruned as exc:
            refused.append(exc)

    # the message's insert waits on the row being deleted
    await _racing_a_prune(
        client, run_id, send, waits_on="toren.mailbox", what="the message waiting for the prune"
    )
    assert len(refused) == 1
    assert "was pruned on" in str(refused[0])
    assert await client.pool.fetchval("SELECT count(*) FROM toren.mailbox") == 0


async def test_asking_an_agent_without_a_pruner_to_prune_says_why(client: Client) -> None:
    with pytest.raises(NoPruner, match="agent 'desk' has no pruner: no worker running it"):
        await prune_now(client, "desk")


async def test_a_batch_that_meets_a_lock_past_its_timeout_deletes_nothing(client: Client) -> None:
    run_id = await ended_run(client, "desk")
    async with client.pool.acquire() as other, other.transaction():
        # a lock no SKIP LOCKED passes (a table's, as a migration takes): waited for 200 ms
        await other.execute("LOCK TABLE toren.prune_log IN ACCESS EXCLUSIVE MODE")
        result = await prune_batch(client.pool, "desk", ALL, lock_timeout=0.2)
    assert (result.trees, result.skipped) == ((), 1)
    assert await exists(client, run_id)
    assert await journal_rows(client, run_id) == 3
    assert await audit_record(client.pool, run_id) is None  # rolled back with the rest
    assert (await prune_batch(client.pool, "desk", ALL)).trees == (run_id,)
