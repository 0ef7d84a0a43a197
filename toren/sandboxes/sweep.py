"""The sweep of sandbox checkpoints no kept actor names any more (a mark-and-sweep).

A checkpoint (:mod:`toren.sandboxes.checkpoints`) is a manifest and the blobs it lists, and many
checkpoints share blobs. What the database names is kept: a sandbox's journal names each of its
checkpoints (``workspace.checkpointed``), its arguments the one a fork started from, its
snapshot the last one; a run's journal names the checkpoint after each sandboxed call, and a
fork's the one it started from (a fork copies its source's events, so it names them itself).
When runs are pruned, their journals and their sandboxes' go, and the checkpoints only they
named can go too.

A sweep:

1. lists the store's manifests with the time each was last written;
2. marks the manifests written before the grace period that the database still names
   (:func:`toren._core.references.mentioned`: in one snapshot of every journal, snapshot,
   actor's arguments and summary, waiting message and dead letter, the values of JSON members
   called ``checkpoint``, at any depth: every payload naming a checkpoint names it so);
3. deletes the other old manifests, then lists the blobs (a page at a time) and deletes the
   old ones that no manifest left lists. Keys not shaped as a checkpoint's are never deleted.

Why the grace period (``checkpoint_grace``, a day by default) makes it safe: a checkpoint is
written (blobs first, its manifest last) before the event that names it is committed, so for a
while it is named nowhere; every such write takes seconds (at most the sandbox's command
timeout), far less than the grace, and whatever is written after the listing is younger than
it. A blob that a new checkpoint writes again (the same content under the same key) is written
anew, so it is young again: each delete checks the object's time first, and a local store's
delete cannot lose such a write (see :meth:`toren._core.stores.LocalStore.delete`). What a
failed checkpoint left (a worker killed between its uploads and its event) is named nowhere and
goes one grace period later.

What goes for good: the checkpoints of pruned runs (an archived journal still names them, but
a run restored from its archive shows its timeline, not its workspace).
"""

from __future__ import annotations

import logging
import re
import socket
import time
from collections.abc import MutableMapping
from typing import TYPE_CHECKING

import anyio
import attrs

from toren._core.references import mentioned
from toren._core.stores import CorruptObject, LocalStore, MissingObject, ObjectStore
from toren.sandboxes.checkpoints import load_manifest

if TYPE_CHECKING:
    from toren._core.rows import Db

log = logging.getLogger("toren.sandbox")

_HEX64 = re.compile(r"[0-9a-f]{64}")

DEFAULT_GRACE = 86400.0
"""Seconds a checkpoint's objects are kept after they were written, whatever names them."""


@attrs.frozen(kw_only=True)
class SweepStats:
    """What a sweep found and did."""

    manifests: int  # listed
    blobs: int  # listed
    kept: int  # old manifests the database still names
    manifests_deleted: int
    blobs_deleted: int
    bytes_deleted: int  # manifests' and blobs'
    blobs_held: bool = False  # a manifest could not be read: no blob was deleted
    dry_run: bool = False  # nothing was deleted: the counts say what would have been


def _digests(listings: list[bytes]) -> set[bytes]:
    """Every 32-byte digest in ``listings`` (manifests' blobs, end to end)."""
    found: set[bytes] = set()
    for listing in listings:
        found.update(listing[i : i + 32] for i in range(0, len(listing), 32))
    return found


def lock_name(store: ObjectStore) -> str:
    """The cluster-wide lock a sweep of ``store`` holds (:func:`toren.kernel.singleton`): one
    per store, so workers sharing a bucket take turns and each machine's local store (named by
    its host) is swept by a worker of that machine."""
    where = f"{socket.gethostname()}:{store!r}" if isinstance(store, LocalStore) else repr(store)
    return f"checkpoint_sweep:{where}"


async def sweep_checkpoints(
    db: Db,
    store: ObjectStore,
    *,
    grace: float = DEFAULT_GRACE,
    now: float | None = None,
    listed: MutableMapping[str, bytes] | None = None,
    dry_run: bool = False,
) -> SweepStats:
    """Delete the checkpoints (manifests, then blobs) that no actor of the database ``db`` (a
    pool, or a connection: the one holding the sweep's lock) names and that were written more
    than ``grace`` seconds before ``now``.

    ``listed`` caches each manifest's blobs between sweeps (manifests never change: a
    manifest's key is the hash of its content), as their 32-byte digests end to end (32 bytes
    a file: a million files of kept checkpoints hold 32 MB); give the same mapping to each
    sweep of one worker so that a sweep reads only the manifests written since the last.
    ``dry_run``: delete nothing, count what would go.

    A manifest that cannot be read (corrupt) keeps every blob: what it lists is unknown. A
    manifest deleted meanwhile lists nothing.

    Raises:
        asyncpg.PostgresError: the mark failed; nothing was deleted.
        StoreError: the store failed; what was deleted before stays deleted (each object
            deleted is one no kept checkpoint needs).
    """
    cutoff = (time.time() if now is None else now) - grace
    listed = {} if listed is None else listed
    manifests = {  # a checkpoint's manifest: anything else in the store is not the sweep's
        o.key.removeprefix("manifests/"): o
        async for o in store.list_objects("manifests/")
        if _HEX64.fullmatch(o.key.removeprefix("manifests/"))
    }
    old = {m for m, o in manifests.items() if o.written_at < cutoff}
    kept = await mentioned(db, old, key="checkpoint")
    doomed = sorted(old - kept)
    deleted_manifests = deleted_bytes = 0
    for manifest_id in doomed:
        if dry_run or await store.delete(f"manifests/{manifest_id}", written_before=cutoff):
            deleted_manifests += 1
            deleted_bytes += manifests[manifest_id].size
            if not dry_run:
                listed.pop(manifest_id, None)
        else:
            kept.add(manifest_id)
    # the blobs of every manifest left (young or named), read once per worker
    left: list[bytes] = []
    held = False
    for manifest_id in manifests.keys() - set(doomed) | kept:
        if manifest_id not in listed:
            try:
                manifest = await load_manifest(store, manifest_id)
            except MissingObject:
                continue
            except CorruptObject as exc:
                log.warning("checkpoint sweep: %s; no blob is deleted until it is removed", exc)
                held = True
                continue
            listed[manifest_id] = b"".join(bytes.fromhex(b) for b in sorted(manifest.blob_ids()))
        left.append(listed[manifest_id])
    needed = await anyio.to_thread.run_sync(_digests, left)  # seconds for millions of files
    # blobs are listed last, a page at a time (a store may hold millions): one written since
    # the manifests were listed is young, or named by a manifest kept (a checkpoint uploads
    # what its previous one, kept, does not hold)
    blobs = deleted_blobs = 0
    async for o in store.list_objects("blobs/"):
        blobs += 1
        sha = o.key.removeprefix("blobs/")
        if (
            not held
            and o.written_at < cutoff
            and _HEX64.fullmatch(sha)  # anything else under blobs/ is not the sweep's
            and bytes.fromhex(sha) not in needed
            and (dry_run or await store.delete(o.key, written_before=cutoff))
        ):
            deleted_blobs += 1
            deleted_bytes += o.size
    for gone in listed.keys() - manifests.keys():
        del listed[gone]
    stats = SweepStats(
        manifests=len(manifests),
        blobs=blobs,
        kept=len(old & kept),
        manifests_deleted=deleted_manifests,
        blobs_deleted=deleted_blobs,
        bytes_deleted=deleted_bytes,
        blobs_held=held,
        dry_run=dry_run,
    )
    if (deleted_manifests or deleted_blobs) and not dry_run:
        log.info(
            "checkpoint sweep: %d checkpoints and %d blobs that no kept actor names were deleted "
            "(%d bytes)",
            deleted_manifests,
            deleted_blobs,
            deleted_bytes,
        )
    return stats
