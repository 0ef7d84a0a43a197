"""Checkpoints of a sandbox's ``/workspace``: content-addressed, incremental, verified.

A checkpoint reads the workspace as a tar archive (what the Docker layer exports: member names
relative to the workspace, ``./`` prefixes allowed) and writes, to a
:class:`~toren.sandboxes.store.WorkspaceStore`::

    blobs/<sha256>      one regular file's content, plain (not compressed): a blob's key is the
                        sha256 of exactly the bytes stored, and random or already compressed
                        content gains nothing from compressing
    manifests/<id>      the :class:`Manifest` as canonical JSON, zlib-compressed; ``id`` is the
                        sha256 of the uncompressed JSON

Only the blobs the ``previous`` manifest does not reference are uploaded, then the manifest; an
unchanged workspace (same id) uploads nothing. Everything read back is checked against its hash,
so a checkpoint id recorded in a journal pins the workspace's exact content.

What an archive may hold (anything else refuses the whole checkpoint before anything is
uploaded: :class:`UnsafeArchive`):

- regular files, directories and symbolic links (a link's target is kept as written; links are
  never followed while checkpointing);
- hard links to a regular file earlier in the archive, kept as a copy of that file (a restore
  gives two independent files);
- FIFOs, which hold no content, are left out and named in :attr:`CheckpointStats.skipped`.

Refused: absolute names, ``..`` components, device nodes, sparse members, a member inside a
file or a symbolic link (``a`` a link to ``/etc``, then ``a/passwd``), a truncated archive.
Kept per entry: permission bits (``0o777``; setuid, setgid and sticky bits are dropped). Not
kept: owners (a restore writes the ``uid``/``gid`` it is given), modification times (a restore
writes the time of the restore). Missing parent directories are recorded as ``0o755``.

Memory: the archive is parsed in place (file contents are slices of it, hashed in a worker
thread); a restore holds the blobs and the archive it builds, about twice the workspace.

Errors (besides the store's)::

    TorenError
    ├── UnsafeArchive          the workspace archive holds a member refused above
    └── WorkspacePathError     read_file/list_files: no such path, or not the kind asked for
"""

from __future__ import annotations

import bisect
import functools
import hashlib
import io
import itertools
import json
import re
import tarfile
import time
import zlib
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, Literal, TypeVar

import anyio
import attrs

from toren._core.errors import TorenError
from toren.sandboxes.store import CorruptObject, MissingObject, WorkspaceStore

WORKSPACE = "/workspace"
"""The workspace's path in a sandbox: where absolute paths given to read_file/list_files start."""

CONCURRENCY = 8
"""Blob transfers in flight at once, per checkpoint or restore."""

MANIFEST_MAX = 256 * 1024 * 1024
"""The largest manifest JSON read back (a guard against a decompression bomb in the store)."""

_HEX64 = re.compile(r"[0-9a-f]{64}")

Kind = Literal["file", "dir", "link"]
_T = TypeVar("_T")


class UnsafeArchive(TorenError):
    """A workspace archive was refused; nothing of it was stored."""

    def __init__(self, member: str | None, reason: str) -> None:
        self.member = member  # None: the archive as a whole
        self.reason = reason
        what = f"member {member!r} {reason}" if member is not None else reason
        super().__init__(f"workspace archive refused, nothing stored: {what}")


class WorkspacePathError(TorenError):
    """A path in a checkpointed workspace is missing, or not the kind asked for."""

    def __init__(self, path: str, reason: str) -> None:
        self.path = path
        self.reason = reason
        super().__init__(f"workspace path {path!r}: {reason}")


# -- manifests ---------------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class Entry:
    """One path of a workspace."""

    path: str  # relative to the workspace, "/"-separated, without "." or ".." components
    kind: Kind
    mode: int  # permission bits
    size: int = 0  # files only
    sha256: str = ""  # files only
    target: str = ""  # links only, as written (it may point anywhere)

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {"path": self.path, "kind": self.kind, "mode": self.mode}
        if self.kind == "file":
            d.update(size=self.size, sha256=self.sha256)
        elif self.kind == "link":
            d["target"] = self.target
        return d


@attrs.frozen
class Manifest:
    """A workspace's content: its entries sorted by path, one per path (parents first)."""

    entries: tuple[Entry, ...]

    @functools.cached_property
    def canonical(self) -> bytes:
        # ensure_ascii: names that are not UTF-8 (surrogate escapes) survive the round trip
        doc = {"v": 1, "entries": [e.to_json() for e in self.entries]}
        return json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()

    @functools.cached_property
    def id(self) -> str:
        return hashlib.sha256(self.canonical).hexdigest()

    @functools.cached_property
    def by_path(self) -> Mapping[str, Entry]:
        return {e.path: e for e in self.entries}

    def blob_ids(self) -> frozenset[str]:
        return frozenset(e.sha256 for e in self.entries if e.kind == "file")

    @property
    def files(self) -> int:
        return sum(1 for e in self.entries if e.kind == "file")

    @property
    def bytes_total(self) -> int:
        return sum(e.size for e in self.entries)

    def resolve(self, path: str) -> Entry | None:
        """The entry ``path`` names (relative, or absolute under ``/workspace``), following
        symbolic links as the sandbox would, but never out of the workspace. None: the root.
        Raises WorkspacePathError."""
        if path == WORKSPACE or path.startswith(WORKSPACE + "/"):
            path = path[len(WORKSPACE) :]
        elif path.startswith("/"):
            raise WorkspacePathError(path, f"is outside the workspace ({WORKSPACE})")
        todo = path.split("/")[::-1]  # components, the next one last
        done: list[str] = []  # the resolved directory so far
        hops = 0
        entry: Entry | None = None
        while todo:
            part = todo.pop()
            if part in ("", "."):
                continue
            if part == "..":
                if not done:
                    raise WorkspacePathError(path, "leads outside the workspace")
                done.pop()
                entry = self.by_path.get("/".join(done)) if done else None
                continue
            entry = self.by_path.get("/".join([*done, part]))
            if entry is None:
                raise WorkspacePathError(path, "no such file or directory")
            if entry.kind == "link":
                hops += 1
                if hops > 40:
                    raise WorkspacePathError(path, "too many levels of symbolic links")
                target = entry.target
                if target == WORKSPACE or target.startswith(WORKSPACE + "/"):
                    done, target = [], target[len(WORKSPACE) :]
                elif target.startswith("/"):
                    raise WorkspacePathError(
                        path, f"is a link to {target!r}, outside the workspace"
                    )
                todo.extend(target.split("/")[::-1])
                entry = self.by_path.get("/".join(done)) if done else None
                continue
            if entry.kind == "file" and any(p not in ("", ".") for p in todo):
                raise WorkspacePathError(path, "not a directory")
            done.append(part)
        return entry


def _parse_manifest(key: str, manifest_id: str, raw: bytes) -> Manifest:
    try:
        inflate = zlib.decompressobj()
        canonical = inflate.decompress(raw, MANIFEST_MAX)
        if inflate.unconsumed_tail or not inflate.eof:
            raise CorruptObject(key, "not a complete zlib stream within the size limit")
    except zlib.error as e:
        raise CorruptObject(key, f"not zlib data: {e}") from None
    actual = hashlib.sha256(canonical).hexdigest()
    if actual != manifest_id:
        raise CorruptObject(key, f"its content hashes to {actual}")
    try:
        doc = json.loads(canonical)
        entries = tuple(_entry_from_json(d) for d in doc["entries"])
    except (ValueError, KeyError, TypeError) as e:
        raise CorruptObject(key, f"not a manifest: {e!r}") from None
    return Manifest(entries)


def _entry_from_json(d: dict[str, Any]) -> Entry:
    kind = d["kind"]
    if kind not in ("file", "dir", "link") or not isinstance(d["mode"], int):
        raise ValueError(f"bad entry {d!r}")
    if kind == "file" and not (isinstance(d["size"], int) and _HEX64.fullmatch(d["sha256"])):
        raise ValueError(f"bad file entry {d!r}")
    return Entry(
        path=str(d["path"]),
        kind=kind,
        mode=d["mode"],
        size=d.get("size", 0),
        sha256=d.get("sha256", ""),
        target=str(d.get("target", "")),
    )


# -- checkpoint and restore --------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class CheckpointStats:
    """What one checkpoint did."""

    manifest_id: str
    files: int
    bytes_total: int  # the files' sizes, summed
    blobs_uploaded: int
    bytes_uploaded: int  # blobs and the (compressed) manifest, as handed to the store
    unchanged: bool  # the same manifest as the previous checkpoint: nothing was uploaded
    skipped: tuple[str, ...] = ()  # members left out (FIFOs)


@attrs.frozen
class _Scan:
    manifest: Manifest
    contents: dict[str, memoryview]  # sha256 -> a slice of the archive
    skipped: tuple[str, ...]


def _member_path(name: str) -> str | None:
    """A member name as a workspace path; None for the workspace's root."""
    parts = [p for p in name.split("/") if p not in ("", ".")]
    if name.startswith("/"):
        raise UnsafeArchive(name, "has an absolute name")
    if ".." in parts or "\0" in name:
        raise UnsafeArchive(name, "has a '..' component" if ".." in parts else "contains NUL")
    return "/".join(parts) or None


def _scan(tar: bytes) -> _Scan:
    """Parse and hash the archive in one pass (file contents are sliced, never copied)."""
    view = memoryview(tar)
    entries: dict[str, Entry] = {}
    contents: dict[str, memoryview] = {}
    skipped: list[str] = []
    try:
        archive = tarfile.open(fileobj=io.BytesIO(tar), mode="r:")  # noqa: SIM115 (closed below)
    except tarfile.TarError as e:
        raise UnsafeArchive(None, f"not a tar archive ({e})") from None
    with archive:
        for m in archive:
            path = _member_path(m.name)
            mode = m.mode & 0o777
            if path is None:
                continue
            if m.isdir():
                entries[path] = Entry(path=path, kind="dir", mode=mode)
            elif m.issparse():
                raise UnsafeArchive(m.name, "is a sparse file, which is not supported")
            elif m.isreg():
                if m.offset_data + m.size > len(view):
                    raise UnsafeArchive(m.name, "is cut short: the archive is truncated")
                data = view[m.offset_data : m.offset_data + m.size]
                sha = hashlib.sha256(data).hexdigest()
                contents.setdefault(sha, data)
                entries[path] = Entry(path=path, kind="file", mode=mode, size=m.size, sha256=sha)
            elif m.issym():
                if not m.linkname or "\0" in m.linkname:
                    raise UnsafeArchive(m.name, "is a symbolic link without a valid target")
                entries[path] = Entry(path=path, kind="link", mode=mode, target=m.linkname)
            elif m.islnk():
                try:
                    source = entries.get(_member_path(m.linkname) or "")
                except UnsafeArchive:
                    source = None
                if source is None or source.kind != "file":
                    raise UnsafeArchive(
                        m.name, f"is a hard link to {m.linkname!r}, not to an earlier file"
                    )
                entries[path] = attrs.evolve(source, path=path)
            elif m.isfifo():
                skipped.append(path)
            else:
                raise UnsafeArchive(m.name, "is a device node or of an unsupported type")
        rest = view[archive.offset :].tobytes()
    # tar ends with two zero blocks: without them (or with data after) the archive was cut
    if len(rest) < 2 * tarfile.BLOCKSIZE or rest.count(0) != len(rest):
        raise UnsafeArchive(None, "truncated: no end-of-archive marker after the last member")
    for path in list(entries):
        parent = path.rpartition("/")[0]
        while parent:
            above = entries.get(parent)
            if above is not None:
                if above.kind != "dir":
                    raise UnsafeArchive(path, f"lies inside {parent!r}, which is a {above.kind}")
                break
            entries[parent] = Entry(path=parent, kind="dir", mode=0o755)
            parent = parent.rpartition("/")[0]
    manifest = Manifest(tuple(sorted(entries.values(), key=lambda e: e.path)))
    _ = manifest.id  # hashed here, in the worker thread
    return _Scan(manifest, contents, tuple(skipped))


async def _each(items: Sequence[_T], fn: Callable[[_T], Awaitable[None]]) -> None:
    """``fn`` on every item, CONCURRENCY at a time; the first failure cancels the rest and is
    raised as itself (not wrapped in an ExceptionGroup)."""
    pending = iter(items)

    async def worker() -> None:
        for item in pending:  # shared: each item is taken by one worker
            await fn(item)

    try:
        async with anyio.create_task_group() as tg:
            for _ in range(min(CONCURRENCY, len(items))):
                tg.start_soon(worker)
    except ExceptionGroup as group:
        raise group.exceptions[0] from None


async def checkpoint(
    store: WorkspaceStore, tar: bytes, previous: Manifest | None = None
) -> tuple[Manifest, CheckpointStats]:
    """Store the workspace in ``tar``, uploading only the file contents ``previous`` lacks.

    ``previous`` must be a manifest this store holds (returned by an earlier checkpoint, or
    loaded from it): its blobs are taken to be there. Raises UnsafeArchive (nothing is
    uploaded), or the store's errors (the blobs already uploaded stay; the manifest, written
    last, is not there, so no checkpoint names missing content).
    """
    scan = await anyio.to_thread.run_sync(_scan, tar)
    manifest = scan.manifest

    def stats(blobs: int, uploaded: int, *, unchanged: bool) -> CheckpointStats:
        return CheckpointStats(
            manifest_id=manifest.id,
            files=manifest.files,
            bytes_total=manifest.bytes_total,
            blobs_uploaded=blobs,
            bytes_uploaded=uploaded,
            unchanged=unchanged,
            skipped=scan.skipped,
        )

    if previous is not None and previous.id == manifest.id:
        return manifest, stats(0, 0, unchanged=True)
    known = previous.blob_ids() if previous is not None else frozenset[str]()
    new = sorted(manifest.blob_ids() - known)

    async def upload(sha: str) -> None:
        await store.put(f"blobs/{sha}", bytes(scan.contents[sha]))

    await _each(new, upload)
    body = zlib.compress(manifest.canonical)
    await store.put(f"manifests/{manifest.id}", body)
    blob_bytes = sum(len(scan.contents[sha]) for sha in new)
    return manifest, stats(len(new), blob_bytes + len(body), unchanged=False)


async def load_manifest(store: WorkspaceStore, manifest_id: str) -> Manifest:
    """The manifest of a checkpoint, checked against its id. Raises MissingObject (no such
    checkpoint in this store) or CorruptObject."""
    key = f"manifests/{manifest_id}"
    if not _HEX64.fullmatch(manifest_id):
        raise MissingObject(key, f"{store!r} (a checkpoint id is 64 hex digits)")
    return _parse_manifest(key, manifest_id, await store.get(key))


def _verified(entry: Entry, data: bytes) -> bytes:
    actual = hashlib.sha256(data).hexdigest()
    if actual != entry.sha256:
        key = f"blobs/{entry.sha256}"
        raise CorruptObject(key, f"its content hashes to {actual}, for {entry.path!r}")
    return data


async def restore(store: WorkspaceStore, manifest_id: str, *, uid: int = 0, gid: int = 0) -> bytes:
    """A tar archive of the checkpointed workspace (members sorted by path, parents first):
    directories, files with their permission bits, symbolic links, written as owned by
    ``uid``/``gid`` (an extraction as root keeps those; one as the sandbox user makes its files
    the user's whatever is written). Every blob is checked against its hash before anything is
    returned: raises CorruptObject or MissingObject naming the blob."""
    manifest = await load_manifest(store, manifest_id)
    first = {e.sha256: e for e in manifest.entries if e.kind == "file"}  # one per blob
    blobs: dict[str, bytes] = {}

    async def fetch(entry: Entry) -> None:
        data = await store.get(f"blobs/{entry.sha256}")
        blobs[entry.sha256] = await anyio.to_thread.run_sync(_verified, entry, data)

    await _each(list(first.values()), fetch)
    return await anyio.to_thread.run_sync(_write_tar, manifest, blobs, uid, gid)


def _write_tar(manifest: Manifest, blobs: dict[str, bytes], uid: int, gid: int) -> bytes:
    out = io.BytesIO()
    now = int(time.time())
    with tarfile.open(fileobj=out, mode="w:", format=tarfile.PAX_FORMAT) as archive:
        for e in manifest.entries:
            info = tarfile.TarInfo(e.path)
            info.mode, info.uid, info.gid, info.mtime = e.mode, uid, gid, now
            if e.kind == "dir":
                info.type = tarfile.DIRTYPE
                archive.addfile(info)
            elif e.kind == "link":
                info.type, info.linkname = tarfile.SYMTYPE, e.target
                archive.addfile(info)
            else:
                info.size = e.size
                archive.addfile(info, io.BytesIO(blobs[e.sha256]))
    return out.getvalue()


async def read_file(
    store: WorkspaceStore, manifest_id: str, path: str, cap: int
) -> tuple[bytes, int]:
    """The first ``cap`` bytes of a file in a checkpoint, and its whole size (links followed
    within the workspace). Raises WorkspacePathError, MissingObject or CorruptObject."""
    manifest = await load_manifest(store, manifest_id)
    entry = manifest.resolve(path)
    if entry is None or entry.kind == "dir":
        raise WorkspacePathError(path, "is a directory")
    data = await store.get(f"blobs/{entry.sha256}")
    data = await anyio.to_thread.run_sync(_verified, entry, data)
    return data[: max(cap, 0)], entry.size


async def list_files(
    store: WorkspaceStore,
    manifest_id: str,
    path: str = "",
    *,
    recursive: bool = False,
    limit: int = 1000,
) -> list[tuple[str, str, int]]:
    """Entries of a directory in a checkpoint, as the Docker layer lists a live workspace:
    ``(path relative to the workspace, kind, size)``, sorted by path, at most ``limit``; a
    link's size is its target's length (links are not followed, nor entered when recursive); a
    file's path lists that file alone. Raises WorkspacePathError or the store's errors."""
    manifest = await load_manifest(store, manifest_id)
    entry = manifest.resolve(path)
    if entry is not None and entry.kind != "dir":
        return [_listed(entry)][:limit]
    prefix = entry.path + "/" if entry is not None else ""
    found: list[tuple[str, str, int]] = []
    # entries are sorted by path: those under ``prefix`` are one run of them
    start = bisect.bisect_left(manifest.entries, prefix, key=lambda e: e.path)
    for e in itertools.islice(manifest.entries, start, None):
        if len(found) >= limit or not e.path.startswith(prefix):
            break
        if recursive or "/" not in e.path[len(prefix) :]:
            found.append(_listed(e))
    return found


def _listed(e: Entry) -> tuple[str, str, int]:
    size = len(e.target.encode(errors="surrogateescape")) if e.kind == "link" else e.size
    return e.path, e.kind, size
