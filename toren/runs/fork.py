"""Forking a run from a step: a new run that goes on from another's model call ``at``.

The fork's journal starts with a copy of the source's events before step ``at`` (copied by value
in the database, renumbered), then ``run.forked`` (:class:`~toren.runs.fork_events.RunForked`),
and it is sent a ``Continue``: all in one transaction, so a fork exists whole or not at all, and
the source's rows are only read. The calls before the step are served from the fork's own
journal, never sent or paid again; from the step on the fork runs live: its model calls are
made again, its tool calls run again under new idempotency keys (they derive from the run's id)
and ask their approvals again. A sandboxed run's fork starts from the workspace as it was at the
step. See docs/agents.md ("Forking a run").

Steps are numbered as ``toren jobs show`` numbers model calls: the calls in effect (a call voided
by an invalidation is replaced by the one made again for its step; compaction summaries are not
steps), from 1 to the count of calls the run has made.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import attrs

from toren._agent.directory import card_version
from toren._agent.principal import Principal
from toren._agent.routes import agent_route, version_route
from toren._core.codec import decode
from toren._core.errors import TorenError, UnknownActor
from toren._core.journal_copy import copy_journal
from toren._core.journal_reads import events
from toren._core.json_text import utf8_size
from toren._core.rows import actor_row
from toren._core.workers import newest_card
from toren.runs.audit import RunPruned, unknown_run
from toren.runs.client import MESSAGE_CAP
from toren.runs.events import (
    RUN_KIND,
    Continue,
    ModelCalled,
    ModelCalling,
    ModelLost,
    ModelUnreadable,
    StepsInvalidated,
    ToolResulted,
)
from toren.runs.fork_events import RunForked, human_text
from toren.runs.limits import impose_run
from toren.runs.state import RunState, fold

if TYPE_CHECKING:
    from toren._core.client import Client
    from toren._core.journal import JournalEntry
    from toren._core.rows import Db

_STEP_EVENTS = (ModelCalling, ModelCalled, ModelUnreadable, ModelLost)
"""The events of a model call's step (its announcement, its answer, what it lost)."""

_CARRIED = "message.received"
"""Human messages heard while a step was under way (after its announcement, before its answer)
were in the request it made: a fork from that step keeps them."""


class InvalidFork(TorenError):
    """A run cannot be forked with these values (``field`` names which: ``run``, ``at``,
    ``message`` or ``input``); nothing was stored."""

    def __init__(self, run_id: str, field: str, detail: str) -> None:
        self.run_id = run_id
        self.field = field
        self.detail = detail
        super().__init__(f"cannot fork {run_id}: {field}: {detail}")


async def fork_run(
    client: Client,
    run_id: str,
    *,
    at: int,
    upgrade: bool = False,
    message: str | None = None,
    input: str | None = None,
    by: Principal | None = None,
    cap: int = MESSAGE_CAP,
) -> str:
    """Fork run ``run_id`` from its model call ``at``; returns the new run's id.

    The fork replays the source's journal before step ``at`` by value (free: its receipt shows
    those calls as not re-paid) and runs live from the step on, on the source's agent version,
    or on the current one with ``upgrade``. ``message`` replaces the last human message before
    the step, ``input`` the run's input (not both), in what the model sees from the step on. A
    running source is forked as far as it has committed; forks of forks, and of completed,
    failed and cancelled runs, are forked alike. ``by`` is recorded on ``run.forked`` (this
    process's OS user if not given).

    Raises:
        UnknownActor: no such run.
        InvalidFork: ``run_id`` is not a run; ``at`` is not a step of it (an integer from 1
            to the number of model calls it made); ``message`` and ``input`` are both given;
            there is no human message before the step to replace (or a compaction summarised
            it); a text is empty, holds NUL or a lone surrogate, or is over ``cap`` bytes; its
            first events were archived and deleted (a conversation truncated by its retention).
    """
    if isinstance(at, bool) or not isinstance(at, int):
        raise InvalidFork(run_id, "at", f"a step number (an integer from 1), not {at!r}")
    if at < 1:
        raise InvalidFork(run_id, "at", f"steps are numbered from 1; there is no step {at}")
    if message is not None and input is not None:
        raise InvalidFork(run_id, "message", "give a new message or a new input, not both")
    for field, text in (("message", message), ("input", input)):
        if text is not None:
            _check_text(run_id, field, text, cap)
    if not isinstance(run_id, str) or not run_id:
        raise UnknownActor(str(run_id))
    by = by if by is not None else Principal.os_user("python")
    async with client.pool.acquire() as conn, conn.transaction():
        # Kept (a prune skips it) until its journal is copied, in a later statement.
        row = await actor_row(
            conn, run_id, fields=("args.agent", "args.concurrency_key"), keep=True
        )
        if row is None:
            missing = await unknown_run(conn, run_id)
            if isinstance(missing, RunPruned):  # its journal is gone: nothing to copy
                when = missing.pruned_at.date().isoformat() if missing.pruned_at else "?"
                detail = f"run was pruned on {when}; restore it first (toren jobs restore)"
                raise InvalidFork(run_id, "run", detail)
            raise missing
        if row.kind != RUN_KIND:
            raise InvalidFork(run_id, "run", f"it is not a run (an actor of kind {row.kind})")
        recorded = await events(conn, run_id)
        if recorded and recorded[0].seq != 1:
            # A conversation whose first events were archived (toren._core.truncation).
            raise InvalidFork(
                run_id,
                "run",
                f"its events before seq {recorded[0].seq} were archived and deleted (its "
                "agent's conversation_keep_for); a fork copies its journal from the start",
            )
        cut = _cut(run_id, recorded, at)
        _check_edit(run_id, cut, at, message=message, input=input)
        agent = str(row.args_dict.get("agent") or cut.state.agent)
        # The fork goes under its source's key (one chat, one customer): it waits its turn
        # behind the source and the key's other runs, as a run started with the key would.
        key = row.args_dict.get("concurrency_key")
        key = key if isinstance(key, str) else None
        keyed = {} if key is None else {"concurrency_key": key}
        fork_id = f"run/{uuid.uuid4()}"
        await client.spawn(
            RUN_KIND,
            fork_id,
            {"agent": agent, "forked_from": {"run": run_id, "step": at}, **keyed},
            route=await _newest_route(conn, agent) if upgrade or not row.route else row.route,
            conn=conn,
        )
        forked = RunForked(
            source=run_id,
            step=at,
            calls=len(cut.state.calls),
            message=message,
            input=input,
            checkpoint=cut.checkpoint,
            upgrade=upgrade,
            by=by,
            at=time.time(),
        )
        await copy_journal(
            conn,
            run_id,
            fork_id,
            before=cut.start,
            also=(_CARRIED,),
            until=cut.end,
            then=(forked,),
        )
        await client.send(fork_id, Continue(), conn=conn)
        await impose_run(conn, fork_id, agent, key)
    return fork_id


async def _newest_route(conn: Db, agent: str) -> str:
    """Where a fork on the agent's current version goes: pinned to its newest version (of the
    versions live workers serve, the one first seen latest; as ``upgrade_run`` moves a run), so
    that a worker of the source's own version, which sees nothing to move, cannot take it and
    leave it unpinned; on the agent's route if that version's policy is ``upgrade`` or none
    serves it
    (the first worker to come up takes it)."""
    card = await newest_card(conn, agent)
    version = card_version(card)
    if version is None or (isinstance(card, Mapping) and card.get("version_policy") == "upgrade"):
        return agent_route(agent)
    return version_route(agent, version)


@attrs.frozen(kw_only=True)
class _Cut:
    """Where a fork from a step cuts its source's journal: ``start``, the seq of the step's
    first event; ``end``, that of its answer; the state the copy folds to; the source's sandbox
    checkpoint at the step."""

    start: int
    end: int
    state: RunState
    checkpoint: str | None


def _cut(run_id: str, entries: list[JournalEntry], at: int) -> _Cut:
    """Find step ``at`` in the source's journal: its first event (the first announcement or
    answer of a call for the step since the last invalidation that voided it) and its answer.

    Raises:
        InvalidFork: the run has fewer than ``at`` calls in effect.
    """
    decoded: list[tuple[int, str, Any]] = [(e.seq, e.type, decode(e.type, e.data)) for e in entries]
    start = end = 0
    final = RunState()
    for seq, _, event in decoded:
        if isinstance(event, StepsInvalidated) and event.from_step <= at:
            start = end = 0  # the step's call (if made) was voided: it is made again later
        elif isinstance(event, _STEP_EVENTS) and event.step == at:
            start = start or seq
            if isinstance(event, ModelCalled):
                end = seq
        final = fold(final, event)
    made = len(final.calls)
    if at > made:
        if not made:
            raise InvalidFork(run_id, "at", "the run has made no model call yet: nothing to fork")
        raise InvalidFork(
            run_id, "at", f"the run has {made} model calls (steps 1 to {made}); no step {at}"
        )
    if not (0 < start <= end):
        raise InvalidFork(run_id, "at", f"step {at} is not in the journal as recorded")
    state, checkpoint = RunState(), None
    for seq, kind, event in decoded:
        if seq >= end:
            break
        if seq >= start and kind != _CARRIED:
            continue
        if (isinstance(event, ToolResulted) and event.checkpoint is not None) or isinstance(
            event, RunForked
        ):
            checkpoint = event.checkpoint
        state = fold(state, event)
    return _Cut(start=start, end=end, state=state, checkpoint=checkpoint)


def _check_edit(run_id: str, cut: _Cut, at: int, *, message: str | None, input: str | None) -> None:
    """Refuse an edit with nothing to apply to: no human message before the step, or a text
    a compaction before the step summarised (the model no longer sees it as it was).

    Raises:
        InvalidFork: as said.
    """
    state = cut.state
    base = state.compactions[-1].base if state.compactions else 0
    if message is not None:
        # The input is a human's text too, but not a message: it is replaced with ``input``.
        if state.heard and state.heard.released == len(state.heard):
            raise InvalidFork(
                run_id,
                "message",
                f"the last human message before step {at} was released from the run's state "
                "(a long conversation keeps its recent turns); fork from a later step",
            )
        where = human_text(state.messages, last=True) if state.heard else None
        if where is None:
            raise InvalidFork(
                run_id,
                "message",
                f"no human message before step {at} to replace (give a new input instead)",
            )
        if where[0] < base:
            raise InvalidFork(
                run_id,
                "message",
                f"the last human message before step {at} was compacted before it; "
                "fork from an earlier step",
            )
    if input is not None and base > 0:
        raise InvalidFork(
            run_id, "input", f"the input was compacted before step {at}; fork from an earlier step"
        )


def _check_text(run_id: str, field: str, text: object, cap: int) -> None:
    """A replacement text: non-empty text, no NUL, no lone surrogate, at most ``cap`` bytes.

    Raises:
        InvalidFork: it is not.
    """
    if not isinstance(text, str) or not text:
        raise InvalidFork(run_id, field, "a non-empty text")
    if "\x00" in text:
        raise InvalidFork(run_id, field, "no NUL characters")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidFork(run_id, field, "valid Unicode (no lone surrogates)") from None
    size = utf8_size(text)
    if size > cap:
        raise InvalidFork(run_id, field, f"{size} bytes, over the cap of {cap} bytes")
