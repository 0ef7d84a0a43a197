"""What a profile measures: CPU seconds of processes (from ``/proc``), py-spy's stacks of
some of them, and tables of both."""

from __future__ import annotations

import collections
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

from bench._common import ROOT

PY_SPY = Path(sys.executable).with_name("py-spy")
RATE = 400  # samples/s

# CPU accounting


def cpu_seconds(pid: int) -> float:
    try:
        t = psutil.Process(pid).cpu_times()
    except psutil.NoSuchProcess:
        return 0.0
    return float(t.user + t.system)


class Postgres:
    """Every process of the embedded server (postmaster and its children), by pid."""

    def __init__(self, data_dir: Path, *, spy: bool) -> None:
        self.spy = spy  # whether windows on this server sample stacks (--spy)
        self.postmaster = int((data_dir / "postmaster.pid").read_text().split()[0])

    def cpu(self) -> dict[int, tuple[str, float]]:
        root = psutil.Process(self.postmaster)
        out: dict[int, tuple[str, float]] = {}
        for p in [root, *root.children()]:
            try:
                t = p.cpu_times()
                out[p.pid] = (_role(p), float(t.user + t.system))
            except psutil.NoSuchProcess:
                pass
        return out


def _role(p: psutil.Process) -> str:
    try:
        title = " ".join(p.cmdline())
    except psutil.Error:
        return "?"
    if "postgres:" not in title:
        return "postmaster"
    role = title.split("postgres:", 1)[1].strip()
    return "backend" if role.startswith("postgres ") else role.split()[0]


class Window:
    """CPU of named processes and Postgres (and py-spy stacks of some) between start and stop."""

    def __init__(
        self, out: Path, name: str, pg: Postgres, procs: dict[str, int], spy: dict[str, int]
    ) -> None:
        self.out, self.name, self.pg, self.procs = out, name, pg, procs
        self.spy = spy if pg.spy else {}
        self._spies: list[subprocess.Popen[bytes]] = []

    def __enter__(self) -> Window:
        for label, pid in self.spy.items():
            # Two samplers: every busy thread (wall time, a socket write included), and only
            # the thread holding the GIL (Python's own work: a write releases the GIL).
            for suffix, extra in (("", []), (".gil", ["--gil"])):
                raw = self.out / f"{self.name}.{label}{suffix}.raw.txt"
                self._spies.append(
                    subprocess.Popen(
                        [PY_SPY, "record", "--pid", str(pid), "--format", "raw", "--rate",
                         str(RATE), "--nonblocking", *extra, "--output", str(raw)],
                        stdout=subprocess.DEVNULL,
                        stderr=subprocess.DEVNULL,
                    )
                )  # fmt: skip
        if self._spies:
            time.sleep(1.0)  # py-spy attaches
        self.cpu0 = {label: cpu_seconds(pid) for label, pid in self.procs.items()}
        self.pg0 = self.pg.cpu()
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.wall = time.perf_counter() - self.t0
        self.cpu = {label: cpu_seconds(pid) - self.cpu0[label] for label, pid in self.procs.items()}
        pg1 = self.pg.cpu()
        roles: collections.Counter[str] = collections.Counter()
        for pid, (role, seconds) in pg1.items():
            roles[role] += seconds - self.pg0.get(pid, (role, 0.0))[1]
        self.pg_roles = dict(roles)
        self.cpu["postgres"] = sum(roles.values())
        for spy in self._spies:
            spy.send_signal(signal.SIGINT)
        for spy in self._spies:
            spy.wait(timeout=60)

    def table(self, per: int, unit: str) -> str:
        lines = [
            f"wall {self.wall:.2f} s for {per:,} {unit}s; CPU seconds (share of one core "
            f"over the wall time; ms of CPU per {unit}):",
            "",
            "| process | CPU s | cores busy | CPU ms per " + unit + " |",
            "| --- | --- | --- | --- |",
        ]
        for label, seconds in self.cpu.items():
            lines.append(
                f"| {label} | {seconds:.2f} | {seconds / self.wall:.2f} | "
                f"{seconds * 1000 / per:.3f} |"
            )
        roles = ", ".join(
            f"{role} {s * 1000 / per:.3f}" for role, s in sorted(self.pg_roles.items()) if s > 0
        )
        lines += ["", f"Postgres by process, CPU ms per {unit}: {roles}", ""]
        return "\n".join(lines)


_FRAME = re.compile(r"^(?P<func>.*) \((?P<file>[^()]*?)(?::\d+)?\)$")
_SITE = re.compile(r"site-packages/([^/]+)")


def read_stacks(path: Path) -> list[tuple[list[tuple[str, str]], int]]:
    """py-spy's raw output: one line per stack, frames root first, and its sample count."""
    stacks = []
    for line in path.read_text().splitlines():
        frames_text, _, count = line.rpartition(" ")
        frames = []
        for frame in frames_text.split(";"):
            found = _FRAME.match(frame)
            frames.append((found["func"], found["file"]) if found else (frame, ""))
        stacks.append((frames, int(count)))
    return stacks


def area(file: str) -> str:
    """Which part of the program a file belongs to: a floor of ours, a library, the stdlib."""
    found = _SITE.search(file)
    if found:
        return found.group(1).removesuffix(".py")
    for floor_ in (
        "toren/_core",
        "toren/_agent",
        "toren/providers",
        "toren/_surfaces",
        "toren/runs",
        "supervisors",
        "actors",
        "bench",
    ):
        if f"/{floor_}/" in file or file.startswith(floor_ + "/"):
            return floor_
    if "/toren/" in file or file.startswith("toren/"):
        return "toren (other)"
    if "/asyncio/" in file:
        return "asyncio (event loop)"
    if "python3" in file or file.startswith("<frozen"):
        return "stdlib: " + Path(file).stem
    return file or "?"


def short(func: str, file: str) -> str:
    if "site-packages/" in file:
        file = file.split("site-packages/", 1)[1]
    elif "/python3.11/" in file:
        file = file.split("/python3.11/", 1)[1]
    elif str(ROOT) in file:
        file = file.split(str(ROOT) + "/", 1)[1]
    return f"{func} ({file})"


def summary(path: Path, top: int = 20, wall: float | None = None) -> str:
    """Tables of a raw py-spy file: samples per area (self), and per function (self and
    inclusive), each with its share of all busy samples."""
    if not path.exists():
        return f"`{path.name}`: not sampled (--no-spy).\n"
    stacks = read_stacks(path)
    total = sum(n for _, n in stacks)
    if not total:
        return f"{path.name}: no samples\n"
    own: collections.Counter[str] = collections.Counter()
    areas: collections.Counter[str] = collections.Counter()
    inclusive: collections.Counter[str] = collections.Counter()
    for frames, n in stacks:
        func, file = frames[-1]
        own[short(func, file)] += n
        areas[area(file)] += n
        for name in {short(f, fl) for f, fl in frames}:
            inclusive[name] += n
    busy = f"; {total / RATE / wall:.0%} of the wall time busy" if wall else ""
    out = [f"`{path.name}`: {total:,} busy samples at {RATE}/s{busy}.", ""]
    out += _rows("area (self)", areas, total, top)
    out += _rows("function (self)", own, total, top)
    out += _rows("function (inclusive)", inclusive, total, top + 10)
    return "\n".join(out)


def _rows(title: str, counts: collections.Counter[str], total: int, top: int) -> list[str]:
    rows = [f"| {title} | share |", "| --- | --- |"]
    rows += [f"| `{k}` | {v / total:.1%} |" for k, v in counts.most_common(top)]
    return [*rows, ""]
