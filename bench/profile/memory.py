"""Parked runs: the worker's memory before, during and after a burst, from inside it."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import anyio

from bench import parked
from bench._common import ROOT, Bench
from bench.model import BenchModel
from bench.profile.measure import Postgres, short
from bench.profile.statements import settle
from toren import Client
from toren.runs import start_run

_HOOK = '''\
"""Loaded by bench.profile into a worker: SIGUSR2 dumps its memory figures."""
import os

if os.environ.get("BENCH_PROFILE_MEMORY"):
    import ctypes, gc, json, signal, sys, tracemalloc

    _dir = os.environ["BENCH_PROFILE_MEMORY"]
    _frames = int(os.environ.get("BENCH_PROFILE_FRAMES", "0"))
    if _frames:
        tracemalloc.start(_frames)

    class _Mallinfo2(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
            "uordblks", "fordblks", "keepcost")]

    def _dump(signum, frame):
        n = len([f for f in os.listdir(_dir) if f.endswith(".json")])
        stem = os.path.join(_dir, f"mem-{n}")
        libc = ctypes.CDLL(None)
        libc.mallinfo2.restype = _Mallinfo2
        info = libc.mallinfo2()
        with open(f"/proc/{os.getpid()}/status") as f:
            status = {l.split(":")[0]: l.split(":")[1].strip() for l in f if ":" in l}
        rss = {"heap": 0, "anonymous": 0, "files": 0}
        kind = "files"
        with open(f"/proc/{os.getpid()}/smaps") as f:
            for line in f:
                head = line.split()
                if head and "-" in head[0] and not head[0].endswith(":"):
                    path = head[5] if len(head) > 5 else ""
                    kind = "heap" if path == "[heap]" else "anonymous" if not path else "files"
                elif head and head[0] == "Rss:":
                    rss[kind] += int(head[1])
        figures = {
            "rss_kb": int(status["VmRSS"].split()[0]),
            "rss_by_mapping_kb": rss,
            "mallinfo2": {k: getattr(info, k) for k, _ in _Mallinfo2._fields_},
            "gc_objects": len(gc.get_objects()),
            "gc_frozen": gc.get_freeze_count(),
        }
        if tracemalloc.is_tracing():
            figures["traced"] = tracemalloc.get_traced_memory()
            figures["tracemalloc_overhead"] = tracemalloc.get_tracemalloc_memory()
            tracemalloc.take_snapshot().dump(stem + ".snapshot")
        saved = os.dup(2)
        with open(stem + ".pymalloc.txt", "w") as f:
            sys.stderr.flush()
            os.dup2(f.fileno(), 2)
            try:
                sys._debugmallocstats()
            finally:
                os.dup2(saved, 2)
                os.close(saved)
        with open(stem + ".json.part", "w") as f:
            json.dump(figures, f)
        os.replace(stem + ".json.part", stem + ".json")  # whole when it appears: the dump's end

    signal.signal(signal.SIGUSR2, _dump)
'''


async def _dump(pid: int, out: Path) -> dict[str, Any]:
    before = len(list(out.glob("mem-*.json")))
    os.kill(pid, signal.SIGUSR2)
    path = out / f"mem-{before}.json"
    deadline = time.monotonic() + 120
    while not path.exists():
        if time.monotonic() > deadline:
            raise RuntimeError("the worker did not dump its memory figures")
        await anyio.sleep(0.2)
    return dict(json.loads(path.read_text()), stem=str(path.with_suffix("")))


def _pymalloc(path: Path) -> dict[str, int]:
    figures = {}
    for line in Path(path).read_text().splitlines():
        for key in (
            "arenas allocated current",
            "arenas highwater mark",
            "bytes in allocated blocks",
            "bytes in available blocks",
            "bytes lost to pool headers",
            "bytes lost to quantization",
            "bytes lost to arena alignment",
            "Total",
        ):
            if line.startswith(("# " + key, key)):
                figures[key] = int(line.rsplit("=", 1)[1].strip().replace(",", ""))
    return figures


async def _in_memory(client: Client, pid: int) -> int:
    """The worker's actors in memory, as its last heartbeat published them."""
    stats = await client.pool.fetchval("SELECT stats FROM toren.workers WHERE pid = $1", pid)
    return int(stats.get("actors_in_memory", -1)) if stats else -1


async def phase_parked(
    b: Bench, pg: Postgres, out: Path, frames: int, n: int, allocator: str, max_actors: int
) -> str:
    hook = out / "hook"
    hook.mkdir(exist_ok=True)
    (hook / "sitecustomize.py").write_text(_HOOK)
    mem = out / f"parked-frames{frames}-{allocator}-max{max_actors or 'default'}"
    mem.mkdir(exist_ok=True)
    async with BenchModel() as model, await Client.connect(b.url) as client:
        env = {
            **model.env(),
            "PYTHONPATH": f"{hook}:{ROOT}",
            "BENCH_PROFILE_MEMORY": str(mem),
            "BENCH_PROFILE_FRAMES": str(frames),
            **({"PYTHONMALLOC": allocator} if allocator != "pymalloc" else {}),
            **({"TOREN_MAX_ACTORS": str(max_actors)} if max_actors else {}),
        }
        worker = b.start_worker(env)
        await b.wait_registered(client.pool, worker)
        await start_run(client, "bench_approve", "park steps=2 warm-up")
        while await parked._parked(client) < 1:
            await anyio.sleep(0.05)
        await settle(8)
        now = await client.pool.fetchval("SELECT extract(epoch FROM now())::float8")
        await parked._settled(client, worker.pid, now)
        rounds = [{**await _dump(worker.pid, mem), "label": "before (warm-up parked)"}]
        bursts: list[str] = []  # how long each batch took to park (the mid-burst dump included)
        for batch, label in ((n, "after {:,} parked"), (n // 3, "after {:,} more")):
            base = await parked._parked(client)
            started = time.perf_counter()
            async with anyio.create_task_group() as tg:
                tg.start_soon(parked._start, client, batch, f"run{len(rounds)}")
                while (done := await parked._parked(client) - base) < batch:
                    if len(rounds) == 1 and done >= batch // 2:  # mid-burst, the first time
                        mid = await _dump(worker.pid, mem)
                        actors = await _in_memory(client, worker.pid)
                        rounds.append({**mid, "label": f"mid-burst ({actors} actors in memory)"})
                    await anyio.sleep(0.5)
            bursts.append(f"{batch:,} runs parked in {time.perf_counter() - started:.1f} s")
            now = await client.pool.fetchval("SELECT extract(epoch FROM now())::float8")
            await parked._settled(client, worker.pid, now)
            await settle(6)  # one more renewal: the idle worker's collection and trim ran
            rounds.append({**await _dump(worker.pid, mem), "label": label.format(batch)})
        b.stop_workers()
    report = _memory_report(rounds, frames, f"{allocator}, max_actors {max_actors or 'default'}")
    return report + "\n" + "; ".join(bursts) + ".\n"


def _memory_report(rounds: list[dict[str, Any]], frames: int, allocator: str) -> str:
    lines = [f"## parked runs ({allocator}; tracemalloc frames: {frames or 'off'})", ""]
    lines += ["| figure | " + " | ".join(r["label"] for r in rounds) + " |"]
    lines += ["| --- |" + " --- |" * len(rounds)]

    def row(name: str, values: Iterable[float], fmt: str = "{:.1f}") -> None:
        lines.append(f"| {name} | " + " | ".join(fmt.format(v) for v in values) + " |")

    mb = 2**20
    row("RSS MB", (r["rss_kb"] / 1024 for r in rounds))
    for kind in ("heap", "anonymous", "files"):
        row(f"RSS in {kind} mappings MB", (r["rss_by_mapping_kb"][kind] / 1024 for r in rounds))
    row("glibc heap (arena) MB", (r["mallinfo2"]["arena"] / mb for r in rounds))
    row("glibc in use (uordblks) MB", (r["mallinfo2"]["uordblks"] / mb for r in rounds))
    row("glibc free, kept (fordblks) MB", (r["mallinfo2"]["fordblks"] / mb for r in rounds))
    row("glibc mmapped (hblkhd) MB", (r["mallinfo2"]["hblkhd"] / mb for r in rounds))
    stats = [_pymalloc(Path(r["stem"] + ".pymalloc.txt")) for r in rounds]
    if any(stats):  # none under PYTHONMALLOC=malloc or tracemalloc (pymalloc's hooks replaced)
        arenas = (s.get("arenas allocated current", 0) for s in stats)
        row("pymalloc arenas (1 MiB)", arenas, "{:.0f}")
        live = (s.get("bytes in allocated blocks", 0) / mb for s in stats)
        row("pymalloc allocated blocks MB", live)
        free = (s.get("bytes in available blocks", 0) / mb for s in stats)
        row("pymalloc free blocks MB", free)
    row("gc-tracked objects", (r["gc_objects"] for r in rounds), "{:,.0f}")
    if frames:
        row("tracemalloc traced MB", (r["traced"][0] / mb for r in rounds))
        row("tracemalloc's own MB", (r["tracemalloc_overhead"] / mb for r in rounds))
        for r in rounds[1:3]:
            lines += ["", f"### {r['label']} against before", ""]
            lines += [_snapshot_diff(rounds[0]["stem"], r["stem"], frames)]
    return "\n".join(lines) + "\n"


def _snapshot_diff(before: str, after: str, frames: int, top: int = 25) -> str:
    import tracemalloc

    old = tracemalloc.Snapshot.load(before + ".snapshot")
    new = tracemalloc.Snapshot.load(after + ".snapshot")
    total = sum(s.size_diff for s in new.compare_to(old, "filename"))
    out = [f"Python allocations, growth: {total / 2**20:+.2f} MB in all.", ""]
    out += ["| file (live bytes, growth) | MB | blocks |", "| --- | --- | --- |"]
    for s in new.compare_to(old, "filename")[:top]:
        out.append(f"| `{short('', s.traceback[0].filename)[2:-1]}` | {s.size_diff / 2**20:+.2f} "
                   f"| {s.count_diff:+,} |")  # fmt: skip
    out += ["", "| where (innermost line; traceback) | MB | blocks |", "| --- | --- | --- |"]
    for s in new.compare_to(old, "traceback")[:top]:
        where = " < ".join(
            f"{short('', f.filename)[2:-1]}:{f.lineno}" for f in list(s.traceback)[:3]
        )
        out.append(f"| `{where}` | {s.size_diff / 2**20:+.2f} | {s.count_diff:+,} |")
    return "\n".join(out) + "\n"
