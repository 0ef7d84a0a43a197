"""Workspace stores and checkpoints (toren.sandboxes.store, toren.sandboxes.checkpoints): round
trips through a local directory and through moto's S3 server with the real aioboto3 client,
hostile archives refused, corruption detected, and the bytes an incremental checkpoint puts on
the wire counted by a relay in front of the S3 stand-in."""

from __future__ import annotations

import io
import os
import socket
import subprocess
import sys
import tarfile
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aioboto3
import pytest
from moto.server import ThreadedMotoServer

from toren._core.errors import ConfigError
from toren.sandboxes.checkpoints import (
    CheckpointStats,
    Manifest,
    UnsafeArchive,
    WorkspacePathError,
    checkpoint,
    list_files,
    load_manifest,
    read_file,
    restore,
)
from toren.sandboxes.store import (
    CorruptObject,
    LocalStore,
    MissingObject,
    S3Store,
    StoreUnavailable,
    store_from_url,
)

pytestmark = pytest.mark.anyio

ROOT = Path(__file__).resolve().parent.parent
MiB = 1024 * 1024
ODD_NAMES = [
    "é漢字 ünïcode.txt",
    "with space",
    "new\nline",
    "-dash",
    "back\\slash",
    "quote\"'",
    os.fsdecode(b"not-utf8-\xff\xfe.bin"),
    "/".join(["deep"] * 30) + "/" + "x" * 120,  # past ustar's 100- and 255-byte name limits
]


# -- helpers -----------------------------------------------------------------------------------


def tar_of(directory: Path) -> bytes:
    """The directory as the Docker layer exports /workspace: members named ./..."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w:", format=tarfile.PAX_FORMAT) as archive:
        archive.add(directory, arcname=".")
    return out.getvalue()


def extract(tar: bytes, dest: Path) -> Path:
    dest.mkdir()
    with tarfile.open(fileobj=io.BytesIO(tar), mode="r:") as archive:
        archive.extractall(dest, filter="fully_trusted")  # our own output; links kept as written
    return dest


def tree(directory: Path) -> dict[str, tuple[Any, ...]]:
    """Every path under ``directory``: its kind, permission bits and content or target."""
    seen: dict[str, tuple[Any, ...]] = {}
    for path in sorted(directory.rglob("*")):
        rel = path.relative_to(directory).as_posix()
        if path.is_symlink():
            seen[rel] = ("link", os.readlink(path))
        elif path.is_dir():
            seen[rel] = ("dir", path.stat().st_mode & 0o777)
        else:
            seen[rel] = ("file", path.stat().st_mode & 0o777, path.read_bytes())
    return seen


def members(*specs: tuple[str, bytes | None, bytes]) -> bytes:
    """A hand-made archive: (name, type, content) per member."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w:", format=tarfile.PAX_FORMAT) as archive:
        for name, kind, content in specs:
            info = tarfile.TarInfo(name)
            info.type = kind or tarfile.REGTYPE
            if kind in (tarfile.SYMTYPE, tarfile.LNKTYPE):
                info.linkname = content.decode()
                archive.addfile(info)
            elif kind is None:
                info.size = len(content)
                archive.addfile(info, io.BytesIO(content))
            else:
                archive.addfile(info)
    return out.getvalue()


def objects(root: Path) -> set[str]:
    return {p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()}


@pytest.fixture
def store(tmp_path: Path) -> LocalStore:
    return LocalStore(tmp_path / "store")


@pytest.fixture
def workspace(tmp_path: Path) -> Path:
    ws = tmp_path / "workspace"
    (ws / "src" / "pkg").mkdir(parents=True)
    (ws / "src" / "pkg" / "mod.py").write_text("print('hi')\n")
    run = ws / "run.sh"
    run.write_text("#!/bin/sh\necho run\n")
    run.chmod(0o755)
    (ws / "readonly.txt").write_text("do not touch")
    (ws / "readonly.txt").chmod(0o444)
    (ws / "private").mkdir(mode=0o700)
    (ws / "private" / "secret").write_bytes(b"s")
    (ws / "private" / "secret").chmod(0o600)
    (ws / "empty").write_bytes(b"")
    (ws / "empty-dir").mkdir()
    (ws / "link-to-mod").symlink_to("src/pkg/mod.py")
    (ws / "link-to-dir").symlink_to("src")
    (ws / "link-abs").symlink_to("/etc/passwd")
    (ws / "dangling").symlink_to("nowhere")
    os.link(ws / "src" / "pkg" / "mod.py", ws / "hardlink.py")
    for name in ODD_NAMES:
        path = ws / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(name.encode(errors="surrogateescape"))
    return ws


# -- round trips -------------------------------------------------------------------------------


async def test_round_trip_keeps_files_dirs_modes_links_and_odd_names(
    store: LocalStore, workspace: Path, tmp_path: Path
) -> None:
    manifest, stats = await checkpoint(store, tar_of(workspace), None)

    restored = extract(await restore(store, manifest.id), tmp_path / "restored")
    assert tree(restored) == tree(workspace)
    assert stats.manifest_id == manifest.id
    assert not stats.unchanged
    assert stats.files == sum(1 for e in manifest.entries if e.kind == "file")
    # the hard link's content is stored once
    assert stats.blobs_uploaded == len(manifest.blob_ids()) == stats.files - 1


async def test_a_hard_link_restores_as_an_independent_copy(
    store: LocalStore, workspace: Path, tmp_path: Path
) -> None:
    manifest, _ = await checkpoint(store, tar_of(workspace), None)

    restored = extract(await restore(store, manifest.id), tmp_path / "restored")
    assert (restored / "hardlink.py").read_text() == "print('hi')\n"
    assert not (restored / "hardlink.py").samefile(restored / "src" / "pkg" / "mod.py")


async def test_restore_writes_the_owner_it_is_given(store: LocalStore, workspace: Path) -> None:
    manifest, _ = await checkpoint(store, tar_of(workspace), None)

    with tarfile.open(
        fileobj=io.BytesIO(await restore(store, manifest.id, uid=1000, gid=1001))
    ) as a:
        assert {(m.uid, m.gid) for m in a} == {(1000, 1001)}


async def test_an_empty_workspace_round_trips(store: LocalStore, tmp_path: Path) -> None:
    (tmp_path / "ws").mkdir()

    manifest, stats = await checkpoint(store, tar_of(tmp_path / "ws"), None)

    assert manifest.entries == ()
    assert (stats.files, stats.bytes_total, stats.blobs_uploaded) == (0, 0, 0)
    with tarfile.open(fileobj=io.BytesIO(await restore(store, manifest.id))) as archive:
        assert archive.getmembers() == []


async def test_the_manifest_id_does_not_depend_on_times_or_member_order(
    store: LocalStore, tmp_path: Path
) -> None:
    one = members(("a", None, b"1"), ("b/c", None, b"2"))
    other = members(("./b/c", None, b"2"), ("./a", None, b"1"))

    first, _ = await checkpoint(store, one, None)
    second, _ = await checkpoint(store, other, None)

    assert first.id == second.id
    assert [e.path for e in first.entries] == ["a", "b", "b/c"]  # parent made up as a dir


async def test_gnu_tar_output_gives_the_same_checkpoint(
    store: LocalStore, workspace: Path, tmp_path: Path
) -> None:
    # What the Docker layer runs inside the container: GNU tar (hard links, long and non-UTF-8
    # names in its own format), numeric owners, members sorted by name.
    gnu = subprocess.run(
        ["tar", "--format=gnu", "--numeric-owner", "--sort=name", "-C", workspace, "-cf", "-", "."],
        capture_output=True,
        check=True,
    ).stdout

    from_gnu, _ = await checkpoint(store, gnu, None)
    from_pax, _ = await checkpoint(store, tar_of(workspace), None)

    assert from_gnu.id == from_pax.id
    restored = extract(await restore(store, from_gnu.id), tmp_path / "restored")
    assert tree(restored) == tree(workspace)


async def test_a_loaded_manifest_is_the_one_checkpointed(
    store: LocalStore, workspace: Path
) -> None:
    manifest, _ = await checkpoint(store, tar_of(workspace), None)

    loaded = await load_manifest(store, manifest.id)

    assert loaded == manifest
    assert loaded.id == manifest.id


# -- incremental -------------------------------------------------------------------------------


async def test_an_unchanged_workspace_uploads_nothing(store: LocalStore, workspace: Path) -> None:
    first, _ = await checkpoint(store, tar_of(workspace), None)
    before = objects(store.root)

    second, stats = await checkpoint(store, tar_of(workspace), first)

    assert second.id == first.id
    assert stats.unchanged
    assert (stats.blobs_uploaded, stats.bytes_uploaded) == (0, 0)
    assert objects(store.root) == before


async def test_a_changed_file_uploads_its_blob_and_a_manifest_only(
    store: LocalStore, workspace: Path, tmp_path: Path
) -> None:
    first, _ = await checkpoint(store, tar_of(workspace), None)
    before = objects(store.root)
    (workspace / "src" / "pkg" / "mod.py").write_text("print('changed')\n")  # hardlink.py too

    second, stats = await checkpoint(store, tar_of(workspace), first)

    added = objects(store.root) - before
    assert added == {f"blobs/{second.by_path['hardlink.py'].sha256}", f"manifests/{second.id}"}
    assert stats.blobs_uploaded == 1
    assert stats.bytes_uploaded == sum((store.root / key).stat().st_size for key in added)
    restored = extract(await restore(store, second.id), tmp_path / "restored")
    assert tree(restored) == tree(workspace)
    old = extract(await restore(store, first.id), tmp_path / "old")
    assert (old / "src" / "pkg" / "mod.py").read_text() == "print('hi')\n"


# -- hostile archives --------------------------------------------------------------------------

HOSTILE = {
    "absolute name": (members(("/etc/cron.d/x", None, b"*")), "/etc/cron.d/x"),
    "dot-dot": (members(("../outside", None, b"x")), "../outside"),
    "dot-dot inside": (members(("a/../../outside", None, b"x")), "a/../../outside"),
    "char device": (members(("null", tarfile.CHRTYPE, b"")), "null"),
    "block device": (members(("sda", tarfile.BLKTYPE, b"")), "sda"),
    "write through a symlink": (
        members(("etc", tarfile.SYMTYPE, b"/etc"), ("etc/passwd", None, b"root::0:0")),
        "etc/passwd",
    ),
    "file under a file": (members(("a", None, b"x"), ("a/b", None, b"y")), "a/b"),
    "hard link to nothing earlier": (
        members(("h", tarfile.LNKTYPE, b"/etc/shadow")),
        "h",
    ),
    "hard link to a directory": (
        members(("d", tarfile.DIRTYPE, b""), ("h", tarfile.LNKTYPE, b"d")),
        "h",
    ),
}


@pytest.mark.parametrize("case", HOSTILE)
async def test_a_hostile_archive_is_refused_and_nothing_is_stored(
    store: LocalStore, case: str
) -> None:
    tar, member = HOSTILE[case]

    with pytest.raises(UnsafeArchive) as refused:
        await checkpoint(store, tar, None)

    assert refused.value.member == member
    assert repr(member) in str(refused.value)
    assert not store.root.exists()


@pytest.mark.parametrize(
    ("cut", "says"),
    [
        (1100, "cut short"),  # in a's content
        (1536 + 100, "truncated"),  # in b's header
        (3072, "truncated"),  # after b, without the end-of-archive blocks
        (0, "not a tar archive"),
    ],
)
async def test_a_truncated_or_empty_archive_is_refused(
    store: LocalStore, cut: int, says: str
) -> None:
    tar = members(("a", None, b"x" * 1000), ("b", None, b"y" * 1000))

    with pytest.raises(UnsafeArchive, match=says):
        await checkpoint(store, tar[:cut], None)

    assert not store.root.exists()


async def test_garbage_is_not_an_archive(store: LocalStore) -> None:
    with pytest.raises(UnsafeArchive, match="not a tar archive"):
        await checkpoint(store, b"PK\x03\x04" + os.urandom(4096), None)


async def test_a_fifo_is_left_out_and_named(store: LocalStore) -> None:
    manifest, stats = await checkpoint(
        store, members(("pipe", tarfile.FIFOTYPE, b""), ("a", None, b"x")), None
    )

    assert [e.path for e in manifest.entries] == ["a"]
    assert stats.skipped == ("pipe",)


# -- corruption --------------------------------------------------------------------------------


async def test_a_corrupt_blob_is_an_error_naming_it(store: LocalStore, workspace: Path) -> None:
    manifest, _ = await checkpoint(store, tar_of(workspace), None)
    sha = manifest.by_path["run.sh"].sha256
    (store.root / "blobs" / sha).write_bytes(b"#!/bin/sh\nrm -rf ~\n")

    with pytest.raises(CorruptObject) as corrupt:
        await restore(store, manifest.id)
    assert corrupt.value.key == f"blobs/{sha}"
    assert f"blobs/{sha}" in str(corrupt.value)
    with pytest.raises(CorruptObject):
        await read_file(store, manifest.id, "run.sh", 100)


async def test_a_missing_blob_is_an_error_naming_it(store: LocalStore, workspace: Path) -> None:
    manifest, _ = await checkpoint(store, tar_of(workspace), None)
    sha = manifest.by_path["empty"].sha256
    (store.root / "blobs" / sha).unlink()

    with pytest.raises(MissingObject, match=f"blobs/{sha}") as missing:
        await restore(store, manifest.id)
    assert isinstance(missing.value, KeyError)


async def test_a_corrupt_manifest_is_detected(store: LocalStore, workspace: Path) -> None:
    manifest, _ = await checkpoint(store, tar_of(workspace), None)
    other, _ = await checkpoint(store, members(("a", None, b"x")), None)
    path = store.root / "manifests" / manifest.id
    path.write_bytes((store.root / "manifests" / other.id).read_bytes())

    with pytest.raises(CorruptObject, match=f"manifests/{manifest.id}"):
        await load_manifest(store, manifest.id)


async def test_an_unknown_checkpoint_is_missing(store: LocalStore) -> None:
    with pytest.raises(MissingObject):
        await load_manifest(store, "0" * 64)
    with pytest.raises(MissingObject, match="64 hex"):
        await load_manifest(store, "../../etc/passwd")


# -- reading a checkpoint ----------------------------------------------------------------------


@pytest.fixture
async def checkpointed(store: LocalStore, workspace: Path) -> Manifest:
    (workspace / "big").write_bytes(b"0123456789" * 1000)
    (workspace / "escape").symlink_to("../..")
    return (await checkpoint(store, tar_of(workspace), None))[0]


async def test_read_file_reads_from_a_checkpoint(store: LocalStore, checkpointed: Manifest) -> None:
    assert await read_file(store, checkpointed.id, "big", 25) == (
        b"0123456789" * 2 + b"01234",
        10000,
    )
    assert await read_file(store, checkpointed.id, "/workspace/src/pkg/mod.py", 100) == (
        b"print('hi')\n",
        12,
    )
    assert await read_file(store, checkpointed.id, "link-to-mod", 5) == (b"print", 12)
    assert await read_file(store, checkpointed.id, "link-to-dir/pkg/../pkg/mod.py", 5) == (
        b"print",
        12,
    )
    assert await read_file(store, checkpointed.id, "empty", 10) == (b"", 0)
    name = ODD_NAMES[0]
    assert await read_file(store, checkpointed.id, name, 100) == (name.encode(), len(name.encode()))


@pytest.mark.parametrize(
    ("path", "reason"),
    [
        ("nope", "no such file"),
        ("src", "is a directory"),
        ("run.sh/x", "not a directory"),
        ("../etc/passwd", "outside the workspace"),
        ("/etc/passwd", "outside the workspace"),
        ("link-abs", "outside the workspace"),
        ("escape/etc/passwd", "outside the workspace"),
        ("dangling", "no such file"),
    ],
)
async def test_read_file_refuses_what_is_not_a_file_of_the_workspace(
    store: LocalStore, checkpointed: Manifest, path: str, reason: str
) -> None:
    with pytest.raises(WorkspacePathError, match=reason):
        await read_file(store, checkpointed.id, path, 100)


async def test_list_files_lists_a_directory_of_a_checkpoint(
    store: LocalStore, checkpointed: Manifest
) -> None:
    root = await list_files(store, checkpointed.id, "")
    assert ("run.sh", "file", len("#!/bin/sh\necho run\n")) in root
    assert ("src", "dir", 0) in root
    assert ("link-to-dir", "link", len("src")) in root
    assert "src/pkg" not in [p for p, _, _ in root]
    assert [p for p, _, _ in root] == sorted(p for p, _, _ in root)
    assert await list_files(store, checkpointed.id, "/workspace/src") == [("src/pkg", "dir", 0)]
    assert await list_files(store, checkpointed.id, "link-to-dir/pkg") == [
        ("src/pkg/mod.py", "file", 12)
    ]
    assert await list_files(store, checkpointed.id, "empty-dir") == []
    assert await list_files(store, checkpointed.id, "run.sh") == [("run.sh", "file", 19)]


async def test_list_files_recursive_and_limited(store: LocalStore, checkpointed: Manifest) -> None:
    everything = await list_files(store, checkpointed.id, "", recursive=True, limit=10_000)
    assert [p for p, _, _ in everything] == [e.path for e in checkpointed.entries]
    assert await list_files(store, checkpointed.id, "src", recursive=True) == [
        ("src/pkg", "dir", 0),
        ("src/pkg/mod.py", "file", 12),
    ]
    assert len(await list_files(store, checkpointed.id, "", recursive=True, limit=3)) == 3
    with pytest.raises(WorkspacePathError, match="no such file"):
        await list_files(store, checkpointed.id, "nope")


# -- the local store ---------------------------------------------------------------------------

FAILING_WRITE = """
import resource, signal, sys
from pathlib import Path
import anyio
from toren.sandboxes.store import LocalStore

signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
store = LocalStore(Path(sys.argv[1]))
resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, 64 * 1024))
try:
    anyio.run(store.put, "blobs/x", b"n" * (1024 * 1024))
except OSError as e:
    print(e.errno)
"""


async def test_a_failed_local_write_leaves_the_old_object_and_no_partial_file(
    store: LocalStore,
) -> None:
    await store.put("blobs/x", b"old")

    # A real failure mid-write: the file size limit (EFBIG) stops the write after 64 KiB.
    done = subprocess.run(
        [sys.executable, "-c", FAILING_WRITE, str(store.root)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
        cwd=ROOT,
    )

    assert done.stdout.strip() == "27"  # EFBIG
    assert await store.get("blobs/x") == b"old"
    assert objects(store.root) == {"blobs/x"}
    assert [p.name for p in (store.root / "blobs").iterdir()] == ["x"]


async def test_local_store_get_of_a_missing_key_raises_missing_object(store: LocalStore) -> None:
    with pytest.raises(MissingObject, match="blobs/nope") as missing:
        await store.get("blobs/nope")
    assert isinstance(missing.value, KeyError)
    assert not await store.exists("blobs/nope")


@pytest.mark.parametrize("key", ["../x", "/abs", "a/../b", ".hidden", "a//b", ""])
async def test_local_store_refuses_keys_that_could_leave_its_root(
    store: LocalStore, key: str
) -> None:
    with pytest.raises(ValueError, match="invalid workspace store key"):
        await store.put(key, b"x")


# -- store URLs --------------------------------------------------------------------------------


def test_store_from_url_makes_local_stores(tmp_path: Path) -> None:
    made = store_from_url(f"file://{tmp_path}/ws%20store", env={})
    assert isinstance(made, LocalStore)
    assert made.root == tmp_path / "ws store"
    plain = store_from_url(str(tmp_path / "plain"), env={})
    assert isinstance(plain, LocalStore)
    assert plain.root == tmp_path / "plain"


def test_store_from_url_makes_s3_stores_with_the_endpoint_from_the_environment() -> None:
    made = store_from_url("s3://toren-ws/prod/runs/", env={"TOREN_S3_ENDPOINT_URL": "http://m:9"})
    assert isinstance(made, S3Store)
    assert (made.bucket, made.prefix, made.endpoint_url) == ("toren-ws", "prod/runs/", "http://m:9")
    aws = store_from_url("s3://toren-ws", env={"AWS_ENDPOINT_URL": "http://r2"})
    assert isinstance(aws, S3Store)
    assert (aws.prefix, aws.endpoint_url) == ("", "http://r2")
    default = store_from_url("s3://toren-ws", env={})
    assert isinstance(default, S3Store)
    assert default.endpoint_url is None


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("", "empty"),
        ("https://example.com/ws", "unsupported"),
        ("gs://bucket/x", "unsupported"),
        ("s3://Bad_Bucket/x", "not a valid S3 bucket name"),
        ("s3://b/x", "not a valid S3 bucket name"),
        ("s3://bucket/x?region=eu", "query"),
        ("file://otherhost/x", "no local path"),
    ],
)
def test_store_from_url_refuses_other_urls(url: str, says: str) -> None:
    with pytest.raises(ConfigError, match=says):
        store_from_url(url, env={})


def test_store_from_url_refuses_credentials_without_repeating_them() -> None:
    with pytest.raises(ConfigError) as refused:
        store_from_url("s3://AKIAEXAMPLE:hunter2@bucket/x", env={})
    assert "hunter2" not in str(refused.value)
    assert "AKIAEXAMPLE" not in str(refused.value)


# -- S3 (moto's server, real aioboto3) ---------------------------------------------------------


class CountingRelay:
    """A TCP relay on 127.0.0.1 in front of the S3 stand-in, counting every byte clients send
    through it (request lines, headers and bodies). What the checkpoint put on the wire is
    counted here, outside Toren and outside botocore: nothing Toren reports is trusted."""

    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        self.sent = 0
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return  # closed
            server = socket.create_connection(self.upstream)
            self._sockets += [client, server]
            threading.Thread(target=self._pipe, args=(client, server, True), daemon=True).start()
            threading.Thread(target=self._pipe, args=(server, client, False), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket, counted: bool) -> None:
        try:
            while data := src.recv(65536):
                if counted:
                    with self._lock:  # counted before it is forwarded: a reply means counted
                        self.sent += len(data)
                dst.sendall(data)
            dst.shutdown(socket.SHUT_WR)
        except OSError:
            pass

    def close(self) -> None:
        self._listener.close()
        for s in self._sockets:
            s.close()


@pytest.fixture(scope="module")
def moto_url() -> Iterator[str]:
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


@pytest.fixture
def s3_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    monkeypatch.delenv("AWS_PROFILE", raising=False)


@pytest.fixture
async def bucket(moto_url: str, s3_env: None, request: pytest.FixtureRequest) -> str:
    name = "ws-" + request.node.name.lower().replace("_", "-")[:40].strip("-")
    session = aioboto3.Session()
    async with session.client("s3", endpoint_url=moto_url, region_name="us-east-1") as s3:
        await s3.create_bucket(Bucket=name)
    return name


@pytest.fixture
async def s3_store(moto_url: str, bucket: str) -> AsyncIterator[S3Store]:
    store = S3Store(bucket, "runs/r1", endpoint_url=moto_url, region="us-east-1")
    yield store
    await store.close()


async def test_s3_round_trip(s3_store: S3Store, workspace: Path, tmp_path: Path) -> None:
    manifest, _ = await checkpoint(s3_store, tar_of(workspace), None)

    assert await s3_store.exists(f"manifests/{manifest.id}")
    restored = extract(await restore(s3_store, manifest.id), tmp_path / "restored")
    assert tree(restored) == tree(workspace)


async def test_s3_missing_key_is_missing_object(s3_store: S3Store) -> None:
    with pytest.raises(MissingObject, match="blobs/nope") as missing:
        await s3_store.get("blobs/nope")
    assert isinstance(missing.value, KeyError)
    assert not await s3_store.exists("blobs/nope")


async def test_s3_missing_bucket_is_a_config_error_naming_it(moto_url: str, s3_env: None) -> None:
    store = S3Store("no-such-bucket", endpoint_url=moto_url, region="us-east-1")
    try:
        with pytest.raises(ConfigError, match="'no-such-bucket' does not exist") as missing:
            await store.put("blobs/x", b"x")
        assert "does not create" in str(missing.value)
    finally:
        await store.close()


async def test_s3_unreachable_store_is_retryable(s3_env: None) -> None:
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        port = unused.getsockname()[1]
    store = S3Store(
        "bucket", endpoint_url=f"http://127.0.0.1:{port}", region="us-east-1", attempts=1
    )
    try:
        with pytest.raises(StoreUnavailable) as failed:
            await store.get("blobs/x")
        assert failed.value.retryable
    finally:
        await store.close()


async def test_one_changed_kilobyte_in_ten_megabytes_puts_under_64_kb_on_the_wire(
    moto_url: str, bucket: str, tmp_path: Path
) -> None:
    """The acceptance point of issue 15: a 10 MB workspace (10 files of 1 MiB of random
    bytes and a 1 KiB file) is checkpointed, the 1 KiB file changes, and it is checkpointed
    again. The bytes are counted by a relay between the aioboto3 client and moto's server:
    every byte the client sends (each request's line, headers and body, not only object
    sizes), so neither Toren's own figures nor moto's bookkeeping are trusted. The second
    checkpoint's count must be under 64 KiB; the first's about 10 MiB."""
    ws = tmp_path / "ws"
    ws.mkdir()
    for i in range(10):
        (ws / f"data-{i}.bin").write_bytes(os.urandom(MiB))
    (ws / "notes.txt").write_bytes(os.urandom(1024))
    relay = CountingRelay(("127.0.0.1", int(moto_url.rsplit(":", 1)[1])))
    store = S3Store(bucket, "runs/r1", endpoint_url=relay.url, region="us-east-1")
    try:
        first, _ = await checkpoint(store, tar_of(ws), None)
        first_sent = relay.sent
        (ws / "notes.txt").write_bytes(os.urandom(1024))
        second, stats = await checkpoint(store, tar_of(ws), first)
        second_sent = relay.sent - first_sent
    finally:
        await store.close()
        relay.close()

    print(f"first checkpoint {first_sent} bytes on the wire, second {second_sent}")
    assert 10 * MiB < first_sent < 10 * MiB + 256 * 1024
    assert second_sent < 64 * 1024, second_sent
    assert stats.blobs_uploaded == 1
    # A store made afresh (the host that had the container is gone) restores the new content.
    fresh = store_from_url(f"s3://{bucket}/runs/r1", env={"TOREN_S3_ENDPOINT_URL": moto_url})
    try:
        restored = extract(await restore(fresh, second.id), tmp_path / "restored")
    finally:
        await fresh.close()
    assert tree(restored) == tree(ws)


async def test_checkpoint_stats_count_what_the_store_was_given(store: LocalStore) -> None:
    _, stats = await checkpoint(store, members(("a", None, b"abc"), ("b", None, b"abc")), None)

    assert stats == CheckpointStats(
        manifest_id=stats.manifest_id,
        files=2,
        bytes_total=6,
        blobs_uploaded=1,
        bytes_uploaded=sum(p.stat().st_size for p in store.root.rglob("*") if p.is_file()),
        unchanged=False,
    )
