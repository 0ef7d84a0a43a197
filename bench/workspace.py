"""Workspace checkpoints: how long does checkpointing a 10 MB workspace take when one 1 KB file
changed?

The workspace is 10 files of 1 MiB of random bytes and one 1 KiB file, given as tar bytes (as
the Docker layer exports it; building the tar is not timed). The first checkpoint uploads
everything; each timed one follows a new 1 KiB file and uploads one blob and the manifest.
``python -m bench.workspace [N]`` measures it against a local directory and against moto's S3
server on 127.0.0.1 (the real aioboto3 client) and prints the figures. The suite's ``sandbox``
section checkpoints the same workspace, exported from a container, with these helpers.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import sys
import tarfile
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio

from bench._common import median_ms, p99_ms
from toren.sandboxes.checkpoints import checkpoint, restore
from toren.sandboxes.store import LocalStore, S3Store, WorkspaceStore

MiB = 1024 * 1024


def workspace_tar(big: list[bytes], small: bytes) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w:", format=tarfile.PAX_FORMAT) as archive:
        for name, data in [*((f"data/{i}.bin", b) for i, b in enumerate(big)), ("notes", small)]:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    return out.getvalue()


async def checkpoint_bench(store: WorkspaceStore, n: int) -> dict[str, Any]:
    """Checkpoint a 10 MB workspace once, then ``n`` times with one changed 1 KiB file; the
    median and p99 of those ``n`` (ms), the first (full) checkpoint and a restore of the last."""
    big = [os.urandom(MiB) for _ in range(10)]
    start = time.perf_counter()
    previous, _ = await checkpoint(store, workspace_tar(big, os.urandom(1024)), None)
    first = time.perf_counter() - start
    times: list[float] = []
    uploaded: list[int] = []
    for _ in range(n):
        tar = workspace_tar(big, os.urandom(1024))
        start = time.perf_counter()
        previous, stats = await checkpoint(store, tar, previous)
        times.append(time.perf_counter() - start)
        uploaded.append(stats.bytes_uploaded)
    start = time.perf_counter()
    await restore(store, previous.id)
    restored = time.perf_counter() - start
    return {
        "n": n,
        "median_ms": round(median_ms(times), 2),
        "p99_ms": round(p99_ms(times), 2),
        "first_ms": round(first * 1000, 2),
        "restore_ms": round(restored * 1000, 2),
        "bytes_uploaded_max": max(uploaded, default=0),
    }


@contextlib.asynccontextmanager
async def moto_store(bucket: str = "bench-workspaces") -> AsyncIterator[S3Store]:
    """An S3Store on a bucket of moto's S3 server, started on 127.0.0.1 (the real aioboto3
    client) and stopped afterwards."""
    import aioboto3  # type: ignore[import-untyped]
    from moto.server import ThreadedMotoServer

    os.environ.setdefault("AWS_ACCESS_KEY_ID", "bench")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "bench")
    requests = logging.getLogger("werkzeug")  # moto's server logs every request at INFO
    level = requests.level
    requests.setLevel(logging.WARNING)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        url = f"http://{host}:{port}"
        async with aioboto3.Session().client("s3", endpoint_url=url, region_name="us-east-1") as s3:
            await s3.create_bucket(Bucket=bucket)
        store = S3Store(bucket, "bench", endpoint_url=url, region="us-east-1")
        try:
            yield store
        finally:
            await store.close()
    finally:
        server.stop()
        requests.setLevel(level)


async def main(n: int) -> None:
    with tempfile.TemporaryDirectory(prefix="toren-bench-ws-") as tmp:
        local = await checkpoint_bench(LocalStore(Path(tmp)), n)
    async with moto_store() as store:
        s3 = await checkpoint_bench(store, n)
    print("checkpoint of a 10 MB workspace with one changed 1 KiB file (ms)")
    for name, r in (("local directory", local), ("moto S3 (127.0.0.1)", s3)):
        print(
            f"  {name:20} median {r['median_ms']:7.2f}  p99 {r['p99_ms']:7.2f}  "
            f"first (full) {r['first_ms']:7.2f}  restore {r['restore_ms']:7.2f}  "
            f"uploaded <= {r['bytes_uploaded_max']} B  (n={r['n']})"
        )


if __name__ == "__main__":
    anyio.run(main, int(sys.argv[1]) if len(sys.argv) > 1 else 50)
