"""Starting, steering and reading runs from outside: what the CLI, the HTTP API and the MCP
server call (each a row or two in Postgres; no worker involved)."""

from __future__ import annotations

import hashlib
import re
import uuid
from typing import TYPE_CHECKING

from toren._agent.principal import Principal
from toren._agent.routes import agent_route, route_version
from toren._core.codec import decode
from toren._core.errors import AskTimeout, InternalError, TorenError, UnknownActor
from toren._core.journal import replay
from toren._core.journal_reads import events
from toren._core.json_text import dumps, utf8_size
from toren._core.restarts import forget_restarts
from toren._core.rows import actor_row, revive, set_route
from toren.runs.audit import (
    AuditRecord,
    PrunedStart,
    audit_records,
    refuse_pruned,
    unknown_run,
)
from toren.runs.events import (
    ENDED,
    RUN_KIND,
    Cancel,
    Decide,
    DecisionOutcome,
    Retry,
    RunStarted,
    Say,
    StartRun,
)
from toren.runs.limits import QUEUED, impose_run, key_problem, queued
from toren.runs.state import SNAPSHOT_VERSION, RunState, fold

if TYPE_CHECKING:
    from toren._core.client import Client, Connection

_KEY_NAMESPACE = uuid.UUID("7c1f4f7e-3b0a-4f59-9a55-2f1c9b1d8e42")
"""Earlier versions derived a keyed run's id from the key alone, in this namespace: one key was
one run whatever the agent (see :func:`_keyed_run`)."""

_AGENT_KEY_NAMESPACE = uuid.UUID("3e9a1c52-7d48-4b0f-a6e3-5c2f8d17b940")
"""A keyed run's id is derived from its agent and the key, in this namespace."""

MESSAGE_CAP = 64 * 1024
"""Bytes (UTF-8) a human message or a run's input may hold by default; longer ones are refused,
never truncated (``max_message_bytes`` in the settings)."""

DECISION_WAIT = 5.0
"""Seconds :func:`decide` waits for the run's answer by default."""

REASON_CAP = 2000
"""Characters a decision's or a cancel's reason may hold (as over HTTP)."""

CALL_ID_CAP = 200
"""Characters a decision's call id may hold."""

AGENT_NAME = re.compile(r"[A-Za-z0-9_.-]{1,100}")
"""What an agent's name may be (it is part of the route workers claim by)."""


class InvalidStart(TorenError):
    """A run cannot be started with these values (``field`` names which); nothing was
    created."""

    def __init__(self, field: str, detail: str) -> None:
        self.field = field
        self.detail = detail
        super().__init__(f"{field}: {detail}")


class AgentNotServed(TorenError):
    """No live worker runs the agent (while some worker is live)."""

    def __init__(self, agent: str, served: set[str]) -> None:
        self.agent = agent
        self.served = served
        they = ", ".join(sorted(served)) or "no agents"
        super().__init__(f"no live worker runs an agent named {agent!r} (they run: {they})")


async def check_served(client: Client, agent: str) -> bool:
    """Refuse an agent no live worker runs; a run for it would wait for a worker that never
    comes. With no live worker at all the run may wait for one: returns False then.

    Raises:
        AgentNotServed: workers are live and none runs ``agent``.
    """
    from toren._core.workers import served_agents

    served = await served_agents(client.pool)
    if served is None:
        return False
    if agent not in served:
        raise AgentNotServed(agent, served)
    return True


def check_start(agent: str, input: str, idempotency_key: str | None, cap: int) -> None:
    """What every surface checks before starting a run.

    Raises:
        InvalidStart: a malformed agent name, an empty input, a malformed idempotency key.
        MessageTooLarge: ``input`` is over ``cap`` bytes.
    """
    if not isinstance(agent, str) or not AGENT_NAME.fullmatch(agent):
        raise InvalidStart("agent", "an agent name: 1 to 100 letters, digits, _ . -")
    if not isinstance(input, str) or not input:
        raise InvalidStart("input", "a non-empty text")
    if idempotency_key is not None and (
        not isinstance(idempotency_key, str)
        or not 1 <= len(idempotency_key) <= 200
        or "\x00" in idempotency_key
    ):
        raise InvalidStart("idempotency_key", "1 to 200 characters, no NUL")
    check_message(input, cap, "input")


class IdempotencyConflict(TorenError):
    """A run was started with a key that an earlier run of the same agent with another input
    used (keys are per agent: ``run_id`` is always a run of the agent being started)."""

    def __init__(self, key: str, run_id: str) -> None:
        self.key = key
        self.run_id = run_id
        super().__init__(
            f"idempotency key {key!r} already started {run_id} with a different input; "
            "use a new key for a new run"
        )


class RunNotInState(TorenError):
    """A cancel or a retry for a run in a state where it does nothing (a cancel of an ended
    run, a retry of one that has not failed); nothing was sent."""

    def __init__(self, run_id: str, detail: str) -> None:
        self.run_id = run_id
        self.detail = detail
        super().__init__(f"{run_id} {detail}")


def _caller(by: Principal | None) -> Principal:
    """``by``, or this process's OS user when a Python program calls without saying."""
    return by if by is not None else Principal.os_user("python")


class MessageTooLarge(TorenError):
    """A human message (or a run's input, or a decision's reason) is over its cap; nothing was
    sent."""

    def __init__(self, size: int, cap: int, what: str = "message", unit: str = "bytes") -> None:
        self.size = size
        self.cap = cap
        hint = "; send it in parts, or raise max_message_bytes" if unit == "bytes" else ""
        super().__init__(f"the {what} is {size} {unit}, over the cap of {cap} {unit}{hint}")


def check_message(text: str, cap: int = MESSAGE_CAP, what: str = "message") -> None:
    """Refuse ``text`` if it is over ``cap`` bytes in UTF-8.

    Raises:
        MessageTooLarge: it is.
    """
    size = utf8_size(text)
    if size > cap:
        raise MessageTooLarge(size, cap, what)


async def start_run(
    client: Client,
    agent: str,
    input: str,
    *,
    idempotency_key: str | None = None,
    cap: int = MESSAGE_CAP,
    by: Principal | None = None,
    concurrency_key: str | None = None,
) -> str:
    """Start a run of ``agent`` on ``input``; returns its id (``run/<uuid>``).

    The run takes a slot of its agent's ``max_runs`` and, with a ``concurrency_key``, of that
    key's ``max_runs_per_key`` (see :mod:`toren.runs.limits`); over a cap it waits, ``queued``,
    behind the runs started before it. The key is recorded in the run's args.

    With an ``idempotency_key``, starting ``agent`` again with the same key and input returns
    the same run; the same key with another input raises :class:`IdempotencyConflict`, also
    when the two starts race (the run and its start message are created in one transaction, and
    the run's row records a digest of what it was started with). Keys are per agent: the same
    key for another agent starts that agent's own run, and a conflict never names a run of
    another agent. A run an earlier version started under the key (see :func:`_keyed_run`) is
    found again. ``by`` is recorded on ``run.started`` (this process's OS user if not given).

    Raises:
        InvalidStart: see :func:`check_start`.
        MessageTooLarge: ``input`` is over ``cap`` bytes.
        IdempotencyConflict: as above.
    """

    check_start(agent, input, idempotency_key, cap)
    if concurrency_key is not None and (problem := key_problem(concurrency_key)) is not None:
        raise InvalidStart("concurrency_key", problem)
    started = _start_digest(agent, input)
    extra = {} if concurrency_key is None else {"concurrency_key": concurrency_key}
    try:
        async with client.pool.acquire() as conn, conn.transaction():
            if idempotency_key is None:
                run_id = f"run/{uuid.uuid4()}"
                args = {"agent": agent, "start": started, **extra}
                await client.spawn(RUN_KIND, run_id, args, route=agent_route(agent), conn=conn)
                created = True
            else:
                run_id, created = await _keyed_run(
                    client, conn, agent, input, idempotency_key, extra
                )
            await client.send(
                run_id,
                StartRun(agent=agent, input=input, by=_caller(by)),
                dedupe_key="start",
                conn=conn,
            )
            if created:  # after its start message: a run that waits has it hidden with it
                await impose_run(conn, run_id, agent, concurrency_key)
    except PrunedStart as pruned:  # the key's run was pruned: it is the answer, as before
        return _pruned_answer(pruned.record, str(idempotency_key), started, concurrency_key)
    except UnknownActor:
        if idempotency_key is None:
            raise
        # The key's run was found (a spawn's conflicting insert locks nothing), then pruned
        # before its start message was sent: its audit record is the answer.
        ids = (keyed_run_id(agent, idempotency_key), _old_keyed_id(idempotency_key))
        found = await audit_records(client.pool, ids)
        record = next((r for r in found.values() if r.agent == agent), None)
        if record is None:
            raise
        return _pruned_answer(record, idempotency_key, started, concurrency_key)
    return run_id


def _pruned_answer(record: AuditRecord, key: str, started: str, concurrency_key: str | None) -> str:
    """A keyed start's answer when the key's run was pruned: the run, if it was started with
    the same input and concurrency key.

    Raises:
        IdempotencyConflict: it was not.
    """
    kept = record.args
    if (kept.get("start", started), kept.get("concurrency_key")) != (started, concurrency_key):
        raise IdempotencyConflict(key, record.run_id) from None
    return record.run_id


def _old_keyed_id(key: str) -> str:
    """The id a version before per-agent keys gave the run of ``key`` (see :func:`_keyed_run`)."""
    return f"run/{uuid.uuid5(_KEY_NAMESPACE, key)}"


async def _keyed_run(
    client: Client,
    conn: Connection,
    agent: str,
    input: str,
    key: str,
    extra: dict[str, str],
) -> tuple[str, bool]:
    """The run of ``agent`` under ``key``, created now if there is none (in ``conn``'s
    transaction), and whether it was created now (with ``extra`` in its args).

    Its id is derived from the agent and the key. A run that a version before per-agent keys
    started under the key has the key's old id (from the key alone): if it is a run of
    ``agent``, it is this run (a start retried across the upgrade must not start a second); a
    run of another agent there is not this agent's business and is neither used nor named. A
    start of that old id by an older server, in its transaction still, is waited for (see
    :meth:`~toren.Client.spawned`), so a start retried here while the first is in flight there
    finds it. (A start on an older server after this one started the run cannot be seen from
    here: it does not look for per-agent ids. Finish the rollout before retrying across it.)

    Raises:
        IdempotencyConflict: the run was started with another input, or another concurrency
            key (or none where this start names one, or the other way round).
    """

    started = _start_digest(agent, input)
    old_id = _old_keyed_id(key)
    old = await client.spawned(old_id, conn=conn)
    if old is not None and old["kind"] == RUN_KIND and (old["args"] or {}).get("agent") == agent:
        run_id, args = old_id, old["args"]
    else:
        run_id = keyed_run_id(agent, key)
        args = {"agent": agent, "start": started, **extra}
        if await client.spawn(RUN_KIND, run_id, args, route=agent_route(agent), conn=conn):
            await refuse_pruned(conn, (run_id, old_id), agent)  # rolled back if it was
            return run_id, True
        found = await actor_row(conn, run_id, fields=("args",))
        args = found.args if found is not None else None
    if (args or {}).get("start", started) != started:
        raise IdempotencyConflict(key, run_id)
    if (args or {}).get("concurrency_key") != extra.get("concurrency_key"):
        # Its run goes on under the key it was started with: another key (or none) is another
        # start, refused rather than silently ignored.
        raise IdempotencyConflict(key, run_id)
    if "start" not in (args or {}):  # a run started by an earlier version
        existing = await _started(conn, run_id)
        if existing is not None and (existing.agent, existing.input) != (agent, input):
            raise IdempotencyConflict(key, run_id)
    return run_id, False


def keyed_run_id(agent: str, key: str) -> str:
    """The id of the run of ``agent`` started with idempotency key ``key``."""
    # Neither an agent name nor a key holds NUL: no two (agent, key) pairs join the same.
    return f"run/{uuid.uuid5(_AGENT_KEY_NAMESPACE, chr(0).join((agent, key)))}"


def start_args(agent: str, input: str) -> dict[str, str]:
    """The args of a run of ``agent`` started on ``input`` (the digest a start retried with its
    key is checked against)."""
    return {"agent": agent, "start": _start_digest(agent, input)}


def _start_digest(agent: str, input: str) -> str:
    return hashlib.sha256(dumps([agent, input]).encode()).hexdigest()


async def _started(conn: Connection, run_id: str) -> RunStarted | None:
    found = await events(conn, run_id, types=("run.started",), limit=1)
    return decode("run.started", found[0].data) if found else None


async def decide(
    client: Client,
    run_id: str,
    *,
    call_id: str,
    approved: bool,
    by: Principal | None = None,
    reason: str = "",
    wait: float | None = DECISION_WAIT,
) -> DecisionOutcome | None:
    """Approve or deny tool call ``call_id`` of a run (recorded with who, ``by``, and why), and
    wait up to ``wait`` seconds for what the run did with it.

    Returns:
        The run's answer; ``None`` if it gave none in time (no worker took the run: the
        decision stays queued and is applied only if its call still waits when it is handled),
        or if ``wait`` is ``None`` (sent without waiting).

    Raises:
        MessageTooLarge: the reason is over 2,000 characters or the call id over 200.
        UnknownActor, ActorNotLive: no such run, or one no worker will run again.
        AskError: the run could not handle the decision.
    """
    if len(reason) > REASON_CAP:
        raise MessageTooLarge(len(reason), REASON_CAP, "reason", "characters")
    if len(call_id) > CALL_ID_CAP:
        raise MessageTooLarge(len(call_id), CALL_ID_CAP, "call id", "characters")
    by = _caller(by)
    msg = Decide(call_id=call_id, approved=approved, by=by, who=by.name, reason=reason)
    try:
        if wait is None:
            await client.send(run_id, msg, system=True)
            return None
        answer = await client.ask(run_id, msg, timeout=wait, system=True)
    except AskTimeout:
        return None
    except UnknownActor:
        raise await unknown_run(client.pool, run_id) from None
    if not isinstance(answer, DecisionOutcome):
        raise InternalError(f"{run_id} answered a decision with {answer!r}")
    return answer


async def read_run(client: Client, run_id: str) -> RunState:
    """The run's state, read here (no worker involved): its latest snapshot and the events
    recorded since, folded.

    Raises:
        UnknownActor: no such run.
    """
    try:
        row = await client.actor(run_id)
    except UnknownActor:
        raise await unknown_run(client.pool, run_id) from None
    if row["kind"] != RUN_KIND:
        raise UnknownActor(run_id)
    rebuilt = await replay(
        client.pool,
        run_id,
        RunState(),
        fold,
        snapshots=(RunState, SNAPSHOT_VERSION),
        archives=client.archives,
    )
    state: RunState = rebuilt.state
    return state


async def say(
    client: Client,
    run_id: str,
    text: str,
    *,
    by: Principal | None = None,
    cap: int = MESSAGE_CAP,
) -> None:
    """A human message to the run (applied at the next step boundary; to a completed run, it
    continues the conversation).

    Raises:
        MessageTooLarge: ``text`` is over ``cap`` bytes (never truncated).
        UnknownActor: no such run.
        RunNotInState: the run has failed (retry it first: a failed run takes no messages) or
            was cancelled (it takes none again).
    """
    check_message(text, cap)
    status, _ = await _status(client, run_id)
    if status == "failed":
        raise RunNotInState(run_id, "has failed and takes no messages; retry it first")
    if status == "cancelled":
        raise RunNotInState(run_id, "was cancelled and takes no messages; start a new run")
    if status == "completed":
        await _not_an_ended_child(client, run_id, "message")
    by = _caller(by)
    try:  # (a run pruned since its status was read: the send waited for the prune)
        await client.send(run_id, Say(text=text, by=by, who=by.name), system=True)
    except UnknownActor:
        raise await unknown_run(client.pool, run_id) from None


async def run_agent(client: Client, run_id: str) -> str:
    """The agent a run was started for (known before a worker has started the run).

    Raises:
        UnknownActor: no such run.
    """
    row = await actor_row(client.pool, run_id, kind=RUN_KIND, fields=("args.agent",))
    if row is None:
        raise await unknown_run(client.pool, run_id)
    return str(row.args_dict.get("agent") or "")


async def run_status(client: Client, run_id: str) -> str:
    """The run's status as its last step recorded it (from its row: nothing is folded).

    Raises:
        UnknownActor: no such run.
    """
    status, _ = await _status(client, run_id)
    if status not in ENDED and (await queued(client, [run_id])):
        return QUEUED  # over a concurrency limit: it waits for a slot
    return status or "running"


async def _not_an_ended_child(client: Client, run_id: str, what: str) -> None:
    """Refuse to revive a child run that has ended: its end went to its parent, which took it
    (as the call's result); it would act and spend where no receipt counts it.

    Raises:
        RunNotInState: the run is such a child.
    """
    row = await actor_row(client.pool, run_id, kind=RUN_KIND, fields=("args.parent",))
    parent = row.args_dict.get("parent") if row is not None else None
    if parent:
        raise RunNotInState(
            run_id,
            f"is a child run of {parent} and has ended; its end went to that run: {what} it "
            "instead (a retried parent starts a new child for a call whose child failed)",
        )


async def _status(client: Client, run_id: str) -> tuple[str | None, str | None]:
    """The run's status and error class as its last step recorded them.

    Raises:
        UnknownActor: no such run.
    """
    row = await actor_row(
        client.pool, run_id, kind=RUN_KIND, fields=("summary.status", "summary.error_class")
    )
    if row is None:
        raise await unknown_run(client.pool, run_id)
    return _text(row.summary_dict.get("status")), _text(row.summary_dict.get("error_class"))


def _text(value: object) -> str | None:
    """A summary's value as ``->>`` reads it: text, ``None`` for JSON null or a missing key."""
    if value is None:
        return None
    return value if isinstance(value, str) else dumps(value)


async def cancel(
    client: Client, run_id: str, *, by: Principal | None = None, reason: str = ""
) -> None:
    """Cancel the run: it ends with status ``cancelled`` at its next step boundary (its
    ``run.failed`` records class ``cancelled``).

    Raises:
        UnknownActor: no such run.
        RunNotInState: the run has already ended (completed, failed or cancelled).
        MessageTooLarge: the reason is over 2,000 characters.
    """
    if len(reason) > REASON_CAP:
        raise MessageTooLarge(len(reason), REASON_CAP, "reason", "characters")
    status, _ = await _status(client, run_id)
    if status in ENDED:
        done = "been cancelled" if status == "cancelled" else status
        raise RunNotInState(run_id, f"has already {done}; there is nothing to cancel")
    by = _caller(by)
    cancel_ = Cancel(by=by, who=by.name, reason=reason)
    row = await actor_row(client.pool, run_id, fields=("args.agent",))
    agent = str(row.args_dict.get("agent") or "") if row is not None else ""
    try:  # (a run that ended and was pruned since its status was read)
        if agent and row is not None and row.route and route_version(row.route)[1]:
            # Pinned to a version: were no live worker to serve it (the run parked), only a
            # worker of that version would take the cancel. Off its version, any worker running
            # the agent takes it and ends the run there (a worker holding the run now keeps it
            # to do so).
            async with client.pool.acquire() as conn, conn.transaction():
                await set_route(conn, run_id, agent_route(agent))
                await client.send(run_id, cancel_, system=True, conn=conn)
            return
        await client.send(run_id, cancel_, system=True)
    except UnknownActor:
        raise await unknown_run(client.pool, run_id) from None


async def retry(
    client: Client, run_id: str, *, by: Principal | None = None, upgrade: bool = False
) -> None:
    """Resume a failed run from its last good step (completed calls are not paid again).

    A run the kernel gave up on (class ``crashloop``) is made runnable again first, with a
    fresh restart window; if its cause is not fixed it will fail the same way. With
    ``upgrade``, a run not on its agent's newest version is moved to it first (as
    :func:`toren.runs.upgrade_run` moves a live run), in the same transaction: for a fix that
    exists only in the new version.

    Raises:
        UnknownActor: no such run.
        RunNotInState: the run has not failed, or was cancelled (a cancelled run stays so).
        VersionNotServed: with ``upgrade``, no live worker runs the run's agent.
    """
    status, error_class = await _status(client, run_id)
    # (A row that says failed with class cancelled: written by a worker of an earlier version.)
    if status == "cancelled" or error_class == "cancelled":
        raise RunNotInState(
            run_id, "was cancelled; a cancelled run is not retried (start a new run instead)"
        )
    if status != "failed":
        raise RunNotInState(run_id, f"is {status or 'not started'}; only a failed run is retried")
    await _not_an_ended_child(client, run_id, "retry")
    by = _caller(by)
    moving = None
    if upgrade:
        from toren.runs.version_moves import move, retry_target

        moving = await retry_target(client, run_id)
    try:  # (a run pruned since its status was read: the send waited for the prune)
        async with client.pool.acquire() as conn, conn.transaction():
            await revive(conn, run_id, kind=RUN_KIND)
            await forget_restarts(conn, f"actors/{run_id}")
            if moving is not None:  # its Upgrade is handled before the Retry (both system mail)
                await move(client, conn, run_id, *moving, by)
            await client.send(run_id, Retry(by=by, who=by.name), system=True, conn=conn)
    except UnknownActor:
        raise await unknown_run(client.pool, run_id) from None
