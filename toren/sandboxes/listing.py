"""Reading sandboxes from outside a worker (the CLI, the HTTP API): the sandbox actors with
their runs, and the sandboxed calls of a run, from actor rows and journals. Nothing is folded,
nothing talks to Docker: a row's summary is what the sandbox's last step recorded.

A sandbox's ``status`` is its own (``new``, ``running``, ``stopped``, ``reaped``, or ``failed``
once the kernel gave up on it); a container may exist for every status but ``reaped``. The
orphan reaper of a worker with Docker removes a container without a step of its sandbox, so a
sandbox can show ``running`` or ``stopped`` for a while after its container is gone; a
``sandbox.reap`` sent to it then records the reap.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from datetime import datetime
from typing import Any

import asyncpg
import attrs

from toren._core.codec import encode
from toren._core.journal_reads import events
from toren._core.rows import ActorRow, actor_row, actor_rows, actors_of_kind, queued
from toren.runs.events import ENDED
from toren.sandboxes._vocabulary import SANDBOX_KIND, WORKSPACE, Reap, sandbox_address

_REAP, _ = encode(Reap())
_NOT_REAPED = {"status": "reaped"}
_OWN = ("summary", "args.run")
_RUNS = ("summary.agent", "args.agent")


@attrs.frozen(kw_only=True)
class SandboxRow:
    """One sandbox as lists show it, with its run."""

    id: str  # sandbox/<uuid>
    run: str  # run/<uuid>
    agent: str
    run_status: str | None  # None: the run's row is gone
    status: str  # new, running, stopped, reaped (failed: the kernel gave up on it)
    live: bool  # False: the kernel gave up on the actor (it takes no message)
    reap_queued: bool  # a sandbox.reap waits in its mailbox (for a worker with Docker)
    container_id: str | None
    name: str
    commands: int
    finished: int
    checkpoint: str | None
    checkpoints: int
    uploaded_bytes: int
    created_at: datetime

    @property
    def run_ended(self) -> bool:
        """Whether its run has ended (or is gone): the container has no more use."""
        return self.run_status is None or self.run_status in ENDED

    def to_json(self) -> dict[str, Any]:
        return {**attrs.asdict(self), "created_at": self.created_at.isoformat()}


async def _rows(pool: asyncpg.Pool, sandboxes: list[ActorRow]) -> list[SandboxRow]:
    """Each of ``sandboxes`` (their rows) with its run's: three queries (the sandboxes', their
    runs', their mailboxes'), for lists a person reads (the CLI), not a step's path."""
    run_of = {s.actor_id: _run_of(s) for s in sandboxes}
    runs = {r.actor_id: r for r in await actor_rows(pool, set(run_of.values()), fields=_RUNS)}
    reaps = await queued(pool, list(run_of), _REAP)
    return [_row(s, run_of[s.actor_id], runs, reaps) for s in sandboxes]


def _run_of(sandbox: ActorRow) -> str:
    """The run of ``sandbox``: its argument, or (a sandbox of an earlier version) its id's."""
    run = sandbox.args_dict.get("run")
    return str(run) if run is not None else "run/" + sandbox.actor_id[len("sandbox/") :]


def _agent(run: ActorRow | None) -> str:
    """The agent of ``run``: its summary's, or its arguments' ('' if gone)."""
    if run is None:
        return ""
    for found in (run.summary_dict.get("agent"), run.args_dict.get("agent")):
        if found is not None:
            return str(found)
    return ""


def _row(
    sandbox: ActorRow, run_id: str, runs: Mapping[str, ActorRow], reaps: set[str]
) -> SandboxRow:
    s = sandbox.summary_dict
    run = runs.get(run_id)
    return SandboxRow(
        id=sandbox.actor_id,
        run=run_id,
        agent=_agent(run),
        run_status=run.run_status if run is not None else None,
        status=str(s.get("status") or "new"),
        live=sandbox.status == "live",
        reap_queued=sandbox.actor_id in reaps,
        container_id=s.get("container_id"),
        name=str(s.get("name") or ""),
        commands=int(s.get("commands") or 0),
        finished=int(s.get("finished") or 0),
        checkpoint=s.get("checkpoint"),
        checkpoints=int(s.get("checkpoints") or 0),
        uploaded_bytes=int(s.get("uploaded_bytes") or 0),
        created_at=sandbox.created_at,
    )


async def list_sandboxes(
    pool: asyncpg.Pool, *, reaped: bool = False, limit: int = 200
) -> list[SandboxRow]:
    """Sandboxes, newest first: by default those whose container may exist (not reaped),
    with ``reaped`` all of them."""
    sandboxes = await actors_of_kind(
        pool,
        SANDBOX_KIND,
        fields=_OWN,
        summary_not=None if reaped else _NOT_REAPED,
        order="newest",
        limit=limit,
    )
    return await _rows(pool, sandboxes)


async def reapable(pool: asyncpg.Pool) -> list[SandboxRow]:
    """The sandboxes to reap: not reaped, their run ended (or gone), oldest first. Those the
    kernel gave up on are included (``live`` False): they take no message; the orphan reaper
    of a worker with Docker removes their containers."""
    sandboxes = await actors_of_kind(
        pool, SANDBOX_KIND, fields=_OWN, summary_not=_NOT_REAPED, order="oldest"
    )
    return [row for row in await _rows(pool, sandboxes) if row.run_ended]


async def sandbox_of(pool: asyncpg.Pool, run_id: str) -> SandboxRow | None:
    """Run ``run_id``'s sandbox, or None if it has none (yet)."""
    sandbox = await actor_row(pool, sandbox_address(run_id), kind=SANDBOX_KIND, fields=_OWN)
    return (await _rows(pool, [sandbox]))[0] if sandbox is not None else None


async def approval_cwds(pool: asyncpg.Pool, run_id: str, call_ids: Iterable[str]) -> dict[str, str]:
    """The working directory each of these calls of run ``run_id`` would run in, for those
    asked about as sandboxed commands (``approval.requested`` with a ``cwd``)."""
    wanted = list(call_ids)
    if not wanted:
        return {}
    asked = await events(
        pool,
        run_id,
        types=("approval.requested",),
        match={"call_id": wanted},
        present=("cwd",),
        keys=("call_id", "cwd"),
    )
    return {str(e.data["call_id"]): str(e.data["cwd"]) for e in asked}


# --- a run's sandboxed calls ----------------------------------------------------------------


@attrs.frozen(kw_only=True)
class SandboxedCall:
    """One tool call of a run that its sandbox ran, runs, or was asked about.

    ``state``: ``awaiting_approval``, ``denied``, ``not_run`` (its run ended before it was
    decided or sent), ``running`` (sent, no result yet),
    ``finished``, ``interrupted`` (its worker stopped while it ran: exit unknown), ``refused``
    (the sandbox could not run it), or ``error`` (an error result with nothing known from the
    sandbox, such as a sandbox the kernel gave up on). ``output`` is what the run recorded as
    the call's result, the command's header line taken off; ``truncated_from`` is set when the
    run cut it."""

    call_id: str
    tool: str
    command: str | None  # bash
    path: str | None  # the file tools
    cwd: str
    state: str
    exit_code: int | None = None
    seconds: float | None = None
    timed_out: bool = False
    oom_killed: bool = False
    is_error: bool = False
    output: str = ""
    truncated_from: int | None = None
    checkpoint: str | None = None

    @property
    def outcome(self) -> str:
        """How it ended, in a few words: ``exit 0``, ``killed at the time limit``, ..."""
        if self.timed_out:
            return "killed at the time limit"
        if self.oom_killed:
            return "killed: out of memory"
        if self.state == "finished" and self.exit_code is not None:
            return f"exit {self.exit_code}"
        if self.state == "finished":
            return "error" if self.is_error else "done"
        return self.state.replace("_", " ")

    def to_json(self) -> dict[str, Any]:
        return {**attrs.asdict(self), "outcome": self.outcome}


_RUN_TYPES = ["tool.intent", "tool.result", "approval.requested", "sandbox.requested"]

_SANDBOX_TYPES = ("command.intended", "command.finished")
# What a sandbox's journal says of each command is read without the content and arguments it
# also holds (a file written can be megabytes; the run's journal has what the model was told).
_SANDBOX_LARGE = ("content", "arguments")


async def read_calls(
    pool: asyncpg.Pool, run_id: str, *, ended: bool = False
) -> list[SandboxedCall]:
    """Run ``run_id``'s sandboxed calls, in the order they were asked for; ``ended``: the run
    has ended (a call it never sent was not run, rather than awaiting approval)."""
    run_events = await events(pool, run_id, types=_RUN_TYPES)
    sandbox_events = await events(
        pool, sandbox_address(run_id), types=_SANDBOX_TYPES, without=_SANDBOX_LARGE
    )
    return sandboxed_calls(
        [(e.type, e.data) for e in run_events],
        [(e.type, e.data) for e in sandbox_events],
        ended=ended,
    )


def sandboxed_calls(
    run_events: Iterable[tuple[str, Any]],
    sandbox_events: Iterable[tuple[str, Any]],
    *,
    ended: bool = False,
) -> list[SandboxedCall]:
    """The sandboxed calls told by a run's events (``tool.intent``, ``tool.result``,
    ``approval.requested``, ``sandbox.requested``) and its sandbox's (``command.intended``,
    ``command.finished``), each as ``(type, data)`` in journal order. A call is sandboxed if
    it was sent to the sandbox or asked about with a working directory."""
    asked: dict[str, dict[str, Any]] = {}
    intents: dict[str, dict[str, Any]] = {}
    results: dict[str, dict[str, Any]] = {}
    order: dict[str, str] = {}  # call id -> cwd, in the order first sandboxed
    sent: set[str] = set()
    for kind, data in run_events:
        if not isinstance(data, dict) or not isinstance(data.get("call_id"), str):
            continue
        call_id = data["call_id"]
        if kind == "approval.requested":
            asked[call_id] = data
            if isinstance(data.get("cwd"), str):
                order.setdefault(call_id, data["cwd"])
        elif kind == "tool.intent":
            intents[call_id] = data
        elif kind == "tool.result":
            results[call_id] = data
        elif kind == "sandbox.requested":
            order.setdefault(call_id, WORKSPACE)
            sent.add(call_id)
    finished: dict[str, dict[str, Any]] = {}
    for kind, data in sandbox_events:
        if isinstance(data, dict) and isinstance(data.get("call_id"), str):
            if kind == "command.intended":
                sent.add(data["call_id"])
            elif kind == "command.finished":
                finished.setdefault(data["call_id"], data)  # the first is the one that counts
    return [
        _call(
            call_id,
            cwd,
            intents.get(call_id) or asked.get(call_id) or {},
            results.get(call_id),
            finished.get(call_id),
            sent=call_id in sent,
            ended=ended,
        )
        for call_id, cwd in order.items()
    ]


_EXIT = re.compile(r"; exit (-?\d+)")


def _call(
    call_id: str,
    cwd: str,
    request: Mapping[str, Any],
    result: Mapping[str, Any] | None,
    finished: Mapping[str, Any] | None,
    *,
    sent: bool,
    ended: bool,
) -> SandboxedCall:
    tool = str(request.get("name") or "")
    raw = request.get("arguments")
    arguments: Mapping[str, Any] = raw if isinstance(raw, dict) else {}
    command = arguments.get("command") if tool == "bash" else None
    command = command if isinstance(command, str) else None
    path = arguments.get("path", "." if tool == "list_files" else None)
    path = path if isinstance(path, str) and tool != "bash" else None
    output, how = (str(result.get("content", "")), "") if result else ("", "")
    if command is not None and result:
        cwd, how, output = _header(command, output, cwd)
    if finished is not None:
        state = str(finished.get("state") or "finished")
    elif result is not None and result.get("denied"):
        state = "denied"
    elif result is not None:
        state = "error" if result.get("is_error") and not how else "finished"
    else:
        state = "running" if sent else "not_run" if ended else "awaiting_approval"
    facts: Mapping[str, Any] = finished or {}
    exit_code = facts.get("exit_code")
    if not isinstance(exit_code, int) and (found := _EXIT.search(f"; {how}")):
        exit_code = int(found.group(1))  # the sandbox's journal says nothing: its header does
    seconds = facts.get("seconds")
    truncated = result.get("truncated_from") if result else None
    return SandboxedCall(
        call_id=call_id,
        tool=tool,
        command=command,
        path=path,
        cwd=cwd,
        state=state,
        exit_code=exit_code if isinstance(exit_code, int) else None,
        seconds=float(seconds) if isinstance(seconds, int | float) and seconds > 0 else None,
        timed_out=bool(facts.get("timed_out")),
        oom_killed=bool(facts.get("oom_killed")),
        is_error=bool(result.get("is_error")) if result else bool(facts.get("is_error")),
        output=output,
        truncated_from=truncated if isinstance(truncated, int) else None,
        checkpoint=(result or {}).get("checkpoint") or facts.get("checkpoint"),
    )


def _header(command: str, content: str, cwd: str) -> tuple[str, str, str]:
    """``(cwd, how it ended, output)`` of a ``bash`` result, which the sandbox writes as
    ``$ <command>``, then ``[in <cwd>; <how it ended>]``, then the output. A result in another
    shape (the sandbox could not run it, a denial) is all output."""
    head = f"$ {command}\n[in "
    end = content.find("]", len(head)) if content.startswith(head) else -1
    if end < 0:
        return cwd, "", content
    where, _, ended = content[len(head) : end].partition("; ")
    return where or cwd, ended, content[end + 1 :].removeprefix("\n")
