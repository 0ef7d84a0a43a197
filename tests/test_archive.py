"""Journal archives (toren._core.archive): a run's journal round-trips through a local directory
and through moto's S3 server with the real aioboto3 client to the same events, fold, timeline
and receipt; damaged archives are refused naming what is wrong; archiving again is idempotent;
the recorded format-1 fixture stays readable; and ``toren jobs restore`` (and ``GET
/runs/{uuid}/archive``) show a pruned run from its archive, read-only, or write it back as a
live, ended run."""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import shutil
import zlib
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import aioboto3  # type: ignore[import-untyped]
import aiohttp
import anyio
import attrs
import pytest

from tests import test_workspace_store
from toren import Client
from toren._core import archive
from toren._core.archive import (
    ARCHIVE_FORMAT,
    ArchiveRef,
    CorruptArchive,
    MissingArchive,
    archive_journal,
    archive_key,
    key_segment,
    open_archive_store,
    parse_archive,
    read_archive,
    segment_text,
)
from toren._core.codec import decode
from toren._core.journal import JournalEntry, read_journal
from toren._core.stores import LocalStore, S3Store
from toren._surfaces.http.common import ServerOptions
from toren._surfaces.serve import serving
from toren._surfaces.tokens import create_token
from toren.runs import RunState, fold
from toren.runs.receipt import receipt

JOURNALS = Path(__file__).parent / "fixtures" / "journals"
ARCHIVES = Path(__file__).parent / "fixtures" / "archives"
RUN = "run/00000000-0000-4000-8000-000000000001"
T0 = datetime(2026, 12, 7, 10, 0, tzinfo=UTC)
pytestmark = pytest.mark.anyio

HOSTILE = "\ue000s hostile \x00 NUL, \ud800 lone surrogate, \\x00 escaped"


def recorded_run() -> list[dict[str, Any]]:
    """The recorded journal holding every run event type, with hostile text in its first human
    message (a NUL, a lone surrogate, a leading private-use mark: what jsonb cannot hold)."""
    entries: list[dict[str, Any]] = json.loads((JOURNALS / "run_v1_every_event.json").read_text())
    for entry in entries:
        if entry["type"] == "message.received":
            entry["data"]["text"] = HOSTILE
            break
    return entries


async def insert_journal(client: Client, actor_id: str, entries: list[dict[str, Any]]) -> None:
    await client.pool.execute(
        "INSERT INTO toren.actors (actor_id, kind, status) VALUES ($1, 'toren.run', 'live')",
        actor_id,
    )
    await client.pool.executemany(
        "INSERT INTO toren.journal (actor_id, seq, epoch, type, data, created_at) "
        "VALUES ($1, $2, 1, $3, $4, $5)",
        [
            (actor_id, e["seq"], e["type"], e["data"], T0 + timedelta(seconds=e["seq"]))
            for e in entries
        ],
    )


def folded(events: list[JournalEntry]) -> RunState:
    state = RunState()
    for e in events:
        state = fold(state, decode(e.type, e.data))
    return state


@pytest.fixture
def store(tmp_path: Path) -> LocalStore:
    return LocalStore(tmp_path / "archive")


# -- round trip, idempotency ------------------------------------------------------------------


async def test_a_journal_round_trips_to_the_same_events_fold_and_receipt(
    client: Client, store: LocalStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(archive, "PAGE", 7)  # the 31 events read in 5 pages
    monkeypatch.setattr(archive, "_PIECE", 64)  # and decompressed 64 bytes at a time
    await insert_journal(client, RUN, recorded_run())
    journal = await read_journal(client.pool, RUN)

    ref = await archive_journal(client.pool, store, RUN)

    assert (
        ref.location
        == "journals/toren.run/run_2F00000000-0000-4000-8000-000000000001/1-31.jsonl.gz"
    )
    assert (ref.first_seq, ref.last_seq, ref.events, ref.format) == (1, 31, 31, ARCHIVE_FORMAT)
    assert ref.bytes == (store.root / ref.location).stat().st_size
    assert ArchiveRef.from_json(json.loads(json.dumps(ref.to_json()))) == ref
    events = await read_archive(store, ref, actor_id=RUN)
    assert events == journal  # seq, epoch, type, data (hostile text exact) and created_at
    assert any(e.data.get("text") == HOSTILE for e in events)
    assert folded(events) == folded(journal)
    assert receipt(folded(events)) == receipt(folded(journal))

    # Archiving again writes nothing new: the same key, bytes and checksum.
    mtime = (store.root / ref.location).stat().st_mtime_ns
    assert await archive_journal(client.pool, store, RUN) == ref
    assert (store.root / ref.location).stat().st_mtime_ns == mtime

    # A range: its own key, only its events; an empty range is an archive of no events.
    part = await archive_journal(client.pool, store, RUN, first_seq=5, last_seq=9)
    assert part.location.endswith("/5-9.jsonl.gz")
    assert await read_archive(store, part) == journal[4:9]
    empty = await archive_journal(client.pool, store, RUN, first_seq=40)
    assert (empty.first_seq, empty.last_seq, empty.events) == (40, 39, 0)
    assert await read_archive(store, empty) == []


async def test_an_archive_of_other_bytes_with_the_same_events_is_kept(
    client: Client, store: LocalStore
) -> None:
    """Another Toren (another zlib) may have compressed the same events otherwise: the object
    there is kept, and its checksum is the one returned, so a reference to it stays true."""
    await insert_journal(client, RUN, recorded_run()[:3])
    ref = await archive_journal(client.pool, store, RUN)
    path = store.root / ref.location
    other = gzip.compress(zlib.decompress(path.read_bytes(), 31), compresslevel=1, mtime=7)
    path.write_bytes(other)

    again = await archive_journal(client.pool, store, RUN)

    assert path.read_bytes() == other
    assert again.sha256 != ref.sha256
    assert again.bytes == len(other)
    assert len(await read_archive(store, again)) == 3


class Forgetful(LocalStore):
    """A store that gives back other bytes than it was given (a broken disk or proxy)."""

    async def get(self, key: str) -> bytes:
        return (await super().get(key))[:-1] + b"?"


async def test_an_archive_the_store_gives_back_otherwise_is_an_error(
    client: Client, tmp_path: Path
) -> None:
    await insert_journal(client, RUN, recorded_run()[:3])
    with pytest.raises(CorruptArchive, match="the store gave back other bytes than were written"):
        await archive_journal(client.pool, Forgetful(tmp_path / "forgetful"), RUN)


# -- damage ----------------------------------------------------------------------------------


@pytest.fixture
async def archived(client: Client, store: LocalStore) -> ArchiveRef:
    await insert_journal(client, RUN, recorded_run())
    return await archive_journal(client.pool, store, RUN)


def rewrite(store: LocalStore, ref: ArchiveRef, lines: list[bytes]) -> ArchiveRef:
    """``ref``'s object replaced by ``lines``, and a reference whose checksum matches it (so
    that what is checked is the content, not only the checksum)."""
    data = gzip.compress(b"".join(line + b"\n" for line in lines), mtime=0)
    (store.root / ref.location).write_bytes(data)
    return attrs.evolve(ref, sha256=hashlib.sha256(data).hexdigest(), bytes=len(data))


def lines_of(store: LocalStore, ref: ArchiveRef) -> list[bytes]:
    return gzip.decompress((store.root / ref.location).read_bytes()).splitlines()


async def test_a_flipped_byte_is_refused_by_its_checksum(
    store: LocalStore, archived: ArchiveRef
) -> None:
    path = store.root / archived.location
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))

    with pytest.raises(CorruptArchive, match=r"checksum is .* not .* as recorded") as bad:
        await read_archive(store, archived)
    assert bad.value.location == archived.location
    assert "copy the object back from a backup" in str(bad.value)


@pytest.mark.parametrize(
    ("damage", "says"),
    [
        (lambda data: data[: len(data) - 20], "truncated"),
        (lambda data: data[:10] + b"\xff" * 20 + data[30:], "not a valid gzip stream"),
        (lambda data: data + data, "bytes follow its gzip stream"),
        (lambda data: gzip.compress(zlib.decompress(data, 31)[:-40], mtime=0), "cut short"),
    ],
    ids=["truncated", "bad-gzip", "trailing", "cut-line"],
)
async def test_a_damaged_stream_is_refused_naming_what_is_wrong(
    store: LocalStore, archived: ArchiveRef, damage: Any, says: str
) -> None:
    path = store.root / archived.location
    data = damage(path.read_bytes())
    path.write_bytes(data)
    ref = attrs.evolve(archived, sha256=hashlib.sha256(data).hexdigest(), bytes=len(data))
    with pytest.raises(CorruptArchive, match=says):
        await read_archive(store, ref)


async def test_another_actors_archive_under_this_key_is_refused(
    client: Client, store: LocalStore, archived: ArchiveRef
) -> None:
    other = "run/00000000-0000-4000-8000-000000000002"
    await insert_journal(client, other, recorded_run())
    theirs = await archive_journal(client.pool, store, other)
    shutil.copy(store.root / theirs.location, store.root / archived.location)
    ref = attrs.evolve(archived, sha256=theirs.sha256, bytes=theirs.bytes)

    with pytest.raises(CorruptArchive, match=f"actor '{other}', not '{RUN}'"):
        await read_archive(store, ref)
    with pytest.raises(CorruptArchive, match="not 'run/x'"):
        await read_archive(store, theirs, actor_id="run/x")


async def test_a_wrong_format_version_is_refused_saying_upgrade(
    store: LocalStore, archived: ArchiveRef
) -> None:
    lines = lines_of(store, archived)
    header = json.loads(lines[0])
    ref = rewrite(store, archived, [json.dumps({**header, "format": 2}).encode(), *lines[1:]])

    with pytest.raises(CorruptArchive, match=r"format 2, which this Toren does not read.*upgrade"):
        await read_archive(store, ref)
    with pytest.raises(CorruptArchive, match="reference says format 9"):
        await read_archive(store, attrs.evolve(ref, format=9))


@pytest.mark.parametrize(
    ("edit", "says"),
    [
        (lambda lines: [lines[0], *lines[2:]], "holds 30 events, its header says 31"),
        (lambda lines: [*lines, lines[-1]], r"more events than its header says \(31\)"),
        (
            lambda lines: [lines[0], lines[2], lines[1], *lines[3:]],
            "line 3 has seq 1, out of order",
        ),
        (lambda lines: [lines[0], b"{not json", *lines[2:]], "line 2 is not JSON"),
        (lambda lines: [lines[0], b'{"seq": 1}', *lines[2:]], "line 2 is not an event"),
        (lambda lines: [b"[]", *lines[1:]], "not the header of a journal archive"),
    ],
    ids=["missing-line", "extra-line", "order", "not-json", "not-event", "no-header"],
)
async def test_a_bad_line_is_refused_naming_it(
    store: LocalStore, archived: ArchiveRef, edit: Any, says: str
) -> None:
    ref = rewrite(store, archived, edit(lines_of(store, archived)))
    with pytest.raises(CorruptArchive, match=says):
        await read_archive(store, ref)


async def test_a_missing_archive_is_refused_naming_the_store(
    store: LocalStore, archived: ArchiveRef
) -> None:
    (store.root / archived.location).unlink()
    with pytest.raises(MissingArchive, match="no such object in the archive store"):
        await read_archive(store, archived)


@pytest.mark.parametrize("location", ["../../../etc/passwd", "", "journals", "journals/toren.run"])
async def test_a_reference_naming_no_archive_key_is_refused_as_unusable(
    store: LocalStore, archived: ArchiveRef, location: str
) -> None:
    """An audit record whose archive location is edited (a path out of the store, a folder of
    it, nothing): the store's ValueError or IsADirectoryError went up raw (a traceback from
    `toren jobs restore`, HTTP 500 from `GET /runs/{id}/archive`); now a CorruptArchive (exit 1,
    502) naming it. Nothing outside the store is read."""
    with pytest.raises(CorruptArchive, match="not the key of an archive object"):
        await read_archive(store, attrs.evolve(archived, location=location))


def test_a_reference_that_is_not_one_is_refused() -> None:
    with pytest.raises(CorruptArchive, match="reference has no integer last_seq"):
        ArchiveRef.from_json({"location": "journals/x", "sha256": "ab", "first_seq": 1})


def test_key_segments_are_reversible_and_store_keys() -> None:
    for text in ["run/1", "a_b", ".hidden", "naïve 💥", "retention/agent.x", ""]:
        segment = key_segment(text)
        assert segment_text(segment) == text
        assert "/" not in segment
        assert not segment.startswith(".")
    assert archive_key("toren.run", "run/1", 1, 2) == "journals/toren.run/run_2F1/1-2.jsonl.gz"


# -- the recorded fixture ---------------------------------------------------------------------


def fixture_events() -> list[tuple[int, str, Any]]:
    return [(e["seq"], e["type"], e["data"]) for e in recorded_run()]


async def test_the_recorded_format_1_archive_reads_back_as_recorded(
    client: Client, tmp_path: Path
) -> None:
    """``tests/fixtures/archives/v1_run.*``: an archive written by format 1 (the recorded
    journal with every run event type and hostile text). Every later Toren must read it to the
    same events and fold. TOREN_RECORD_ARCHIVES=1 writes it again (only when the format is new:
    a new version gets new files, the old ones stay)."""
    if os.environ.get("TOREN_RECORD_ARCHIVES"):
        await insert_journal(client, RUN, recorded_run())
        recorder = LocalStore(tmp_path / "recorded")
        ref = await archive_journal(client.pool, recorder, RUN)
        ARCHIVES.mkdir(parents=True, exist_ok=True)
        shutil.copy(recorder.root / ref.location, ARCHIVES / f"v{ref.format}_run.jsonl.gz")
        (ARCHIVES / f"v{ref.format}_run.ref.json").write_text(
            json.dumps(ref.to_json(), indent=1, sort_keys=True) + "\n"
        )
    for name in sorted(p.name for p in ARCHIVES.glob("v*_run.ref.json")):
        ref = ArchiveRef.from_json(json.loads((ARCHIVES / name).read_text()))
        data = (ARCHIVES / name.replace(".ref.json", ".jsonl.gz")).read_bytes()
        events = parse_archive(data, ref, actor_id=RUN)
        assert [(e.seq, e.type, e.data) for e in events] == fixture_events(), name
        assert [e.at for e in events] == [T0 + timedelta(seconds=e.seq) for e in events]
        assert folded(events).status == "cancelled"
    assert (ARCHIVES / "v1_run.ref.json").is_file()


# -- S3 (moto's server, real aioboto3) ---------------------------------------------------------


moto_url = test_workspace_store.moto_url  # moto's S3 server on 127.0.0.1, per module
s3_env = test_workspace_store.s3_env  # static keys for it


@pytest.fixture
async def s3_store(
    moto_url: str, s3_env: None, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[S3Store]:
    """The archive store as the settings name it: ``s3://archives/toren``, the endpoint from
    ``TOREN_S3_ENDPOINT_URL`` (moto's server)."""
    from toren._core.config import WorkerSettings

    session = aioboto3.Session()
    async with session.client("s3", endpoint_url=moto_url, region_name="us-east-1") as s3:
        await s3.create_bucket(Bucket="archives")
    monkeypatch.setenv("TOREN_S3_ENDPOINT_URL", moto_url)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    settings = WorkerSettings.load(env={"TOREN_ARCHIVE_STORE": "s3://archives/toren"})
    store = open_archive_store(settings)
    assert isinstance(store, S3Store)
    yield store
    await store.close()


async def test_a_journal_round_trips_through_s3(client: Client, s3_store: S3Store) -> None:
    await insert_journal(client, RUN, recorded_run())
    journal = await read_journal(client.pool, RUN)

    ref = await archive_journal(client.pool, s3_store, RUN)
    assert await archive_journal(client.pool, s3_store, RUN) == ref

    assert await read_archive(s3_store, ref) == journal
    assert receipt(folded(await read_archive(s3_store, ref))) == receipt(folded(journal))
    with pytest.raises(MissingArchive, match="s3://archives/toren/"):
        await read_archive(s3_store, attrs.evolve(ref, location=ref.location + "x"))


# -- the archive_store setting -----------------------------------------------------------------


def test_archive_store_comes_from_its_setting_and_defaults_under_home(tmp_path: Path) -> None:
    from toren._core.config import WorkerSettings
    from toren._core.errors import ConfigError

    default = open_archive_store(WorkerSettings.load(env={"TOREN_HOME": str(tmp_path)}))
    assert isinstance(default, LocalStore)
    assert default.root == tmp_path / "archive"
    s3 = open_archive_store(WorkerSettings.load(env={"TOREN_ARCHIVE_STORE": "s3://arch/toren"}))
    assert isinstance(s3, S3Store)
    assert (s3.bucket, s3.prefix) == ("arch", "toren/")

    secret = "gs://sk-ant-secret/x"
    with pytest.raises(ConfigError, match=r"archive store URL \(archive_store; not shown\)") as bad:
        open_archive_store(WorkerSettings.load(env={"TOREN_ARCHIVE_STORE": secret}))
    assert "secret" not in str(bad.value)
    assert "workspace" not in str(bad.value)


# -- restore: toren jobs restore RUN [--into-journal] -------------------------------------------


async def prune(client: Client, run_id: str, ref: ArchiveRef | None) -> None:
    """What the pruner does to a run, as the test needs it: its audit record written, its
    journal and row deleted."""
    async with client.pool.acquire() as conn, conn.transaction():
        row = await conn.fetchrow(
            "SELECT args, created_at FROM toren.actors WHERE actor_id = $1", run_id
        )
        await conn.execute(
            "INSERT INTO toren.run_audit (run_id, root_id, agent, args, receipt, status, "
            "created_at, archive, events) VALUES ($1, $1, 'support', $2, '{}', 'cancelled', $3, "
            "$4, 31)",
            run_id,
            row["args"],
            row["created_at"],
            ref.to_json() if ref is not None else None,
        )
        await conn.execute("DELETE FROM toren.journal WHERE actor_id = $1", run_id)
        await conn.execute("DELETE FROM toren.actors WHERE actor_id = $1", run_id)


def cli(db_url: str, archive: Path, *args: str) -> Any:
    from click.testing import CliRunner

    from toren.cli import main

    env = {"TOREN_DATABASE_URL": db_url, "TOREN_ARCHIVE_STORE": str(archive)}
    return CliRunner().invoke(main, list(args), env=env, catch_exceptions=False)


async def test_a_pruned_run_is_restored_from_its_archive_as_jobs_show_showed_it(
    client: Client, db_url: str, store: LocalStore
) -> None:
    await insert_journal(client, RUN, recorded_run())
    await client.pool.execute(
        "UPDATE toren.actors SET args = $2 WHERE actor_id = $1", RUN, {"agent": "support"}
    )
    journal = await read_journal(client.pool, RUN)
    shown = await anyio.to_thread.run_sync(cli, db_url, store.root, "jobs", "show", RUN)
    assert shown.exit_code == 0, shown.output
    timeline = [line for line in shown.output.splitlines() if line[:4].strip().isdigit()]
    [status] = [line for line in shown.output.splitlines() if line.startswith("status ")]
    assert len(timeline) == 31
    assert "receipt: 6 calls made" in status

    ref = await archive_journal(client.pool, store, RUN)
    await prune(client, RUN, ref)

    # Read-only: the same timeline and receipt, from the archive; nothing written.
    restored = await anyio.to_thread.run_sync(cli, db_url, store.root, "jobs", "restore", RUN)
    assert restored.exit_code == 0, restored.output
    lines = restored.output.splitlines()
    assert lines[0] == "restored from its archive (read-only): 31 events"
    assert [line for line in lines if line[:4].strip().isdigit()] == timeline
    assert [line for line in lines if line.startswith("status ")] == [status]
    as_json = await anyio.to_thread.run_sync(
        cli, db_url, store.root, "jobs", "restore", RUN.removeprefix("run/"), "--json"
    )
    events = json.loads(as_json.output)["events"]
    assert [(e["seq"], e["type"], e["data"]) for e in events] == [
        (e.seq, e.type, e.data) for e in journal
    ]
    assert await client.pool.fetchval("SELECT count(*) FROM toren.journal") == 0

    # The API reads it the same way (GET /runs/{uuid}/archive, the read scope).
    _, token = await create_token(client.pool, "rita", scopes=["read"])
    options = ServerOptions(archive_store=str(store.root))
    async with (
        serving(db_url, port=0, options=options) as base,
        aiohttp.ClientSession(headers={"Authorization": f"Bearer {token}"}) as http,
    ):
        uuid = RUN.removeprefix("run/")
        async with http.get(f"{base}/runs/{uuid}/archive") as answer:
            assert answer.status == 200, await answer.text()
            body = await answer.json()
        assert (body["status"], body["receipt"]["usd_paid"]) == ("cancelled", "0.000420")
        assert [(e["seq"], e["type"], e["data"]) for e in body["events"]] == [
            (e.seq, e.type, e.data) for e in journal
        ]
        other = "00000000-0000-4000-8000-0000000000ff"
        async with http.get(f"{base}/runs/{other}/archive") as answer:
            assert answer.status == 404
            assert "it was not pruned" in (await answer.json())["detail"]

        # A damaged archive is refused, naming what is wrong (the API's 502, the CLI's exit
        # 1); nothing is shown or written.
        path = store.root / ref.location
        good = path.read_bytes()
        path.write_bytes(good[:-1] + bytes([good[-1] ^ 1]))
        async with http.get(f"{base}/runs/{uuid}/archive") as answer:
            assert answer.status == 502
            assert "its checksum is" in (await answer.json())["detail"]
    damaged = await anyio.to_thread.run_sync(
        cli, db_url, store.root, "jobs", "restore", RUN, "--into-journal"
    )
    assert damaged.exit_code == 1
    assert "unusable: its checksum is" in damaged.output
    assert await client.pool.fetchval("SELECT count(*) FROM toren.actors") == 0
    path.write_bytes(good)

    # Into the journal: the run is back as it was (rows, times, status), shown and forked.
    written = await anyio.to_thread.run_sync(
        cli, db_url, store.root, "jobs", "restore", RUN, "--into-journal"
    )
    assert written.exit_code == 0, written.output
    assert f"{RUN} is back in the journal (cancelled)" in written.output
    assert await read_journal(client.pool, RUN) == journal
    row = await client.pool.fetchrow(
        "SELECT run_status, route, created_at FROM toren.actors WHERE actor_id = $1", RUN
    )
    assert (row["run_status"], row["route"]) == ("cancelled", "agent:support")
    again = await anyio.to_thread.run_sync(cli, db_url, store.root, "jobs", "show", RUN)
    assert [line for line in again.output.splitlines() if line[:4].strip().isdigit()] == timeline
    assert [line for line in again.output.splitlines() if line.startswith("status ")] == [status]
    # The prune is undone: its audit record is gone (the journal is the record again).
    assert await client.pool.fetchval("SELECT count(*) FROM toren.run_audit") == 0
    twice = await anyio.to_thread.run_sync(
        cli, db_url, store.root, "jobs", "restore", RUN, "--into-journal"
    )
    assert twice.exit_code == 2
    assert "it was not pruned" in twice.output

    from toren.runs.fork import fork_run

    fork = await fork_run(client, RUN, at=1)
    assert len(await read_journal(client.pool, fork)) >= 1


async def test_a_run_not_pruned_or_pruned_without_archive_is_not_restored(
    client: Client, db_url: str, store: LocalStore
) -> None:
    await insert_journal(client, RUN, recorded_run()[:3])
    live = await anyio.to_thread.run_sync(cli, db_url, store.root, "jobs", "restore", RUN)
    assert live.exit_code == 2
    assert "it was not pruned" in live.output
    assert f"toren jobs show {RUN}" in live.output

    await prune(client, RUN, None)
    gone = await anyio.to_thread.run_sync(cli, db_url, store.root, "jobs", "restore", RUN)
    assert gone.exit_code == 2
    assert "without an archive" in gone.output
    part = await anyio.to_thread.run_sync(cli, db_url, store.root, "jobs", "restore", "8146c6")
    assert part.exit_code == 2
    assert "whole id" in part.output


async def test_two_restores_into_the_journal_at_once_write_it_once(
    client: Client, store: LocalStore
) -> None:
    from toren.runs.restore import NotRestorable, restore_into_journal

    await insert_journal(client, RUN, recorded_run())
    journal = await read_journal(client.pool, RUN)
    await prune(client, RUN, await archive_journal(client.pool, store, RUN))
    outcomes: list[Any] = []

    async def restore() -> None:
        try:
            outcomes.append((await restore_into_journal(client, RUN, store=store)).status)
        except NotRestorable as exc:
            outcomes.append(exc.why)

    async with anyio.create_task_group() as tg:
        tg.start_soon(restore)
        tg.start_soon(restore)

    [refused] = [o for o in outcomes if o != "cancelled"]  # one wrote it, the other refused
    assert "restored before" in refused or "not pruned" in refused
    assert await read_journal(client.pool, RUN) == journal


async def test_a_run_the_pruner_archived_is_restored_as_it_was(
    client: Client, db_url: str, store: LocalStore
) -> None:
    """End to end with the pruner: a run pruned with ``Retention(archive=True)`` is shown by
    ``toren jobs restore`` as ``toren jobs show`` showed it, and written back whole by
    ``--into-journal``."""
    from toren import Retention
    from toren.runs import prune
    from toren.runs.state import summary

    await insert_journal(client, RUN, recorded_run())
    # ended two days ago: what an hour's keep_for lets go
    await client.pool.execute(
        "UPDATE toren.journal SET created_at = created_at - interval '2 days' WHERE actor_id = $1",
        RUN,
    )
    await client.pool.execute(
        "UPDATE toren.actors SET created_at = created_at - interval '2 days' WHERE actor_id = $1",
        RUN,
    )
    journal = await read_journal(client.pool, RUN)
    await client.pool.execute(
        "UPDATE toren.actors SET args = $2, route = 'agent:support', summary = $3 "
        "WHERE actor_id = $1",
        RUN,
        {"agent": "support"},
        summary(folded(journal)),
    )
    shown = await anyio.to_thread.run_sync(cli, db_url, store.root, "jobs", "show", RUN)
    before = [line for line in shown.output.splitlines() if line[:4].strip().isdigit()]
    before += [line for line in shown.output.splitlines() if line.startswith("status ")]

    result = await prune.prune_batch(
        client.pool, "support", Retention(keep_last=0, archive=True), store=store
    )

    assert (result.runs, result.archived) == (1, 1)
    assert await client.pool.fetchval("SELECT count(*) FROM toren.journal") == 0
    restored = await anyio.to_thread.run_sync(cli, db_url, store.root, "jobs", "restore", RUN)
    assert restored.exit_code == 0, restored.output
    after = [line for line in restored.output.splitlines() if line[:4].strip().isdigit()]
    after += [line for line in restored.output.splitlines() if line.startswith("status ")]
    assert after == before
    written = await anyio.to_thread.run_sync(
        cli, db_url, store.root, "jobs", "restore", RUN, "--into-journal"
    )
    assert written.exit_code == 0, written.output
    assert await read_journal(client.pool, RUN) == journal
    # Restored to be forked, it is not pruned again before it can be: its keep counts from
    # its restore (keep_last alone would let it go: it is no newer than it was).
    again = await prune.prune_batch(
        client.pool, "support", Retention(keep_for=3600.0, archive=True), store=store
    )
    assert again.runs == 0
    assert await read_journal(client.pool, RUN) == journal
