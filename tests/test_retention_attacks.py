"""Issue 32 under attack: requests racing a prune, hostile retention settings.

Each race is made deterministic by running a real prune (its own connection, its own
transaction, committed) at the exact point between two statements of the request it races: a
function the request calls is wrapped to prune first. Nothing of the database is mocked.
"""

from __future__ import annotations

from decimal import Decimal
from pathlib import Path
from typing import Any

import anyio
import pytest
from click.testing import CliRunner

from tests.test_retention import ALL, ended_run, exists, journal_rows
from toren import Client, ConfigError, Retention, Settings
from toren._core.archive import CorruptArchive, archive_journal, read_archive
from toren._core.archive_reader import ArchivesAt
from toren._core.codec import decode
from toren._core.journal import ArchiveNeeded
from toren._core.stores import LocalStore
from toren._core.workers import housekeep
from toren.cli import main
from toren.retention.runtime import Pruners
from toren.runs import Agents, start_run
from toren.runs import costs as costs_module
from toren.runs import fork as fork_module
from toren.runs import prune as prune_module
from toren.runs.audit import RunPruned, audit_record
from toren.runs.client import decide, keyed_run_id, read_run, retry, start_args
from toren.runs.costs import costs
from toren.runs.fork import fork_run
from toren.runs.prune import PruneResult, candidates, prune_batch
from toren.runs.restore import restored_run

pytestmark = pytest.mark.anyio


def prune_before(
    monkeypatch: pytest.MonkeyPatch, client: Client, owner: object, name: str
) -> list[PruneResult]:
    """Make ``owner.name`` (a function a request calls between two of its statements) first
    run a whole prune of agent ``desk`` and commit it, once; the prune's result is appended to
    the list returned."""
    real = getattr(owner, name)
    done: list[PruneResult] = []

    async def prune_first(*args: Any, **kwargs: Any) -> Any:
        if not done:
            done.append(await prune_batch(client.pool, "desk", ALL))
        return await real(*args, **kwargs)

    monkeypatch.setattr(owner, name, prune_first)
    return done


async def test_costs_read_while_a_prune_commits_count_each_run_once(
    client: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The costs surface sums audit records and live rows: read in two statements with a prune
    committing between them, the pruned runs were in neither (their cost lost)."""
    for _ in range(3):
        await ended_run(client, "desk", usd="0.25")
    [before] = await costs(client.pool, ("agent",))
    assert (before.runs, before.usd_paid) == (3, Decimal("0.75"))

    # the prune commits after the audit records were summed
    pruned = prune_before(monkeypatch, client, costs_module, "summary_totals")
    rows = await costs(client.pool, ("agent",))
    assert [p.runs for p in pruned] == [3]
    assert [(r.agent, r.runs, r.usd_paid) for r in rows] == [("desk", 3, Decimal("0.75"))]
    monkeypatch.undo()
    [after] = await costs(client.pool, ("agent",))  # and after it, all from the records
    assert (after.runs, after.pruned, after.usd_paid) == (3, 3, Decimal("0.75"))


async def test_a_keyed_start_that_found_its_run_answers_with_it_when_a_prune_takes_it_meanwhile(
    client: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A retried keyed start finds its ended run (the spawn's insert conflicts: no lock is
    taken), then a prune deletes the run and commits before the start sends its message: the
    start must still answer with the run (pruned), not fail as if no such run existed."""
    run_id = keyed_run_id("desk", "order-9")
    await ended_run(client, "desk", run_id=run_id, args=start_args("desk", "go"))
    real = client.spawn
    pruned: list[tuple[str, ...]] = []

    async def spawn_then_prune(kind: Any, actor_id: str, *args: Any, **kwargs: Any) -> bool:
        created = await real(kind, actor_id, *args, **kwargs)
        if actor_id == run_id and not created and not pruned:
            pruned.append((await prune_batch(client.pool, "desk", ALL)).trees)
        return created

    monkeypatch.setattr(client, "spawn", spawn_then_prune)
    answer = await start_run(client, "desk", "go", idempotency_key="order-9")
    assert pruned == [(run_id,)]
    assert answer == run_id
    assert not await exists(client, run_id)  # no second run under the key
    assert await client.pool.fetchval("SELECT count(*) FROM toren.mailbox") == 0


async def test_a_fork_racing_a_prune_of_its_source_is_made_whole(
    client: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fork reads its source's journal, then copies it in a later statement; a prune of the
    source committing between the two left the copy with nothing to copy: an InternalError
    (HTTP 500). The fork now holds its source's row (``FOR KEY SHARE``): the prune skips it."""
    source = await ended_run(client, "desk")
    pruned = prune_before(monkeypatch, client, fork_module, "copy_journal")
    fork_id = await fork_run(client, source, at=1, input="again")
    assert [p.runs for p in pruned] == [0]  # the source, held by the fork, was skipped
    assert await journal_rows(client, fork_id) >= 2  # the fork is whole
    assert await exists(client, source)
    assert (await prune_batch(client.pool, "desk", ALL)).trees == (source,)  # later, it goes


async def test_retry_racing_a_prune_says_the_run_was_pruned(
    client: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A retry reads the run failed, then a prune takes it: the retry says it was pruned (as
    ``say`` does), not that no such actor exists."""
    run_id = await ended_run(client, "desk", status="failed")
    from toren.runs import client as runs_client

    pruned = prune_before(monkeypatch, client, runs_client, "_not_an_ended_child")
    with pytest.raises(RunPruned, match="was pruned on"):
        await retry(client, run_id)
    assert [p.runs for p in pruned] == [1]
    with pytest.raises(RunPruned, match="was pruned on"):  # a decision sent without waiting
        await decide(client, run_id, call_id="c1", approved=True, wait=None)
    assert not await exists(client, run_id)
    assert await journal_rows(client, run_id) == 0


@pytest.mark.parametrize("keep_for", [1e300, 1e14, "99999999d"])
async def test_a_retention_period_longer_than_postgres_time_is_refused_or_prunes_nothing(
    client: Client, keep_for: Any
) -> None:
    """A period far beyond any run's age (someone's "keep forever") is refused when the policy
    is made (it failed every batch: Postgres cannot subtract it from now); the longest taken
    keeps every run."""
    await ended_run(client, "desk")
    with pytest.raises(ConfigError, match="retention keep_for must be at most 1000 years"):
        Retention(keep_for=keep_for)
    policy = Retention(keep_for="365000d", keep_failed_for=1e10)  # the longest taken
    assert await candidates(client.pool, "desk", policy) == []
    assert (await prune_batch(client.pool, "desk", policy)).runs == 0


async def test_runs_a_batch_cannot_prune_do_not_stop_the_pruning_of_the_others(
    client: Client,
) -> None:
    """Candidates are the oldest trees; a tree a batch skips for good (its journal does not
    fold here: an event type of another version) was selected again by every batch: as many of
    them as a batch takes, and no later run was ever pruned (the pruner's loop ended on a batch
    that pruned nothing). A batch now says the last tree it selected, and the next goes on
    after it."""
    stuck = [await ended_run(client, "desk") for _ in range(2)]
    for run_id in stuck:  # an event this version does not know, before the run's end
        await client.pool.execute(
            "UPDATE toren.journal SET type = 'run.from_the_future' WHERE actor_id = $1 AND seq = 2",
            run_id,
        )
    later = await ended_run(client, "desk")
    first = await prune_batch(client.pool, "desk", ALL, batch=2)
    assert (first.runs, first.skipped, first.found) == (0, 2, 2)  # the stuck ones, said
    assert first.last is not None
    assert first.last[1] == max(stuck, key=lambda r: stuck.index(r))  # the newer of them
    # The next batch of the wake goes past them, as the pruner and `jobs prune` do.
    second = await prune_batch(client.pool, "desk", ALL, batch=2, after=first.last)
    assert second.trees == (later,)
    assert not await exists(client, later)
    assert all([await exists(client, r) for r in stuck])


@pytest.mark.parametrize("value", ["99999999d", 1e14])
async def test_a_keep_setting_longer_than_postgres_time_is_refused_not_fatal_to_housekeeping(
    client: Client, value: Any
) -> None:
    """token_keep_for is one statement with every other housekeeping delete: a period Postgres
    cannot subtract from now would stop them all (expired sessions, dedupe keys...)."""
    for name in ("token_keep_for", "deadletter_keep_for"):
        with pytest.raises(ConfigError, match=f"{name} must be at most 1000 years"):
            Settings(**{name: value})
    longest = Settings(token_keep_for="365000d")  # a thousand years: housekeeping goes on
    await housekeep(client.pool, dedupe_retention=60, token_keep_for=longest.token_keep_for)
    with pytest.raises(ConfigError):  # a pruner's timer cannot be set that far ahead
        Settings(prune_every="3651d")
    with pytest.raises(ConfigError, match="dedupe_retention_seconds must be at most"):
        Settings(dedupe_retention_seconds=1e14)  # in the same statement as token_keep_for


async def test_a_bad_archive_store_is_named_as_such_by_the_pruner(client: Client) -> None:
    pruners = Pruners(
        client.pool, Agents(), batch=1, lock_timeout=0.2, every=60, store_url="s3://Not_A_Bucket"
    )
    with pytest.raises(ConfigError, match="archive store URL"):
        await pruners.store()


async def test_an_archive_a_kept_record_names_is_never_replaced_by_another_journal(
    client: Client, tmp_path: Path
) -> None:
    """Two databases sharing an archive store (staging and production, one bucket; a database
    recreated from scratch) give runs the same ids: a keyed run's id is derived from its agent
    and key alone. The second archive of a run under the same id and range has other events
    under the same key; replacing the object loses the first database's archived journal (its
    audit record's checksum no longer matches: restore refuses it as damaged)."""
    store = LocalStore(tmp_path / "archive")
    run_id = keyed_run_id("desk", "order-1")
    await ended_run(client, "desk", run_id=run_id, input="first database")
    kept = Retention(keep_last=0, archive=True)
    assert (await prune_batch(client.pool, "desk", kept, store=store)).runs == 1
    record = await audit_record(client.pool, run_id)
    assert record is not None
    assert record.archive is not None
    # The other database's run of the same id (here: the same database, its row made again).
    await ended_run(client, "desk", run_id=run_id, input="second database")
    with pytest.raises(CorruptArchive, match="another journal of this actor and range"):
        await archive_journal(client.pool, store, run_id)
    entries = await read_archive(store, record.archive, actor_id=run_id)  # still readable
    assert decode(entries[0].type, entries[0].data).input == "first database"


async def test_an_archive_store_that_fails_leaves_the_runs_for_later(
    client: Client, tmp_path: Path
) -> None:
    """A local archive directory that cannot be written (a full or read-only disk; here its
    path is under a file) fails with OSError, not the store's errors: the batch raised, so the
    pruner's tick was charged, retried and dead-lettered, and its timer never set again."""
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    run_id = await ended_run(client, "desk")
    kept = Retention(keep_last=0, archive=True)
    result = await prune_batch(client.pool, "desk", kept, store=LocalStore(blocker / "archive"))
    assert (result.runs, result.skipped) == (0, 1)
    assert await exists(client, run_id)
    assert await journal_rows(client, run_id) == 3


async def test_a_truncated_conversation_without_a_usable_snapshot_is_still_readable(
    client: Client, tmp_path: Path
) -> None:
    """A conversation's journal truncated behind its snapshot, then that snapshot unusable (a
    release that changes the state's snapshot version; snapshots "may be deleted at any time"):
    the API and the CLI read the archived events from their archive store (``archive_store``,
    ``Client.archives``), as a worker would, rather than failing until a worker next wakes the
    run and writes a new snapshot."""
    store = LocalStore(tmp_path / "archive")
    run_id = await ended_run(client, "desk")
    ref = await archive_journal(client.pool, store, run_id, first_seq=1, last_seq=1)
    async with client.pool.acquire() as conn, conn.transaction():  # as truncate_journal does
        await conn.execute(
            "INSERT INTO toren.journal_archives (actor_id, first_seq, last_seq, ref) "
            "VALUES ($1, 1, 1, $2)",
            run_id,
            ref.to_json(),
        )
        await conn.execute("DELETE FROM toren.journal WHERE actor_id = $1 AND seq = 1", run_id)
    await client.pool.execute("DELETE FROM toren.snapshots WHERE actor_id = $1", run_id)
    with pytest.raises(ArchiveNeeded, match="set archive_store"):  # a reader without one
        await read_run(client, run_id)
    client.archives = ArchivesAt(str(store.root))  # as the CLI and the API set it
    state = await read_run(client, run_id)
    assert (state.status, state.agent) == ("completed", "desk")
    env = {"TOREN_DATABASE_URL": client.url, "TOREN_ARCHIVE_STORE": str(store.root)}
    shown = await anyio.to_thread.run_sync(
        lambda: CliRunner().invoke(main, ["jobs", "show", run_id], env=env)
    )
    assert shown.exit_code == 0, shown.output
    assert "completed" in shown.output


def test_a_duration_of_thousands_of_digits_is_a_config_error() -> None:
    """Python refuses to read an integer of over 4,300 digits with a ValueError: a setting or a
    policy of that many digits escaped the clear error (a traceback, not exit 2)."""
    huge = "9" * 5000 + "d"
    with pytest.raises(ConfigError, match="not a duration"):
        Retention(keep_for=huge)
    with pytest.raises(ConfigError, match="token_keep_for is not a positive duration"):
        Settings(token_keep_for=huge)
    with pytest.raises(ConfigError, match="at most 1000 years"):  # 15 digits: read, too long
        Retention(keep_for="999999999999999s")


async def test_a_prune_racing_a_truncation_keeps_every_archived_range_in_its_record(
    client: Client, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batch reads a run's archived ranges, then archives its journal's rows: a truncation
    (the run's host, after its last snapshot) committing between the two moved the first
    events to a range the batch never saw. The audit record named neither that range nor the
    decisions in it, and the range's row went with the run: restore refused the run."""
    store = LocalStore(tmp_path / "archive")
    run_id = await ended_run(client, "desk", decided="refund approved")
    real = prune_module.archived_ranges
    truncated: list[int] = []

    async def ranges_then_truncate(db: Any, actor_id: str) -> Any:
        found = await real(db, actor_id)
        if not truncated:  # what truncate_journal commits: a range recorded, its rows gone
            ref = await archive_journal(client.pool, store, run_id, first_seq=1, last_seq=3)
            async with client.pool.acquire() as conn, conn.transaction():
                await conn.execute(
                    "INSERT INTO toren.journal_archives (actor_id, first_seq, last_seq, ref) "
                    "VALUES ($1, 1, 3, $2)",
                    run_id,
                    ref.to_json(),
                )
                await conn.execute(
                    "DELETE FROM toren.journal WHERE actor_id = $1 AND seq <= 3", run_id
                )
            truncated.append(ref.events)
        return found

    monkeypatch.setattr(prune_module, "archived_ranges", ranges_then_truncate)
    kept = Retention(keep_last=0, archive=True)
    await prune_batch(client.pool, "desk", kept, store=store)
    assert truncated == [3]
    monkeypatch.undo()
    if await exists(client, run_id):  # left for a later batch, which sees the range
        assert (await prune_batch(client.pool, "desk", kept, store=store)).runs == 1
    record = await audit_record(client.pool, run_id)
    assert record is not None
    assert [(d["tool"], d["reason"]) for d in record.decisions] == [("refund", "refund approved")]
    state, entries = await restored_run(client, run_id, store=store)
    assert [e.seq for e in entries] == [1, 2, 3, 4, 5]
    assert state.status == "completed"


async def test_a_pruner_whose_batch_fails_keeps_its_timer_and_is_never_dead_lettered(
    client: Client, db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Anything a batch did not expect (a database error, a bug): logged, and the pruner's
    # timer set all the same. A handler that raised would be retried, then dead-lettered,
    # and no timer would wake the pruner again until a worker restarted.
    from tests.conftest import running_worker, wait_for
    from toren import Agent

    async def failing(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("the database said no")

    monkeypatch.setattr("toren.actors.retention.actor.prune_batch", failing)
    agents = Agents()
    agents.register(
        [
            Agent(
                name="keeper", model="anthropic/claude-sonnet-4-6", retention=Retention(keep_last=1)
            )
        ]
    )
    async with running_worker(db_url, agents):

        async def timer_set() -> bool:
            found = await client.pool.fetchval(
                "SELECT count(*) FROM toren.mailbox WHERE actor_id = 'retention/keeper' "
                "AND timer_name = 'prune' AND visible_at > now() + interval '5 seconds'"
            )
            return bool(found)

        await wait_for(timer_set, what="the pruner's next wake set after a failed batch")
    assert await client.pool.fetchval("SELECT count(*) FROM toren.deadletters") == 0


async def test_a_decision_or_fork_for_a_pruned_run_says_it_was_pruned(
    client: Client, db_url: str
) -> None:
    """Every write to a pruned run says it was pruned (HTTP 409, CLI exit 1), as
    operations.md promises: a decision and a fork answered 404 "no run" (the CLI exit 2, "List
    runs with `toren jobs list`"), which a pruned run is not in."""
    import aiohttp

    from toren._surfaces.serve import serving
    from toren._surfaces.tokens import create_token

    run_id = await ended_run(client, "desk")
    await prune_batch(client.pool, "desk", ALL)
    uuid = run_id.removeprefix("run/")
    _, token = await create_token(client.pool, "rita", scopes=["read", "operate", "approve"])
    auth = {"Authorization": f"Bearer {token}"}
    async with serving(db_url, port=0) as base, aiohttp.ClientSession(headers=auth) as http:
        for path, body in (
            ("approvals", {"call_id": "c1", "approved": True}),
            ("fork", {"at": 1}),
        ):
            async with http.post(f"{base}/runs/{uuid}/{path}", json=body) as answer:
                detail = (await answer.json())["detail"]
                assert (path, answer.status) == (path, 409), detail
                assert "was pruned on" in detail
        async with http.post(f"{base}/runs/{uuid}/fork", json={"at": 1}) as answer:
            assert "restore it first" in (await answer.json())["detail"]
    env = {"TOREN_DATABASE_URL": db_url}
    for verb in ("approve", "deny"):
        answer = await anyio.to_thread.run_sync(
            lambda verb=verb: CliRunner().invoke(main, ["jobs", verb, run_id], env=env)
        )
        assert answer.exit_code == 1, answer.output
        assert f"run {run_id} was pruned on" in answer.output
    assert await audit_record(client.pool, run_id) is not None  # nothing else changed


@pytest.mark.parametrize(
    "option", [("--since", "0001-01-01T00:00:00+14:00"), ("--until", "9999-12-31T23:59:59-14:00")]
)
def test_a_costs_date_outside_postgres_time_is_a_usage_error(option: tuple[str, str]) -> None:
    """A date and time whose offset puts it before year 1 or after 9999 in UTC: Python reads
    it, Postgres cannot take it (asyncpg's DataError, a traceback); exit 2 before connecting."""
    answer = CliRunner().invoke(
        main, ["costs", *option], env={"TOREN_DATABASE_URL": "postgresql://nowhere/x"}
    )
    assert answer.exit_code == 2, answer.output
    assert f"{option[0]}: " in answer.output
    assert "Traceback" not in answer.output


async def test_a_keyed_start_over_http_after_a_prune_answers_with_the_pruned_run(
    client: Client, db_url: str
) -> None:
    """``POST /runs`` retried with the idempotency key of a run pruned since answered 404 "no
    run" (a client would take it for a failure and start again under a new key): it answers
    201 with the pruned run, from its audit record, as ``start_run`` does; to a token without
    ``read``, with what it sent. Another input is still 409, and no second run is made."""
    import aiohttp

    from toren._surfaces.serve import serving
    from toren._surfaces.tokens import create_token

    run_id = keyed_run_id("desk", "order-7")
    await ended_run(client, "desk", run_id=run_id, args=start_args("desk", "go"))
    await prune_batch(client.pool, "desk", ALL)
    async with serving(db_url, port=0) as base:
        for scopes in (["read", "operate"], ["operate"]):
            _, token = await create_token(client.pool, f"t{len(scopes)}", scopes=scopes)
            auth = {"Authorization": f"Bearer {token}"}
            async with aiohttp.ClientSession(headers=auth) as http:
                body = {"agent": "desk", "input": "go", "idempotency_key": "order-7"}
                async with http.post(f"{base}/runs", json=body) as answer:
                    shown = await answer.json()
                    assert answer.status == 201, shown
                assert (shown["id"], shown["agent"]) == (run_id, "desk")
                if "read" in scopes:
                    assert (shown["status"], shown["pruned"]["events"]) == ("completed", 3)
                    assert shown["receipt"]["usd_paid"] == "0.25"
                else:
                    assert (shown["input"], shown["pruned"]) == ("go", None)
                async with http.post(f"{base}/runs", json=body | {"input": "other"}) as answer:
                    assert answer.status == 409
    assert not await exists(client, run_id)
    assert await client.pool.fetchval("SELECT count(*) FROM toren.actors") == 0


async def test_jobs_prune_says_why_an_archiving_agent_is_not_pruned_without_a_store(
    client: Client, capsys: pytest.CaptureFixture[str]
) -> None:
    """An agent whose retention archives is not pruned while archive_store is unset (its
    default under home is not used for that): ``toren jobs prune`` said "N left for later"
    and nothing of why (the pruner's log line is not shown by the CLI)."""
    from toren._cli import retention as retention_cli

    run_id = await ended_run(client, "desk")
    policy = Retention(keep_last=0, archive=True)
    await retention_cli._prune(client, Settings(archive_store=None), "desk", policy)
    said = capsys.readouterr().out
    assert "desk: not pruned" in said
    assert "archive_store" in said
    assert await exists(client, run_id)


async def test_tail_and_upgrade_of_a_pruned_run_say_it_was_pruned(
    client: Client, db_url: str
) -> None:
    """``toren jobs tail`` of a pruned run (named whole, which resolves to its audit record)
    waited for its events for ever; ``jobs upgrade`` said "no actor; spawn it first"."""
    run_id = await ended_run(client, "desk", status="failed")
    await prune_batch(client.pool, "desk", ALL)
    env = {"TOREN_DATABASE_URL": db_url}
    for verb in ("tail", "upgrade"):
        with anyio.fail_after(20):
            answer = await anyio.to_thread.run_sync(
                lambda verb=verb: CliRunner().invoke(main, ["jobs", verb, run_id], env=env),
                abandon_on_cancel=True,
            )
        assert answer.exit_code == 1, answer.output
        assert f"run {run_id} was pruned on" in answer.output


async def test_costs_sum_token_counts_past_64_bits_exactly(client: Client) -> None:
    """Token counts are what the provider reports (an SDK's unbounded ``int``): one run whose
    recorded usage reached 2**63 made every ``GET /costs`` and ``toren costs`` fail (a bigint
    out of range), for every agent. They are summed as numeric, live or pruned, exactly (past
    2**64 the journal and the summary keep them as tagged text, read as the number)."""
    big = [2**63, 2**70]
    for tokens in big:
        run_id = await ended_run(client, "desk")
        await client.pool.execute(
            "UPDATE toren.actors SET summary = summary || jsonb_build_object('input_tokens', "
            "$2::text::jsonb) WHERE actor_id = $1",
            run_id,
            f'"\ue000i{tokens}"' if tokens >= 2**64 else str(tokens),
        )
    await ended_run(client, "other")
    [live, other] = await costs(client.pool, ("agent",))
    assert (live.agent, live.input_tokens, other.input_tokens) == ("desk", sum(big), 100)
    await client.pool.execute(  # the same figures kept by audit records
        "INSERT INTO toren.run_audit (run_id, root_id, agent, args, receipt, status, created_at, "
        "events) SELECT 'run/p' || n, 'run/p' || n, 'desk', '{}', jsonb_build_object("
        "'input_tokens', v, 'calls_made', v), 'completed', now(), 1 "
        "FROM unnest($1::text[]::jsonb[]) WITH ORDINALITY AS t(v, n)",
        [f'"\ue000i{t}"' if t >= 2**64 else str(t) for t in big],
    )
    [both, _] = await costs(client.pool, ("agent",))
    assert (both.runs, both.input_tokens, both.calls_made) == (4, 2 * sum(big), 2 + sum(big))
