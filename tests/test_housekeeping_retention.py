"""Housekeeping of what retention leaves (issue 32, item 5): sandbox checkpoints no kept actor
names are swept from the store (after a grace period), old dead letters are archived and then
deleted, revoked and expired tokens go, and a Telegram channel forgets its strangers.

The database is real (a fresh one per test), the stores are a directory and moto's S3 server on
127.0.0.1 through the real aioboto3 client. Runs and sandboxes are rows written as the kernel
writes them (a run's ``tool.result`` naming the checkpoint after a sandboxed call, a sandbox's
``workspace.checkpointed``, a fork's sandbox started from a checkpoint); a pruned run is one
whose rows are deleted, as the pruner deletes them.
"""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys
import tarfile
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from datetime import UTC, datetime, timedelta
from functools import partial
from pathlib import Path
from typing import Any, cast

import aioboto3  # type: ignore[import-untyped]
import anyio
import asyncpg
import attrs
import pytest
from moto.server import ThreadedMotoServer

from tests.conftest import person, wait_for
from tests.test_cli import toren
from toren import Client, ConfigError, Settings
from toren._core.db import create_pool
from toren._core.deadletters import (
    CorruptDeadLetters,
    archive_deadletters,
    archive_old_deadletters,
    read_deadletter_archive,
)
from toren._core.singletons import singleton
from toren._core.stores import LocalStore, ObjectStore, S3Store
from toren._core.workers import housekeep
from toren._surfaces.tokens import authenticate, create_token, list_tokens
from toren.actors.sandboxes.docker import Docker
from toren.actors.sandboxes.runtime import Sandboxes
from toren.actors.sandboxes.sweeper import run_sweeper
from toren.channels import (
    ChannelState,
    ChatPaired,
    CodeIssued,
    PairFailed,
    Queued,
    Sent,
    UpdateHandled,
    fold,
    telegram_principal,
)
from toren.channels._state import RECENT
from toren.sandboxes.checkpoints import checkpoint, restore
from toren.sandboxes.sweep import lock_name, sweep_checkpoints
from toren.supervisors.worker.housekeeper import run_housekeeper

pytestmark = pytest.mark.anyio

DAY = 86400.0


def tar(files: dict[str, bytes]) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w:") as archive:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(data), 0o644
            archive.addfile(info, io.BytesIO(data))
    return out.getvalue()


def age(root: Path, days: float) -> None:
    """Make every object under ``root`` as old as ``days`` (as if written then)."""
    then = time.time() - days * DAY
    for path in root.rglob("*"):
        if path.is_file():
            os.utime(path, (then, then))


@contextlib.asynccontextmanager
async def create_pool_ctx(db_url: str) -> AsyncIterator[asyncpg.Pool]:
    p = await create_pool(db_url, size=2)
    try:
        yield p
    finally:
        await p.close()


@pytest.fixture
async def pool(db_url: str) -> AsyncIterator[asyncpg.Pool]:
    p = await create_pool(db_url, size=4)
    yield p
    await p.close()


async def add_actor(
    pool: asyncpg.Pool, actor_id: str, kind: str, *events: tuple[str, dict[str, Any]], **args: Any
) -> None:
    async with pool.acquire() as conn, conn.transaction():
        await conn.execute(
            "INSERT INTO toren.actors (actor_id, kind, args, status) "
            "VALUES ($1, $2, $3, 'stopped')",
            actor_id,
            kind,
            args,
        )
        for seq, (type_, data) in enumerate(events, 1):
            await conn.execute(
                "INSERT INTO toren.journal (actor_id, seq, epoch, type, data) "
                "VALUES ($1, $2, 1, $3, $4)",
                actor_id,
                seq,
                type_,
                data,
            )


async def prune(pool: asyncpg.Pool, *actor_ids: str) -> None:
    """What the pruner deletes of a run tree: its journals and its actors' rows."""
    async with pool.acquire() as conn, conn.transaction():
        await conn.execute("DELETE FROM toren.journal WHERE actor_id = ANY($1)", actor_ids)
        await conn.execute("DELETE FROM toren.actors WHERE actor_id = ANY($1)", actor_ids)


def result(call_id: str, checkpoint_id: str) -> tuple[str, dict[str, Any]]:
    return "tool.result", {
        "call_id": call_id,
        "checkpoint": checkpoint_id,
        "content": "$ make\n[in /workspace; exit 0]\n",
        "denied": False,
        "is_error": False,
        "truncated_from": None,
        "v": 1,
    }


def checkpointed(checkpoint_id: str) -> tuple[str, dict[str, Any]]:
    return "workspace.checkpointed", {"checkpoint": checkpoint_id, "files": 2, "v": 1}


async def keys(store: ObjectStore) -> set[str]:
    return {k async for k in store.list_keys("")}


# -- sandbox checkpoints -----------------------------------------------------------------------


async def test_a_checkpoint_a_kept_run_names_survives_and_one_only_a_pruned_run_named_goes(
    pool: asyncpg.Pool, tmp_path: Path
) -> None:
    store = LocalStore(tmp_path / "store")
    # shared: the kept run's checkpoint, which the pruned run's fork started from (its journal
    # copied the source's tool.result, its sandbox's arguments name it)
    shared, _ = await checkpoint(store, tar({"a.txt": b"common", "b.txt": b"kept only"}))
    # only the pruned run's: one blob in common with the shared checkpoint, one of its own
    own, _ = await checkpoint(store, tar({"a.txt": b"common", "c.txt": b"pruned only"}))
    orphan, _ = await checkpoint(store, tar({"d.txt": b"a worker died before its event"}))
    await store.put("manifests/README", b"not a checkpoint: not the sweep's to delete")
    await store.put("blobs/notes.txt", b"nor this")
    age(tmp_path / "store", days=2)
    young, _ = await checkpoint(store, tar({"e.txt": b"being recorded now"}))
    await add_actor(pool, "run/kept", "toren.run", result("c1", shared.id))
    await add_actor(pool, "sandbox/kept", "toren.sandbox", checkpointed(shared.id))
    await add_actor(pool, "run/fork", "toren.run", result("c1", shared.id), result("c2", own.id))
    await add_actor(
        pool, "sandbox/fork", "toren.sandbox", checkpointed(own.id), checkpoint=shared.id
    )
    before = await keys(store)

    listed: dict[str, bytes] = {}  # a worker's cache of manifests' blobs, between sweeps
    first = await sweep_checkpoints(pool, store, grace=DAY, listed=listed)

    # the orphan (named nowhere, two days old) goes, blobs and all; the rest is named or young
    assert (first.manifests_deleted, first.kept) == (1, 2)
    gone = before - await keys(store)
    assert gone == {f"manifests/{orphan.id}"} | {f"blobs/{b}" for b in orphan.blob_ids()}

    await prune(pool, "run/fork", "sandbox/fork")
    second = await sweep_checkpoints(pool, store, grace=DAY, listed=listed)

    left = await keys(store)
    assert f"manifests/{own.id}" not in left
    only_own = own.blob_ids() - shared.blob_ids()
    assert len(only_own) == 1
    assert not {f"blobs/{b}" for b in only_own} & left
    assert (second.manifests_deleted, second.blobs_deleted) == (1, 1)
    # the shared checkpoint is whole: it restores, its blob shared with the pruned one included
    assert await restore(store, shared.id)
    assert own.blob_ids() & shared.blob_ids() <= {k.removeprefix("blobs/") for k in left}
    # the young checkpoint is named nowhere, but within its grace period
    assert await restore(store, young.id)

    # a day later, still named nowhere: it goes
    third = await sweep_checkpoints(
        pool, store, grace=DAY, now=time.time() + 2 * DAY, listed=listed
    )
    assert third.manifests_deleted == 1
    assert set(listed) == {shared.id}
    assert listed[shared.id] == b"".join(bytes.fromhex(b) for b in sorted(shared.blob_ids()))
    others = {"manifests/README", "blobs/notes.txt"}  # not checkpoints: never the sweep's
    assert await keys(store) == {f"manifests/{shared.id}", *others} | {
        f"blobs/{b}" for b in shared.blob_ids()
    }


async def test_a_checkpoint_named_deep_in_a_snapshot_a_message_or_a_channels_outbox_survives(
    pool: asyncpg.Pool, tmp_path: Path
) -> None:
    store = LocalStore(tmp_path / "store")
    named = {}
    for where in ("snapshot", "mail", "outbox", "dead letter", "summary"):
        named[where], _ = await checkpoint(store, tar({"f": where.encode()}))
    unnamed, _ = await checkpoint(store, tar({"f": b"a digest equal to no checkpoint"}))
    age(tmp_path / "store", days=2)
    await add_actor(pool, "run/s", "toren.run")
    # a channel's outbox: a file to send from a run's checkpoint, nested in its event
    await add_actor(
        pool,
        "channel/telegram/bot",
        "toren.channel",
        (
            "outbox.queued",
            {
                "n": 1,
                "chat_id": 5,
                "kind": "file",
                "text": "",
                "file": {"run": "run/s", "path": "out.csv", "checkpoint": named["outbox"].id},
            },
        ),
    )
    async with pool.acquire() as conn:
        await conn.execute(
            "INSERT INTO toren.snapshots (actor_id, seq, version, state) VALUES ($1, 9, 1, $2)",
            "run/s",  # a fork's state: where it came from, nested
            {"forked": {"source": "run/t", "at": 3, "checkpoint": named["snapshot"].id}},
        )
        await conn.execute(
            "UPDATE toren.actors SET summary = $2 WHERE actor_id = $1",
            "run/s",
            {"checkpoints": 3, "checkpoint": named["summary"].id},
        )
        await conn.execute(
            "INSERT INTO toren.mailbox (actor_id, kind, body) VALUES ($1, $2, $3)",
            "run/s",
            "run.sandbox_done",
            {"call_id": "c9", "checkpoint": named["mail"].id, "digest": unnamed.id},
        )
    await dead_letter(
        pool, 1, days_ago=1, body={"calls": [{"checkpoint": named["dead letter"].id}]}
    )

    stats = await sweep_checkpoints(pool, store, grace=DAY)

    assert (stats.kept, stats.manifests_deleted) == (5, 1)
    for manifest in named.values():
        assert await restore(store, manifest.id)
    # only what a member called "checkpoint" holds names a checkpoint: the digest does not
    assert f"manifests/{unnamed.id}" not in await keys(store)


def test_every_payload_names_a_checkpoint_in_a_member_called_checkpoint() -> None:
    """The sweep finds checkpoints by the name of the JSON member holding them (``checkpoint``,
    at any depth): a message or event naming one under another name would let it be deleted."""
    import toren.actors.channels.kind
    import toren.actors.runs.kind
    import toren.actors.sandboxes.kind  # noqa: F401  (every kind's payloads registered)
    from toren._core.names import NAMES

    odd = {
        f"{name}.{field.name}"
        for name, cls in NAMES.payloads.items()
        if attrs.has(cls)
        for field in attrs.fields(cls)
        if ("checkpoint" in field.name or "manifest" in field.name)
        and field.name not in ("checkpoint", "checkpoints")
    }
    assert odd == set()


async def test_a_blob_written_again_after_the_listing_is_not_deleted(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store")
    await store.put("blobs/x", b"content")
    age(tmp_path / "store", days=2)
    cutoff = time.time() - DAY
    assert [o.key async for o in store.list_objects("blobs/")] == ["blobs/x"]

    await store.put("blobs/x", b"content")  # a checkpoint uploads the same content again

    assert not await store.delete("blobs/x", written_before=cutoff)
    assert await store.get("blobs/x") == b"content"
    assert not await store.delete("blobs/none", written_before=cutoff)
    assert await store.delete("blobs/x")
    assert await keys(store) == set()


async def test_one_worker_at_a_time_holds_a_singleton_and_works_on_its_connection(
    db_url: str, tmp_path: Path
) -> None:
    store = LocalStore(tmp_path / "store")
    await checkpoint(store, tar({"a": b"named nowhere"}))
    age(tmp_path / "store", days=2)
    one = await create_pool(db_url, size=1)  # a worker with a pool of one connection
    try:
        async with singleton(one, "checkpoint_sweep") as first:
            assert first is not None
            async with create_pool_ctx(db_url) as other_worker:
                async with singleton(other_worker, "checkpoint_sweep") as second:
                    assert second is None
                async with singleton(other_worker, "other work") as other:
                    assert other is not None
            # the round's work runs on the lock's connection: no second one is waited for
            with anyio.fail_after(10):
                swept = await sweep_checkpoints(first, store)
            assert swept.manifests_deleted == 1
        async with singleton(one, "checkpoint_sweep") as again:
            assert again is not None  # released
    finally:
        await one.close()


# -- S3 (moto's server on 127.0.0.1, the real aioboto3 client) ---------------------------------


@pytest.fixture(scope="module")
def moto_url() -> Iterator[str]:
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


@pytest.fixture
async def s3_store(moto_url: str, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[S3Store]:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    async with aioboto3.Session().client(
        "s3", endpoint_url=moto_url, region_name="us-east-1"
    ) as s3:
        await s3.create_bucket(Bucket="housekeeping")
    store = S3Store("housekeeping", "toren/ws", endpoint_url=moto_url, region="us-east-1")
    yield store
    await store.close()


async def test_the_sweep_deletes_from_s3_what_no_one_names(
    pool: asyncpg.Pool, s3_store: S3Store
) -> None:
    kept, _ = await checkpoint(s3_store, tar({"a": b"kept", "b": b"both"}))
    dropped, _ = await checkpoint(s3_store, tar({"c": b"dropped", "b": b"both"}))
    await add_actor(pool, "sandbox/kept", "toren.sandbox", checkpointed(kept.id))
    listed = {o.key: o for o in [o async for o in s3_store.list_objects("")]}
    assert set(listed) == {f"manifests/{kept.id}", f"manifests/{dropped.id}"} | {
        f"blobs/{b}" for b in kept.blob_ids() | dropped.blob_ids()
    }
    assert listed[f"manifests/{kept.id}"].written_at > time.time() - 600

    young = await sweep_checkpoints(pool, s3_store, grace=DAY)
    assert (young.manifests_deleted, young.blobs_deleted) == (0, 0)
    later = await sweep_checkpoints(pool, s3_store, grace=DAY, now=time.time() + 2 * DAY)

    assert (later.manifests_deleted, later.blobs_deleted) == (1, 1)
    assert await keys(s3_store) == {f"manifests/{kept.id}"} | {
        f"blobs/{b}" for b in kept.blob_ids()
    }
    assert await restore(s3_store, kept.id)
    # an object written since the time given is kept
    assert not await s3_store.delete(f"manifests/{kept.id}", written_before=time.time() - DAY)
    assert not await s3_store.delete("blobs/none")


# -- tokens ------------------------------------------------------------------------------------


async def test_tokens_dead_past_token_keep_for_go_with_their_sessions_and_live_ones_stay(
    pool: asyncpg.Pool,
) -> None:
    made = {}
    for name in ("live", "expiring", "revoked_long_ago", "revoked_lately", "expired_long_ago"):
        made[name], _ = await create_token(pool, name, scopes=("read",), expires_in=None)
    _, old_live = await create_token(pool, "old but live")
    old_live_id = old_live.split("_")[1]
    ago = "now() - make_interval(days => $2)"
    for name, statement, days in (
        ("expiring", "expires_at = now() + interval '1 day'", None),
        ("revoked_long_ago", f"revoked_at = {ago}", 40),
        ("revoked_lately", f"revoked_at = {ago}", 10),
        ("expired_long_ago", f"expires_at = {ago}", 31),
    ):
        args = [made[name]] if days is None else [made[name], days]
        await pool.execute(f"UPDATE toren.tokens SET {statement} WHERE id = $1", *args)
    # a token made a year ago and last used then is no less live
    await pool.execute(
        "UPDATE toren.tokens SET created_at = now() - interval '1 year', "
        "last_used_at = now() - interval '1 year' WHERE id = $1",
        old_live_id,
    )
    # the console session of a token revoked long ago (revoking ends them; one left behind)
    await pool.execute(
        "INSERT INTO toren.sessions (id_sha256, token_id, csrf, expires_at) "
        "VALUES ('\\x01', $1, 'c', now() + interval '1 day')",
        made["revoked_long_ago"],
    )

    done = await housekeep(pool, dedupe_retention=7 * DAY, token_keep_for=30 * DAY)

    assert done["tokens"] == 2
    left = {t.id for t in await list_tokens(pool)}
    assert left == {made["live"], made["expiring"], made["revoked_lately"], old_live_id}
    assert await pool.fetchval("SELECT count(*) FROM toren.sessions") == 0
    assert await authenticate(pool, old_live) is not None
    assert (await housekeep(pool, dedupe_retention=7 * DAY))["tokens"] == 0  # 30 days: default


# -- dead letters ------------------------------------------------------------------------------

HOSTILE = {"text": "nul\x00 and a lone \ud800 surrogate", "big": 2**70, "list": [1.5, None, "é"]}


async def dead_letter(pool: asyncpg.Pool, id_: int, *, days_ago: float, body: Any) -> None:
    await pool.execute(
        "INSERT INTO toren.deadletters (id, actor_id, lane, sender, kind, body, dedupe_key, "
        "reply_to, deliveries, attempts, error, created_at, dead_at) "
        "VALUES ($1, $2, 1, 'run/sender', 'work', $3, NULL, NULL, 5, 5, $4, "
        "now() - make_interval(secs => $5 + 60), now() - make_interval(secs => $5))",
        id_,
        f"c/poisoned-{id_}",
        body,
        f"ValueError: bad input {id_}",
        days_ago * DAY,
    )


class BadReads(LocalStore):
    """A store whose reads come back damaged (a disk or a network flipping a bit)."""

    async def get(self, key: str) -> bytes:
        data = bytearray(await super().get(key))
        data[len(data) // 2] ^= 0x01
        return bytes(data)


async def test_old_dead_letters_are_archived_checked_then_deleted_and_read_back_whole(
    pool: asyncpg.Pool, tmp_path: Path
) -> None:
    for id_ in (11, 12, 13):
        await dead_letter(pool, id_, days_ago=40, body={"n": id_, **HOSTILE})
    for id_ in (14, 15):
        await dead_letter(pool, id_, days_ago=1, body={"n": id_})

    # an archive that does not read back as written deletes nothing
    with pytest.raises(CorruptDeadLetters, match="hashes to"):
        await archive_deadletters(pool, BadReads(tmp_path / "bad"), keep_for=30 * DAY, batch=2)
    assert await pool.fetchval("SELECT count(*) FROM toren.deadletters") == 5

    store = LocalStore(tmp_path / "archive")
    done = await archive_deadletters(pool, store, keep_for=30 * DAY, batch=2)

    assert (done.archived, done.deleted, len(done.keys)) == (3, 3, 2)
    left = await pool.fetch("SELECT id FROM toren.deadletters ORDER BY id")
    assert [r["id"] for r in left] == [14, 15]
    read = [d for key in done.keys for d in await read_deadletter_archive(store, key)]
    assert [d["id"] for d in read] == [11, 12, 13]
    assert [d["body"] for d in read] == [{"n": i, **HOSTILE} for i in (11, 12, 13)]
    assert read[0]["error"] == "ValueError: bad input 11"
    assert read[0]["actor_id"] == "c/poisoned-11"
    assert read[0]["created_at"] < read[0]["dead_at"] < datetime.now(UTC) - timedelta(days=39)
    # the same batch written again (killed before the delete) is the same object
    again = await archive_deadletters(pool, store, keep_for=0.5, batch=2)
    assert again.archived == 2
    assert len(await keys(store)) == 3

    # a damaged archive is refused with a clear error, whatever is damaged
    key = done.keys[0]
    path = tmp_path / "archive" / key
    whole = path.read_bytes()
    for damaged, says in (
        (whole[:-10], "hashes to"),
        (bytes([whole[0] ^ 1]) + whole[1:], "hashes to"),
    ):
        path.write_bytes(damaged)
        with pytest.raises(CorruptDeadLetters, match=says):
            await read_deadletter_archive(store, key)
    with pytest.raises(CorruptDeadLetters, match="no such object"):
        await read_deadletter_archive(store, key.replace("-1", "-9", 1))


async def test_a_workers_round_archives_to_archive_store_one_worker_at_a_time(
    pool: asyncpg.Pool, tmp_path: Path
) -> None:
    await dead_letter(pool, 21, days_ago=2, body={"n": 21})
    settings = Settings(
        home=tmp_path, archive_store=str(tmp_path / "archive"), deadletter_keep_for="1d"
    )

    async with singleton(pool, "deadletters"):  # another worker's round
        assert await archive_old_deadletters(pool, settings) == 0
    assert await archive_old_deadletters(pool, settings) == 1

    [key] = [
        p.relative_to(tmp_path / "archive").as_posix() for p in (tmp_path / "archive").rglob("*.gz")
    ]
    assert key.startswith("deadletters/")
    [item] = await read_deadletter_archive(LocalStore(tmp_path / "archive"), key)
    assert item["body"] == {"n": 21}
    assert await archive_old_deadletters(pool, settings) == 0


# -- Telegram strangers ------------------------------------------------------------------------


def test_what_strangers_leave_in_a_channels_state_is_bounded_by_a_days_worth() -> None:
    """Anyone can write to a bot. An unpaired chat is hinted (once a day), may try /pair codes
    (each failure counted, and answered: a message sent to it): the hint, the failures and
    the time of that message are kept a day, then dropped; a paired chat's are kept."""
    who = telegram_principal(7, "ann")
    state = fold(ChannelState(), CodeIssued(code_hash="h", expires_at=1e12, by=who, at=0.0))
    state = fold(
        state, ChatPaired(chat_id=5, title="ann", chat_type="private", code_hash="h", by=who, at=0)
    )
    n = 0
    per_day = 100
    for i in range(20 * per_day):  # 2,000 strangers over 20 days, each met once
        at, chat = i * DAY / per_day, 1_000_000 + i
        state = fold(
            state,
            UpdateHandled(
                update_id=2 * i,
                chat_id=chat,
                user_id=chat,
                kind="message",
                outcome="hinted",
                at=at,
            ),
        )
        state = fold(state, PairFailed(chat_id=chat, at=at))
        n += 1
        state = fold(
            state, Queued(n=n, chat_id=chat, kind="text", text="That code is wrong", at=at)
        )
        state = fold(state, Sent(n=n, message_ids=(n,), at=at))
        if i % per_day == 0:  # the paired chat is written to once a day
            n += 1
            state = fold(state, Queued(n=n, chat_id=5, kind="text", text="hi", at=at))
            state = fold(state, Sent(n=n, message_ids=(n,), at=at))

    bound = per_day + 64  # a day's strangers, and what waits for the next prune
    assert len(state.hinted) <= bound
    assert len(state.failures) <= bound
    assert len(state.last_sent) <= bound + 1
    assert "5" in state.last_sent  # the paired chat's, however old
    assert len(state.outbox) <= RECENT


# -- the worker's services ---------------------------------------------------------------------


class Unlistable(LocalStore):
    """A store that fails every listing (a bucket whose policy lacks ListBucket)."""

    def list_objects(self, prefix: str) -> Any:
        raise ConfigError("access to the S3 bucket 'x' was denied (AccessDenied)")


async def test_two_workers_sweepers_take_turns_and_a_failing_round_ends_neither(
    pool: asyncpg.Pool, tmp_path: Path
) -> None:
    store = LocalStore(tmp_path / "store")
    gone, _ = await checkpoint(store, tar({"old": b"named nowhere"}))
    age(tmp_path / "store", days=2)
    docker = cast(Docker, object())  # the sweep never asks Docker anything
    settings = Settings(checkpoint_sweep_every=0.05, checkpoint_grace="1d")
    broken = Sandboxes(docker, Unlistable(tmp_path / "other"))
    async with anyio.create_task_group() as tg:
        for sandboxes in (Sandboxes(docker, store), Sandboxes(docker, store), broken):
            tg.start_soon(run_sweeper, pool, sandboxes, settings, lambda: None)

        async def swept() -> bool:
            return await keys(store) == set()

        await wait_for(swept, what="the old checkpoint swept")
        tg.cancel_scope.cancel()
    assert not gone.blob_ids() & {k.removeprefix("blobs/") for k in await keys(store)}


async def test_the_housekeeper_archives_old_dead_letters_every_round(
    pool: asyncpg.Pool, tmp_path: Path
) -> None:
    settings = Settings(home=tmp_path, deadletter_keep_for="1d")  # archive_store: HOME/archive
    await dead_letter(pool, 31, days_ago=3, body={"n": 31})
    async with anyio.create_task_group() as tg:
        tg.start_soon(partial(run_housekeeper, pool, settings, lambda: None, every=0.05))

        async def archived() -> bool:
            return await pool.fetchval("SELECT count(*) FROM toren.deadletters") == 0

        await wait_for(archived, what="the dead letter archived")
        tg.cancel_scope.cancel()
    assert list((tmp_path / "archive" / "deadletters").rglob("*.jsonl.gz"))


async def test_toren_sandboxes_sweep_says_what_it_would_delete_then_deletes_it(
    pool: asyncpg.Pool, db_url: str, tmp_path: Path
) -> None:
    store = LocalStore(tmp_path / "ws")
    kept, _ = await checkpoint(store, tar({"a": b"kept"}))
    gone, _ = await checkpoint(store, tar({"b": b"gone"}))
    age(tmp_path / "ws", days=2)
    await add_actor(pool, "sandbox/kept", "toren.sandbox", checkpointed(kept.id))

    def sweep(*args: str) -> subprocess.CompletedProcess[str]:
        return toren(
            "sandboxes", "sweep", *args, db_url=db_url, TOREN_WORKSPACE_STORE=str(tmp_path / "ws")
        )

    dry = await anyio.to_thread.run_sync(sweep, "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert "would delete 1 checkpoint(s) and 1 blob(s)" in dry.stdout
    assert "1 older than the grace period kept" in dry.stdout
    assert f"manifests/{gone.id}" in await keys(store)

    async with singleton(pool, lock_name(store)):  # a worker sweeping this store now
        busy = await anyio.to_thread.run_sync(sweep)
    assert busy.returncode == 1
    assert "a sweep of this store is running now" in busy.stderr

    done = await anyio.to_thread.run_sync(sweep)
    assert done.returncode == 0, done.stderr
    assert "deleted 1 checkpoint(s) and 1 blob(s)" in done.stdout
    assert await keys(store) == {f"manifests/{kept.id}"} | {f"blobs/{b}" for b in kept.blob_ids()}


# -- with the pruner (issue 32's prune branch) -------------------------------------------------


async def run_rows(pool: asyncpg.Pool, agent: str, *events: Any) -> str:
    """A run as a worker leaves it: its row, its journal (real events, encoded as the kernel
    encodes them) and its summary."""
    from toren._core.codec import encode
    from toren.runs import RUN_KIND
    from toren.runs.state import RunState, fold, summary

    run_id = f"run/{uuid.uuid4()}"
    await Client(pool, "").spawn(RUN_KIND, run_id, {"agent": agent}, route=f"agent:{agent}")
    state = RunState()
    for seq, event in enumerate(events, 1):
        name, data = encode(event)
        await pool.execute(
            "INSERT INTO toren.journal (actor_id, seq, epoch, type, data) "
            "VALUES ($1, $2, 1, $3, $4)",
            run_id,
            seq,
            name,
            data,
        )
        state = fold(state, event)
    await pool.execute(
        "UPDATE toren.actors SET summary = $2 WHERE actor_id = $1", run_id, summary(state)
    )
    return run_id


async def test_after_pruning_a_run_its_checkpoints_go_and_those_its_kept_fork_names_stay(
    pool: asyncpg.Pool, tmp_path: Path
) -> None:
    from toren import Retention
    from toren.runs import prune
    from toren.runs.events import RunCompleted, RunStarted, ToolResulted
    from toren.runs.fork_events import RunForked
    from toren.sandboxes import SANDBOX_KIND

    store = LocalStore(tmp_path / "ws")
    shared, _ = await checkpoint(store, tar({"a": b"at step 1", "c": b"common"}))
    own, _ = await checkpoint(store, tar({"b": b"at step 2", "c": b"common"}))
    age(tmp_path / "ws", days=2)
    who = person("alice")
    source = await run_rows(
        pool,
        "builder",
        RunStarted(agent="builder", input="build", at=1.0, by=who),
        ToolResulted(call_id="c1", content="$ make", checkpoint=shared.id),
        ToolResulted(call_id="c2", content="$ make test", checkpoint=own.id),
        RunCompleted(output="built", at=2.0),
    )
    # its sandbox, a child of the run: pruned with it
    sandbox = "sandbox/" + source.removeprefix("run/")
    await Client(pool, "").spawn(
        SANDBOX_KIND, sandbox, {"run": source}, route="sandbox", parent=source
    )
    for seq, manifest in enumerate((shared, own), 1):
        await pool.execute(
            "INSERT INTO toren.journal (actor_id, seq, epoch, type, data) "
            "VALUES ($1, $2, 1, 'workspace.checkpointed', $3)",
            sandbox,
            seq,
            {"checkpoint": manifest.id, "files": 2, "v": 1},
        )
    # a fork from step 2 (of another agent, which keeps its runs): the source's events before
    # the step are copied into its journal, and it names the checkpoint it started from
    await run_rows(
        pool,
        "reviewer",
        RunStarted(agent="builder", input="build", at=1.0, by=who),
        ToolResulted(call_id="c1", content="$ make", checkpoint=shared.id),
        RunForked(source=source, step=2, calls=0, checkpoint=shared.id),
        RunCompleted(output="reviewed", at=3.0),
    )

    pruned = await prune.prune_batch(pool, "builder", Retention(keep_last=0))
    assert pruned.runs == 1
    stats = await sweep_checkpoints(pool, store, grace=DAY)

    assert (stats.manifests_deleted, stats.blobs_deleted) == (1, 1)
    assert await restore(store, shared.id)  # the fork's, "common" included
    assert f"manifests/{own.id}" not in await keys(store)


ARCHIVER = """
import sys, anyio
from toren._core.db import create_pool
from toren._core.deadletters import archive_deadletters
from toren._core.killpoints import arm
from toren._core.stores import LocalStore

async def main() -> None:
    pool = await create_pool(sys.argv[1], size=1, name="toren-archiver")
    await archive_deadletters(pool, LocalStore(sys.argv[2]), keep_for=86400.0)

arm()
anyio.run(main)
"""


@pytest.mark.parametrize("fault", ["sigkill", "pg_terminate"])
async def test_an_archiver_killed_between_the_archive_and_the_delete_loses_nothing(
    pool: asyncpg.Pool, db_url: str, tmp_path: Path, fault: str
) -> None:
    for id_ in (41, 42, 43):
        await dead_letter(pool, id_, days_ago=2, body={"n": id_, **HOSTILE})
    points = tmp_path / "points"
    points.mkdir()
    env = {
        **os.environ,
        "PYTHONPATH": str(Path(__file__).resolve().parent.parent),
        "TOREN_KILL_POINT": "deadletters.archived",
        "TOREN_KILL_POINT_DIR": str(points),
    }
    archiver = subprocess.Popen(
        [sys.executable, "-c", ARCHIVER, db_url, str(tmp_path / "archive")], env=env
    )
    try:

        async def frozen() -> bool:
            return (points / "hit").exists()

        await wait_for(frozen, timeout=30, what="the archiver at deadletters.archived")
        if fault == "sigkill":
            archiver.kill()
        else:
            await pool.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                "WHERE application_name = 'toren-archiver'"
            )
            (points / "go").touch()
        assert await anyio.to_thread.run_sync(archiver.wait) != 0
    finally:
        archiver.kill()
    written = list((tmp_path / "archive").rglob("*.jsonl.gz"))
    assert len(written) == 1  # written and checked...
    assert await pool.fetchval("SELECT count(*) FROM toren.deadletters") == 3  # ...not deleted

    store = LocalStore(tmp_path / "archive")
    again = await archive_deadletters(pool, store, keep_for=DAY)

    assert (again.archived, again.deleted) == (3, 3)
    assert [written[0].relative_to(tmp_path / "archive").as_posix()] == list(again.keys)
    assert list((tmp_path / "archive").rglob("*.jsonl.gz")) == written
    items = await read_deadletter_archive(store, again.keys[0])
    assert [d["body"] for d in items] == [{"n": i, **HOSTILE} for i in (41, 42, 43)]
