"""The sandbox cells: a run whose tools run in its sandbox on real Docker, faulted at each phase
of a sandboxed call, judged against the clean run.

The ``sandboxed`` agent's run (see :data:`chaos.servers.SANDBOX_CALLS`) lists its empty
workspace (the call that makes the container), writes ``step.py``, runs ``python3 step.py
quick`` and ``python3 step.py long 1.5``, then ``ps -eo args`` and ``ls /run/toren``, and
answers. Each run of ``step.py`` appends ``NAME start`` and ``NAME end`` to ``log.txt``: the
workspace counts the runs of each command. ``rerunnable`` is the same agent with its sandbox
declared rerunnable.

What must hold after a faulted run:

- the run completed with the clean run's output; every model call made, each once, plus at most
  the repeats the cell allows; none sent again after its ``model.called``; the receipt replays
  what the journal says;
- every sandboxed call has exactly one ``tool.result`` in the run's journal and one
  ``command.intended`` and ``command.finished`` in the sandbox's: none silently lost;
- each result is what the clean run's model was told, except that of the one call in flight at
  the fault (intended, not finished), which may instead say it was interrupted or that it
  finished while its worker was stopping (with the clean run's output); a rerunnable sandbox
  runs it again instead (every result as in the clean run). A worker that gives its actors up
  by itself while a call runs (a lease renewal starved on a loaded machine) is a fault too: a
  call it was running may be told interrupted, and the cell's note says so;
- the workspace of the last checkpoint (the one the run's last result names, read from the
  store): ``step.py`` as written; each command started at most once (at least once when
  rerunnable); a command reported as run or finished ran to its end; the log's lines those of the
  clean run, leaving out those of an interrupted command;
- the old command was found and killed: ``ps`` in the container after it shows no ``step.py``;
- no record of a command whose result is journaled is left in the container (its stored output
  would fill /tmp): ``ls /run/toren`` shows its own command's alone (but for the ``.started``
  the sandbox keeps of each);
- no container of the run left 60 s after its end (the run's end reaps it; the orphan reaper,
  every second here, removes what that missed);
- both journals contiguous, their epochs never going back, no stale write after a takeover;
  nothing dead-lettered.

Cells need a Docker daemon and the sandbox image (:func:`docker_missing`): without them they are
skipped with the reason, or failed when ``CI=true``.
"""

from __future__ import annotations

import re
import time
from collections import Counter
from collections.abc import Iterable, Mapping
from datetime import datetime
from pathlib import Path
from typing import Any, Literal

import anyio
import attrs
from aiodocker.exceptions import DockerError

from chaos.oracle import Row, Takeover, Verdict, duplicate_usd, journal_problems, run_problems
from chaos.servers import SANDBOX_CALLS, STEP_PY, case, position
from toren import Client
from toren.actors.sandboxes.docker import Docker, Unavailable
from toren.actors.sandboxes.outcomes import ExecFailed
from toren.runs import RunState, read_run
from toren.sandboxes import DEFAULT_IMAGE, sandbox_address
from toren.sandboxes.checkpoints import WorkspacePathError, read_file
from toren.sandboxes.store import LocalStore, StoreError

GONE_WITHIN = 60.0  # seconds after the run's end by which its container must be gone
REAP_SECONDS = "1"  # the orphan reaper's period in the sandbox cells' workers
LOG = "log.txt"
PS_CALL = "s4"  # the call that looks for leftover processes
RECORDS_CALL = "s5"  # the call that lists the records of commands in the container
COMMAND_CALLS = {"s2": "quick", "s3": "long"}  # the calls that run step.py, by the name it logs
IN_FLIGHT_LINE = b"long start\n"  # the harness's sandbox.in_flight: the long command is running

Report = Literal["as run", "interrupted", "recovered"]

# What a worker logs when it stops its actors (or one of them) by itself.
_GAVE_UP = re.compile(
    r"^(\S+Z) .*(lease renewal keeps failing|lost its lock connection|lease lost to another "
    r"worker|fenced out|the lease may have lapsed)",
    re.MULTILINE,
)


def gave_up(logs: Iterable[str]) -> tuple[float, ...]:
    """When the workers of a cell stopped actors by themselves (seconds since the epoch), from
    their logs: planned by the fault or not, a call running then may have been cut."""
    return tuple(
        sorted(
            datetime.fromisoformat(m[1]).timestamp() for log in logs for m in _GAVE_UP.finditer(log)
        )
    )


async def docker_missing() -> str | None:
    """Why sandbox cells cannot run here (no daemon, no image), or None."""
    try:
        docker = await Docker.connect()
    except Unavailable as exc:
        return str(exc)
    try:
        await docker.check_image(DEFAULT_IMAGE)
    except Unavailable as exc:
        return str(exc)
    finally:
        await docker.close()
    return None


def worker_env(folder: Path) -> dict[str, str]:
    """A sandbox cell's worker settings: sandboxes on, the cell's own store, a fast reaper."""
    return {
        "TOREN_SANDBOXES": "true",
        "TOREN_WORKSPACE_STORE": str(folder / "workspaces"),
        "TOREN_SANDBOX_REAP_SECONDS": REAP_SECONDS,
    }


async def watch_in_flight(docker: Docker, run_id: str, arrived: anyio.Event) -> None:
    """Set ``arrived`` once the long command is running in the run's container (its first line
    is in the workspace's log); the harness faults the worker then."""
    while not arrived.is_set():
        found = await docker.find(run_id)
        if found is not None and found.state == "running":
            try:
                data, _ = await docker.read_file(found.container_id, LOG, 4096)
            except (FileNotFoundError, ExecFailed, DockerError):
                data = b""
            if IN_FLIGHT_LINE in data:
                arrived.set()
                return
        await anyio.sleep(0.02)


async def wait_gone(docker: Docker, run_id: str, within: float = GONE_WITHIN) -> float | None:
    """Seconds until the run's container was gone (polled), or None if still there ``within``
    seconds on."""
    started = time.monotonic()
    with anyio.move_on_after(within):
        while await docker.find(run_id) is not None:
            await anyio.sleep(0.1)
        return time.monotonic() - started
    return None


async def remove_left(docker: Docker, run_id: str) -> None:
    """Remove the run's container if a failed cell left it (nothing leaks between cells)."""
    found = await docker.find(run_id)
    if found is not None:
        await docker.remove(found.container_id)


async def open_calls(client: Client, run_id: str) -> frozenset[str]:
    """The sandboxed calls intended and not finished: in flight, as the journal has it."""
    rows = await client.pool.fetch(
        "SELECT type, data->>'call_id' AS call_id FROM toren.journal "
        "WHERE actor_id = $1 AND type IN ('command.intended', 'command.finished')",
        sandbox_address(run_id),
    )
    intended = {r["call_id"] for r in rows if r["type"] == "command.intended"}
    return frozenset(intended - {r["call_id"] for r in rows if r["type"] == "command.finished"})


@attrs.frozen
class SandboxExpected:
    """What the clean sandboxed run did."""

    output: str
    steps: int
    results: Mapping[str, str]  # call id -> what the model was told
    log: tuple[str, ...]  # log.txt's lines in the last checkpoint


@attrs.frozen
class SandboxObserved:
    state: RunState
    journal: tuple[Row, ...]  # the run's
    sandbox_journal: tuple[Row, ...]
    arrivals: tuple[tuple[float, int], ...]  # (when, step) of each model request for this run
    checkpoint: str | None  # the one the run's last tool.result names
    files: Mapping[str, str]  # step.py and log.txt in that checkpoint (missing: absent)
    store_problem: str  # the checkpoint could not be read: why
    deadletters: int
    allowed_repeats: int
    open_at_fault: frozenset[str]  # sandboxed calls intended and not finished at the fault
    rerunnable: bool
    gone_after: float | None  # seconds from the run's end until its container was gone
    gave_up: tuple[float, ...] = ()  # when a worker stopped actors by itself (see gave_up)
    # Where the run's and the sandbox's journals stood at a sigstop takeover ("run", "sandbox")
    takeovers: Mapping[str, Takeover] = attrs.field(factory=dict)
    # Not known: a worker may give its actors up by itself too (see chaos.oracle.lost_problems)
    unsent: frozenset[int] | None = None


async def _journal(client: Client, actor_id: str) -> tuple[Row, ...]:
    rows = await client.pool.fetch(
        "SELECT seq, epoch, type, data, extract(epoch FROM created_at)::float8 AS at "
        "FROM toren.journal WHERE actor_id = $1 ORDER BY seq",
        actor_id,
    )
    return tuple(Row(r["seq"], r["epoch"], r["type"], r["data"], r["at"]) for r in rows)


async def observe_sandbox(
    client: Client,
    run_id: str,
    arrivals: list[tuple[float, dict[str, Any]]],
    store: Path,
    *,
    allowed_repeats: int,
    open_at_fault: frozenset[str],
    rerunnable: bool,
    gone_after: float | None,
    takeovers: Mapping[str, Takeover],
    logs: Iterable[str] = (),
) -> SandboxObserved:
    state = await read_run(client, run_id)
    journal = await _journal(client, run_id)
    results = [r for r in journal if r.type == "tool.result"]
    checkpoint = results[-1].data.get("checkpoint") if results else None
    files: dict[str, str] = {}
    problem = ""
    if checkpoint is None:
        problem = "the run's last result names no checkpoint"
    else:
        local = LocalStore(store)
        for path in ("step.py", LOG):
            try:
                data, _ = await read_file(local, checkpoint, path, 1 << 20)
            except WorkspacePathError:
                continue
            except StoreError as exc:
                problem = f"checkpoint {checkpoint[:12]} unreadable: {exc}"
                break
            files[path] = data.decode("utf-8", errors="replace")
    return SandboxObserved(
        state=state,
        journal=journal,
        sandbox_journal=await _journal(client, sandbox_address(run_id)),
        arrivals=tuple((t, position(r)) for t, r in arrivals if case(r) == state.input),
        checkpoint=checkpoint,
        files=files,
        store_problem=problem,
        deadletters=await client.pool.fetchval("SELECT count(*) FROM toren.deadletters"),
        allowed_repeats=allowed_repeats,
        open_at_fault=open_at_fault,
        rerunnable=rerunnable,
        gone_after=gone_after,
        takeovers=takeovers,
        gave_up=gave_up(logs),
    )


def report(content: str) -> Report:
    """How a sandboxed call's result says it ended: run (whatever its exit), interrupted by a
    crash, or finished while its worker was stopping (found finished by the next owner)."""
    header = content.split("\n", 2)[1] if content.count("\n") >= 1 else ""
    if "; interrupted: the worker running it stopped" in header:
        return "interrupted"
    if "finished while its worker was stopping" in header:
        return "recovered"
    return "as run"


def _body(content: str) -> str:
    """A command's result without its two header lines (command, how it ended): its output."""
    return content.split("\n", 2)[2] if content.count("\n") >= 2 else ""


def _markers(listing: str) -> set[str]:
    """The commands whose records ``ls /run/toren`` shows (its own among them). A command's
    ``.started`` alone is kept on purpose (a marker runs at most once in a container); the
    rest (the stored output above all) must go once its result is journaled."""
    return {
        marker
        for marker, _, part in (name.partition(".") for name in _body(listing).split())
        if part != "started"
    }


def _by_call(rows: tuple[Row, ...], kind: str) -> Counter[str]:
    return Counter(r.data["call_id"] for r in rows if r.type == kind)


def judge_sandbox(seen: SandboxObserved, expected: SandboxExpected) -> Verdict:
    problems, counts = run_problems(seen, output=expected.output, steps=expected.steps)
    problems.extend(f"run: {p}" for p in journal_problems(seen.journal, seen.takeovers.get("run")))
    problems.extend(
        f"sandbox: {p}"
        for p in journal_problems(seen.sandbox_journal, seen.takeovers.get("sandbox"))
    )

    reports = _result_problems(seen, expected, problems)
    problems.extend(_workspace_problems(seen, expected, reports))
    if seen.gone_after is None:
        problems.append(f"the run's container was still there {GONE_WITHIN:g}s after its end")
    if seen.deadletters:
        problems.append(f"{seen.deadletters} messages dead-lettered")
    repeats = sum(n - 1 for n in counts.values())
    return Verdict(tuple(problems), repeats, duplicate_usd(seen.state, counts))


def _result_problems(
    seen: SandboxObserved, expected: SandboxExpected, problems: list[str]
) -> dict[str, Report]:
    """Each sandboxed call told to the model once, as in the clean run, unless it was in flight
    at the fault; returns how each call's result says it ended."""
    results = {
        r.data["call_id"]: r.data["content"] for r in seen.journal if r.type == "tool.result"
    }
    told = _by_call(seen.journal, "tool.result")
    intended = _by_call(seen.sandbox_journal, "command.intended")
    finished = _by_call(seen.sandbox_journal, "command.finished")
    reports: dict[str, Report] = {}
    for call in SANDBOX_CALLS:
        call_id = call.id
        if told[call_id] != 1:
            lost = " (silently lost)" if not told[call_id] else ""
            problems.append(f"{told[call_id]} tool.result for call {call_id}, expected one{lost}")
        if (intended[call_id], finished[call_id]) != (1, 1):
            problems.append(
                f"call {call_id}: {intended[call_id]} command.intended and {finished[call_id]} "
                "command.finished in the sandbox's journal, expected one each"
            )
        content = results.get(call_id)
        if content is None:
            continue
        reports[call_id] = how = report(content)
        clean = expected.results[call_id]
        if how == "as run":
            if call_id in (PS_CALL, RECORDS_CALL):  # what they list differs from run to run
                if content.split("\n", 2)[:2] != clean.split("\n", 2)[:2]:
                    problems.append(f"call {call_id} told {content[:200]!r}")
                elif call_id == PS_CALL and "step.py" in _body(content):
                    problems.append(
                        "a command from before the fault still runs (ps shows step.py): "
                        f"{_body(content)[:400]!r}"
                    )
                elif call_id == RECORDS_CALL and len(_markers(content)) != 1:
                    problems.append(
                        f"records of {len(_markers(content)) - 1} journaled command(s) left in "
                        f"the container's /run/toren: {sorted(_markers(content))}"
                    )
            elif content != clean:
                problems.append(f"call {call_id} told {content[:300]!r}, clean {clean[:300]!r}")
            continue
        if seen.rerunnable:
            problems.append(f"call {call_id} of a rerunnable sandbox told {how}, not run again")
        if call_id not in seen.open_at_fault and not _cut(seen, call_id):
            problems.append(
                f"call {call_id} told {how}, but it was not in flight at the fault "
                f"(in flight: {sorted(seen.open_at_fault)})"
            )
        if how == "recovered" and _body(content) != _body(clean):
            problems.append(
                f"call {call_id} finished before its record, its output {_body(content)!r}, "
                f"clean {_body(clean)!r}"
            )
    planned = {c: how for c, how in reports.items() if how != "as run" and not _cut(seen, c)}
    if len(planned) > 1:
        problems.append(f"more than one call not told as run: {planned}")
    return reports


def _running(seen: SandboxObserved, call_id: str) -> tuple[float, float]:
    """When the sandbox recorded the call's intent, and its end."""
    at = {
        r.type: r.data.get("at", 0.0)
        for r in seen.sandbox_journal
        if r.data.get("call_id") == call_id
    }
    return at.get("command.intended", 0.0), at.get("command.finished", 0.0)


def _cut(seen: SandboxObserved, call_id: str) -> bool:
    """Whether a worker stopped actors by itself while the call ran (an unplanned fault)."""
    start, end = _running(seen, call_id)
    return any(start <= t <= end for t in seen.gave_up)


def note(seen: SandboxObserved) -> str:
    """What became of the calls in flight: those not told as run, and commands run again."""
    results = {
        r.data["call_id"]: r.data["content"] for r in seen.journal if r.type == "tool.result"
    }
    parts = []
    for call_id, content in sorted(results.items()):
        how = report(content)
        if how != "as run":
            planned = call_id in seen.open_at_fault or not _cut(seen, call_id)
            parts.append(f"{call_id} {how}" + ("" if planned else " (unplanned lease loss)"))
    started = Counter(seen.files.get(LOG, "").splitlines())
    parts.extend(
        f"{name} ran {started[f'{name} start']}x"
        for name in COMMAND_CALLS.values()
        if started[f"{name} start"] > 1
    )
    return ", ".join(parts)


def _workspace_problems(
    seen: SandboxObserved, expected: SandboxExpected, reports: Mapping[str, Report]
) -> list[str]:
    """The last checkpoint: the script as written, each command run once (at least once when
    rerunnable), the log as the clean run's but for an interrupted command's lines."""
    if seen.store_problem:
        return [seen.store_problem]
    problems = []
    last = [
        r.data["checkpoint"] for r in seen.sandbox_journal if r.type == "workspace.checkpointed"
    ]
    if last and last[-1] != seen.checkpoint:
        problems.append(
            f"the run's last result names checkpoint {str(seen.checkpoint)[:12]}, the sandbox's "
            f"last is {last[-1][:12]}"
        )
    if seen.files.get("step.py") != STEP_PY:
        problems.append(f"step.py in the last checkpoint: {seen.files.get('step.py')!r}")
    lines = seen.files.get(LOG, "").splitlines()
    interrupted = set()
    for call_id, name in COMMAND_CALLS.items():
        starts, ends = lines.count(f"{name} start"), lines.count(f"{name} end")
        how = reports.get(call_id)
        if seen.rerunnable:
            if not starts or not ends:
                problems.append(f"{name}: started {starts}, ended {ends} times; expected >= 1")
        elif starts > 1:
            problems.append(f"{name} ran {starts} times (at most once)")
        elif how == "interrupted":
            interrupted.add(name)
            if ends > starts:
                problems.append(f"{name}: ended {ends} times, started {starts}")
        elif (starts, ends) != (1, 1):
            problems.append(f"{name} told {how}, but started {starts} and ended {ends} times")
    kept = list(dict.fromkeys(lines)) if seen.rerunnable else lines
    mine = [line for line in kept if line.partition(" ")[0] not in interrupted]
    clean = [line for line in expected.log if line.partition(" ")[0] not in interrupted]
    if mine != clean:
        problems.append(f"{LOG} in the last checkpoint: {lines}, clean {list(expected.log)}")
    return problems
