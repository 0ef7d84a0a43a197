"""The run endpoints: start, list, read, events (JSON and a live stream), steer (message,
cancel, retry), approve."""

from __future__ import annotations

import base64
import binascii
import re
import uuid
from collections.abc import Awaitable
from datetime import UTC, datetime
from typing import Any, Literal, TypeVar

import asyncpg
from aiohttp import web

from toren._core.client import AskError
from toren._core.errors import ActorNotLive, UnknownActor
from toren._core.journal import JournalEntry, read_journal
from toren._core.rows import actor_row, actor_rows
from toren._surfaces.http import streams
from toren._surfaces.http.common import (
    CLIENT,
    OPTIONS,
    ROUTE_ACCESS,
    ProblemError,
    access,
    json,
    principal,
    read_body,
    require,
    run_id,
)
from toren._surfaces.http.models import (
    AGENT_NAME,
    Accepted,
    ApprovalBody,
    CancelBody,
    ChildRun,
    Decision,
    Event,
    EventList,
    FieldError,
    ForkedFrom,
    MessageBody,
    PendingApproval,
    Queued,
    Receipt,
    RetryBody,
    Run,
    RunList,
    RunSummary,
    ScheduledBy,
    StartRunBody,
)
from toren._surfaces.http.openapi import API_PARTS, run_part
from toren._surfaces.http.retention import pruned_problem, pruned_run
from toren._surfaces.http.states import SERVED, STATES, RunStates, ServedRoutes
from toren.runs import (
    DECISION_WAIT,
    ENDED,
    RUN_KIND,
    STATUSES,
    AgentNotServed,
    AmbiguousDecision,
    IdempotencyConflict,
    InvalidStart,
    MessageTooLarge,
    RunNotInState,
    RunState,
    ToolCall,
    VersionNotServed,
    cancel,
    check_message,
    check_served,
    decide,
    decision_target,
    receipt,
    retry,
    run_agent,
    say,
    start_run,
    waiting_below,
    waiting_on,
)
from toren.runs.audit import RunPruned, unknown_run
from toren.runs.forked import forked_from
from toren.runs.limits import QUEUED, queued
from toren.runs.listing import list_runs
from toren.runs.version_listing import SAY, parked_on, parked_reason, pinned_version
from toren.sandboxes.listing import approval_cwds

T = TypeVar("T")

PAGE_MAX = 200


def install(app: web.Application) -> None:
    """The run kind's routes; deciding asks for the ``approve`` scope, and starting, sending
    and cancelling for ``operate`` (as every other write)."""
    app[STATES] = RunStates(archives=app[CLIENT].archives)
    app[SERVED] = ServedRoutes()
    app[API_PARTS].append(run_part())
    app[ROUTE_ACCESS].ask(
        {
            ("POST", "/runs"): "operate",
            ("POST", "/runs/{run}/messages"): "operate",
            ("POST", "/runs/{run}/cancel"): "operate",
            ("POST", "/runs/{run}/approvals"): "approve",
        }
    )
    streams.install(app)
    app.router.add_post("/runs", start)
    app.router.add_get("/runs", listing)
    app.router.add_get("/runs/{run}", show)
    app.router.add_get("/runs/{run}/events", events)
    app.router.add_post("/runs/{run}/messages", message)
    app.router.add_post("/runs/{run}/approvals", approval)
    app.router.add_post("/runs/{run}/cancel", cancel_run)
    app.router.add_post("/runs/{run}/retry", retry_run)


async def start(request: web.Request) -> web.Response:
    body = await read_body(request, StartRunBody)
    require(request, "operate", body.agent)
    _check_size(request, body.input, "input")
    client = request.app[CLIENT]
    # With no worker up yet (or none that has said what it runs), the run waits for one.
    try:
        await check_served(client, body.agent)
        rid = await start_run(
            client,
            body.agent,
            body.input,
            idempotency_key=body.idempotency_key,
            cap=request.app[OPTIONS].message_cap,
            by=principal(request),
            concurrency_key=body.concurrency_key,
        )
    except AgentNotServed as exc:
        raise ProblemError(
            422,
            "Unknown agent",
            f"no live worker runs an agent named {body.agent!r}",
            [FieldError(field="agent", message="no live worker runs this agent")],
        ) from exc
    except InvalidStart as exc:
        error = FieldError(field=exc.field, message=exc.detail)
        raise ProblemError(422, "Invalid request", str(exc), [error]) from exc
    except IdempotencyConflict as exc:
        raise ProblemError(409, "Conflict", str(exc)) from exc
    try:
        if not access(request).allows("read"):
            # A caller that may not read gets back what it sent, not the run (a repeated key
            # would otherwise show it the run's output and what it waits for).
            created = await _created(client.pool, rid)
            return json(_as_sent(rid, body, created), status=201)
        run = await _run(request.app, rid)
    except ProblemError as exc:
        # A start retried with the key of a run pruned since: that run, from its audit record.
        pruned = await pruned_run(client.pool, rid) if exc.problem.status == 404 else None
        if pruned is None:
            raise
        if not access(request).allows("read"):
            return json(_as_sent(rid, body, datetime.fromisoformat(pruned.created_at)), 201)
        return json(pruned, status=201)
    if not run.agent:  # not started by a worker yet: its start message is queued
        run.agent, run.input = body.agent, body.input
    return json(run, status=201)


def _as_sent(rid: str, body: StartRunBody, created: datetime) -> Run:
    """The run as its starter knows it: id, agent, input; nothing it has done."""
    nothing = Receipt(
        calls_made=0,
        calls_replayed=0,
        input_tokens=0,
        output_tokens=0,
        usd_paid="0",
        usd_not_repaid="0",
        unpriced_calls=0,
    )
    return Run(
        id=rid,
        agent=body.agent,
        status="running",
        input=body.input,
        output=None,
        error_class=None,
        error=None,
        created_at=created.isoformat(),
        waiting_on=[],
        receipt=nothing,
    )


async def listing(request: web.Request) -> web.Response:
    q = request.query
    status, agent = q.get("status"), q.get("agent")
    errors = []
    if status is not None and status not in STATUSES:
        errors.append(FieldError(field="status", message=f"one of {', '.join(STATUSES)}"))
    limit = _int(q.get("limit", "50"))
    if limit is None or not 1 <= limit <= PAGE_MAX:
        errors.append(FieldError(field="limit", message=f"an integer from 1 to {PAGE_MAX}"))
        limit = 0
    if agent is not None and (len(agent) > 100 or not re.fullmatch(AGENT_NAME, agent)):
        errors.append(FieldError(field="agent", message="an agent name: letters, digits, _ . -"))
    after = _cursor(q.get("cursor") or None, errors)
    if errors:
        raise ProblemError(422, "Invalid request", "invalid query parameters", errors)
    found = await list_runs(
        request.app[CLIENT], status=status, agent=agent, limit=limit + 1, before=after
    )
    page = [RunSummary(**row.to_json()) for row in found[:limit]]
    cursor = None
    if len(found) > limit:
        last = found[limit - 1]
        cursor = base64.urlsafe_b64encode(
            f"{last.created_at.isoformat()}|{last.id}".encode()
        ).decode()
    return json(RunList(runs=page, next_cursor=cursor))


def _cursor(raw: str | None, errors: list[FieldError]) -> tuple[datetime, str] | None:
    """The position a ``cursor`` this API gave out names: a run's creation time and id."""
    if raw is None:
        return None
    try:
        at, _, actor_id = base64.urlsafe_b64decode(raw.encode()).decode().partition("|")
        when = datetime.fromisoformat(at)
        uuid.UUID(actor_id.removeprefix("run/"))
        when.astimezone(UTC)  # out of range near year 1 or 9999 in some zones
    except (ValueError, OverflowError, binascii.Error, UnicodeDecodeError):
        when, actor_id = None, ""
    if when is None or when.tzinfo is None or not actor_id.startswith("run/"):
        errors.append(FieldError(field="cursor", message="not a cursor this API gave out"))
        return None
    return when, actor_id


async def show(request: web.Request) -> web.Response:
    rid = run_id(request)
    try:
        return json(await _run(request.app, rid))
    except ProblemError as exc:  # a pruned run is shown from its audit record
        gone = exc.problem.status == 404
        pruned = await pruned_run(request.app[CLIENT].pool, rid) if gone else None
        if pruned is None:
            raise
        return json(pruned)


async def _created(pool: asyncpg.Pool, rid: str) -> datetime:
    """When run ``rid`` was created.

    Raises:
        ProblemError: 404, no such run.
    """
    row = await actor_row(pool, rid, kind=RUN_KIND)
    if row is None:
        raise ProblemError(404, "Not found", f"no run {rid}")
    return row.created_at


async def _writable(request: web.Request, rid: str, scope: str) -> None:
    """404 if there is no run ``rid``; 403 if the caller may not act on its agent's runs."""
    try:
        agent = await run_agent(request.app[CLIENT], rid)
    except RunPruned as exc:
        raise pruned_problem(exc) from exc
    except UnknownActor as exc:
        raise ProblemError(404, "Not found", f"no run {rid}") from exc
    require(request, scope, agent)


async def _state(app: web.Application, rid: str) -> tuple[RunState, datetime]:
    """Run ``rid``'s state and creation time (404 if there is no such run)."""
    return await app[STATES].read(app[CLIENT].pool, rid)


async def _run(app: web.Application, rid: str) -> Run:
    state, row = await app[STATES].read_row(
        app[CLIENT].pool, rid, ("args.concurrency_key", "args.schedule", "args.slot"), mail_kind=SAY
    )
    created = row.created_at
    r = receipt(state)
    client = app[CLIENT]
    waiting = await _pending(client.pool, rid, state.agent, waiting_on(state))
    # A run with no child running has nothing below it that waits (its row's list of children
    # is the same list, written with its last event): no query.
    below = await waiting_below(client, rid) if state.children_running else []
    for below_rid, agent, _ in below:
        # A call a child run waits on is decided from here too (it goes to the child).
        child, _ = await _state(app, below_rid)
        waiting.extend(await _pending(client.pool, below_rid, agent, waiting_on(child)))
    statuses = await _statuses(client.pool, [c.run_id for c in state.children.values()])
    by = row.args_dict
    scheduled = (
        ScheduledBy(name=by["schedule"], slot=by["slot"])
        if isinstance(by.get("schedule"), str) and isinstance(by.get("slot"), str)
        else None
    )
    key = row.args_dict.get("concurrency_key")
    # Only a run that has not ended may wait for a slot: an ended one costs no query here.
    wait = (await queued(client, [rid])).get(rid) if state.status not in ENDED else None
    # Pinned to a version no live worker serves: parked until one does, or it is upgraded;
    # so is a completed conversation pinned so with a message waiting (read with its events).
    check = wait is None and (state.status not in ENDED or state.status == "completed")
    pinned = check and pinned_version(row.route)[1] is not None
    served = await app[SERVED].read(client.pool) if pinned else None
    stuck = parked_on(
        row.route, served, ended=state.status in ENDED, say_waiting=bool(row.mail_waiting)
    )
    status = QUEUED if wait is not None else "parked" if stuck is not None else state.status
    origin = forked_from(state)
    return Run(
        id=rid,
        agent=state.agent,
        status=status,
        input=state.input,
        output=state.output,
        error_class=state.error_class,
        error=state.error,
        created_at=created.isoformat(),
        waiting_on=waiting,
        receipt=Receipt(
            calls_made=r.calls_made,
            calls_replayed=r.calls_replayed,
            input_tokens=r.input_tokens,
            output_tokens=r.output_tokens,
            usd_paid=str(r.usd_paid),
            usd_not_repaid=str(r.usd_not_repaid),
            unpriced_calls=r.unpriced_calls,
            child_runs=r.child_runs,
            child_calls_made=r.child_calls_made,
            child_usd_paid=str(r.child_usd_paid),
            usd_total=str(r.usd_total),
            compactions_soft=r.compactions_soft,
            compactions_hard=r.compactions_hard,
            tokens_saved=r.tokens_saved,
            calls_lost=r.calls_lost,
            usd_lost_estimated=str(r.usd_lost_estimated),
            child_calls_lost=r.child_calls_lost,
            child_usd_lost_estimated=str(r.child_usd_lost_estimated),
            calls_inherited=r.calls_inherited,
            usd_inherited=str(r.usd_inherited),
        ),
        parent=state.parent or None,
        children=[
            ChildRun(
                run=c.run_id,
                agent=c.agent,
                call_id=call_id,
                status=statuses.get(c.run_id, "running"),
                usd_paid=state.finished[c.run_id].usd_paid if c.run_id in state.finished else None,
            )
            for call_id, c in state.children.items()
        ],
        schedule=scheduled,
        concurrency_key=key if isinstance(key, str) else None,
        queued=None
        if wait is None
        else Queued(limit=wait.limit, position=wait.position, cap=wait.cap),
        version=pinned_version(row.route)[1],
        waiting_for=parked_reason(stuck) if stuck is not None else None,
        forked_from=ForkedFrom(**origin.to_json()) if origin is not None else None,
    )


async def _pending(
    pool: asyncpg.Pool, rid: str, agent: str, calls: list[ToolCall]
) -> list[PendingApproval]:
    """The calls of run ``rid`` that wait for a decision, a sandboxed command's with the
    directory it would run in."""
    cwds = await approval_cwds(pool, rid, [c.id for c in calls])
    return [
        PendingApproval(
            call_id=c.id,
            tool=c.name,
            arguments=c.arguments or {},
            run=rid,
            agent=agent,
            cwd=cwds.get(c.id),
        )
        for c in calls
    ]


async def _statuses(pool: asyncpg.Pool, run_ids: list[str]) -> dict[str, Any]:
    """The status of each run named, from its row."""
    if not run_ids:
        return {}
    return {r.actor_id: r.run_status for r in await actor_rows(pool, run_ids)}


def _event(entry: JournalEntry) -> Event:
    data = entry.data if isinstance(entry.data, dict) else {"value": entry.data}
    at = entry.at.isoformat() if entry.at is not None else ""
    return Event(seq=entry.seq, type=entry.type, data=data, at=at)


def _after(request: web.Request) -> int:
    raw = request.headers.get("Last-Event-ID") or request.query.get("after") or "0"
    after = _int(raw)
    if after is None or not 0 <= after < 2**63:
        raise ProblemError(
            422,
            "Invalid request",
            f"after / Last-Event-ID must be a sequence number, not {raw!r}",
            [FieldError(field="after", message="a non-negative integer")],
        )
    return after


def _int(raw: str) -> int | None:
    try:
        return int(raw)
    except ValueError:
        return None


async def events(request: web.Request) -> web.StreamResponse:
    """The run's events after ``after`` (or ``Last-Event-ID``) as JSON, or, when the client
    accepts ``text/event-stream``, as a live stream: every event, in order, each with its
    sequence number as the event id, so a reconnecting client resumes without gaps or repeats
    (see :mod:`toren._surfaces.http.streams` for how a stream is bounded)."""
    pool = request.app[CLIENT].pool
    rid = run_id(request)
    await _created(pool, rid)
    after = _after(request)
    if "text/event-stream" not in request.headers.get("Accept", ""):
        rows = await read_journal(pool, rid, after=after, limit=1000)
        return json(EventList(events=[_event(r) for r in rows]))

    async def page(after: int) -> list[Event]:
        return [_event(r) for r in await read_journal(pool, rid, after=after, limit=streams.BATCH)]

    return await streams.stream(request, rid, after, page)


def _check_size(request: web.Request, text: str, field: str) -> None:
    """Refuse a message or input over the cap: 413, naming the cap (nothing is sent)."""
    try:
        check_message(text, request.app[OPTIONS].message_cap, field)
    except MessageTooLarge as exc:
        raise ProblemError(
            413, "Too large", str(exc), [FieldError(field=field, message=str(exc))]
        ) from exc


async def message(request: web.Request) -> web.Response:
    rid = run_id(request)
    body = await read_body(request, MessageBody)
    _check_size(request, body.text, "text")
    client = request.app[CLIENT]
    await _writable(request, rid, "operate")
    cap = request.app[OPTIONS].message_cap
    await _send(say(client, rid, body.text, by=principal(request), cap=cap))
    return json(Accepted(run=rid), status=202)


async def approval(request: web.Request) -> web.Response:
    """Decide one waiting call, and answer with what the run did with the decision: 200 once
    applied (or for a repeat of the decision already made), 409 if the call does not wait or
    was decided the other way, 202 if no worker answered within the bound."""
    rid = run_id(request)
    body = await read_body(request, ApprovalBody)
    client = request.app[CLIENT]
    try:
        await _created(client.pool, rid)
    except ProblemError:  # a pruned run says so (409), as every write to it does
        if isinstance(missing := await unknown_run(client.pool, rid), RunPruned):
            raise pruned_problem(missing) from None
        raise
    require(request, "approve")  # the scope first; the agent once the run decided is known
    # The call may wait in a child run (shown on this page too): the decision goes there, and
    # the caller must be allowed to decide that run's agent's calls.
    named = (
        None if body.run is None else body.run if body.run.startswith("run/") else f"run/{body.run}"
    )
    rid, agent = await _send(decision_target(client, rid, body.call_id, named))
    require(request, "approve", agent)
    outcome = await _send(
        decide(
            client,
            rid,
            call_id=body.call_id,
            approved=body.approved,
            by=principal(request),
            reason=body.reason,
        )
    )
    if outcome is None:
        detail = (
            f"no worker answered within {DECISION_WAIT:g}s; the decision is queued and is "
            f"applied only if call {body.call_id} still waits when the run handles it"
        )
        return json(Decision(run=rid, call_id=body.call_id, outcome="pending", detail=detail), 202)
    if not outcome.accepted:
        raise ProblemError(409, "Conflict", outcome.detail)
    result: Literal["applied", "repeated"] = (
        "applied" if outcome.outcome == "applied" else "repeated"
    )
    return json(Decision(run=rid, call_id=body.call_id, outcome=result, detail=outcome.detail))


async def cancel_run(request: web.Request) -> web.Response:
    rid = run_id(request)
    body = await read_body(request, CancelBody)
    client = request.app[CLIENT]
    await _writable(request, rid, "operate")
    await _send(cancel(client, rid, by=principal(request), reason=body.reason))
    return json(Accepted(run=rid), status=202)


async def retry_run(request: web.Request) -> web.Response:
    """Resume a failed run from its last good step (as ``toren jobs retry`` does; with
    ``upgrade``, on its agent's newest version): 202 once queued; 409 if the run has not
    failed, was cancelled, or is a child whose end went to its parent, or (``upgrade``) if no
    live worker runs its agent."""
    rid = run_id(request)
    body = await read_body(request, RetryBody)
    await _writable(request, rid, "operate")
    await _send(retry(request.app[CLIENT], rid, by=principal(request), upgrade=body.upgrade))
    return json(Accepted(run=rid), status=202)


async def _send(sending: Awaitable[T]) -> T:
    try:
        return await sending
    except (
        UnknownActor,
        ActorNotLive,
        RunNotInState,
        AmbiguousDecision,
        VersionNotServed,  # a retry with upgrade: no live worker runs the agent
    ) as exc:
        raise ProblemError(409, "Conflict", str(exc)) from exc
    except AskError as exc:
        raise ProblemError(409, "Conflict", f"the run could not handle it: {exc}") from exc
