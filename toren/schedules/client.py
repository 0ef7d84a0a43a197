"""Schedules from outside a worker: declared, created, paused, resumed, triggered, backfilled,
deleted and listed (the CLI, the HTTP API, MCP and the Python API all come here).

A schedule is named ``<agent>/<slot>``: the agent it starts and its own name among that
agent's schedules (``[agents.NAME.schedules.SLOT]``). Every change is a message to the
schedule's actor (``schedule/<agent>/<slot>``), which does it at its next step: these
functions check what they can first (the schedule exists, the input is valid) and never wait
for the step. Listing reads the schedules' rows (what each last step recorded) and computes the
next fire times from the clock.
"""

from __future__ import annotations

import hashlib
import itertools
import math
import re
import uuid
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

import attrs

from toren._agent.principal import Principal
from toren._core.client import Client
from toren._core.clock import Clock
from toren._core.errors import TorenError
from toren._core.json_text import dumps
from toren._core.rows import ActorRow, actor_row, actor_rows, actors_of_kind, set_args
from toren.runs.client import check_served, keyed_run_id
from toren.runs.limits import ensure_key_limit
from toren.schedules import SLOT_NAME, Schedule, ScheduleError, slot_key
from toren.schedules.events import (
    SCHEDULE_KIND,
    SCHEDULE_PREFIX,
    Backfill,
    Declare,
    Delete,
    Pause,
    Resume,
    Source,
    Trigger,
    schedule_id,
    slot_idempotency_key,
)

if TYPE_CHECKING:
    from toren._core.client import Connection

OVERLAPS = ("skip", "buffer_one", "buffer_all", "cancel_other", "allow_all")
PART = 50
"""Slots a backfill's message covers at most: the schedule starts them in one step."""
BACKFILL_SLOTS = 1000
"""Slots one backfill may start at most (a longer range is backfilled in parts)."""
NEXT_SHOWN = 3
_AGENT = re.compile(r"[A-Za-z0-9_.-]{1,100}")
_TRIGGER_ID = re.compile(r"[A-Za-z0-9_.-]{1,64}")


class ScheduleNotFound(TorenError):
    """No schedule has that name (or it was deleted)."""

    def __init__(self, name: str) -> None:
        self.name = name
        shown = name if len(name) <= 120 else f"{name[:117]}..."
        super().__init__(f"no schedule {shown!r} (a schedule is named AGENT/SLOT)")


class ScheduleExists(TorenError):
    """A schedule of that name exists with another declaration."""

    def __init__(self, name: str) -> None:
        self.name = name
        super().__init__(
            f"schedule {name!r} exists with another declaration: delete it first, or pick "
            "another name"
        )


def full_name(agent: str, slot: str) -> str:
    """The name of ``agent``'s schedule ``slot``: ``<agent>/<slot>``."""
    return f"{agent}/{slot}"


def split_name(name: object) -> tuple[str, str]:
    """``(agent, slot)`` of a schedule's name.

    Raises:
        ScheduleError: it is not ``AGENT/SLOT`` with a valid agent and slot name.
    """
    if not isinstance(name, str) or name.count("/") != 1:
        raise ScheduleError("name", "AGENT/SLOT: an agent's name and the schedule's own")
    agent, slot = name.split("/")
    if not _AGENT.fullmatch(agent):
        raise ScheduleError("name", "the agent's name: 1 to 100 letters, digits, _ . -")
    if not SLOT_NAME.fullmatch(slot):
        raise ScheduleError(
            "name", "the schedule's own name: 1 to 63 lowercase letters, digits, _ or -"
        )
    return agent, slot


def schedule_of(name: object, fields: Mapping[str, Any]) -> Schedule:
    """The schedule ``name`` with ``fields`` (those of :meth:`Schedule.to_json` but its name),
    as the surfaces take it from a user.

    Raises:
        ScheduleError: a field is unknown or invalid, or ``name`` is not a schedule's name.
    """
    if "name" in fields:
        raise ScheduleError("schedule", "unknown key(s): name (the name is given apart)")
    return Schedule.from_json({**fields, "name": name})


def _digest(*parts: Any) -> str:
    return hashlib.sha256(dumps(list(parts)).encode()).hexdigest()[:32]


async def declare(
    client: Client, agent: str, schedule: Schedule, *, source: Source, by: Principal
) -> str:
    """Create the actor of ``agent``'s ``schedule`` if there is none, and send it this
    declaration (once per declaration and state of the schedule: a worker's every start
    re-sends what it declares, and the same declaration to the same schedule is one message).
    Returns the schedule's name.

    The dedupe key names the schedule's state as well as the declaration (when it was last
    declared, whether it is deleted): a used key is remembered for days, and a declaration
    sent again after a delete, or after another one replaced it (a rollback), must arrive.
    Workers starting together read the same state and send one message; one that reads the
    state after the actor took it sends a second, which the actor finds the same and records
    nothing for.
    """
    async with client.pool.acquire() as conn, conn.transaction():
        await _declare(client, conn, agent, schedule, source=source, by=by)
    return full_name(agent, schedule.name)


async def _declare(
    client: Client,
    conn: Connection,
    agent: str,
    schedule: Schedule,
    *,
    source: Source,
    by: Principal,
) -> ActorRow | None:
    """:func:`declare` in ``conn``'s transaction; the schedule's row as it was (locked until
    the transaction ends), ``None`` if it was created now. The row's ``args`` name the
    declaration last sent (``declared``), so that two creates of one name serialize on it."""
    address = schedule_id(full_name(agent, schedule.name))
    body = schedule.to_json()
    sent = _digest(agent, body)
    if schedule.concurrency_key is not None:  # its runs are spawned under it, in steps
        await ensure_key_limit(conn, agent, schedule.concurrency_key)
    args = {"agent": agent, "declared": sent}
    created = await client.spawn(SCHEDULE_KIND, address, args, conn=conn)
    held = (
        None if created else await actor_row(conn, address, fields=("summary", "args"), lock=True)
    )
    s = held.summary_dict if held is not None else {}
    state = (s.get("declared_at"), bool(s.get("deleted")))
    if held is not None and held.args_dict != args:
        await set_args(conn, address, args)
    await client.send(
        address,
        Declare(agent=agent, schedule=body, source=source, by=by),
        dedupe_key=f"declare:{_digest(agent, body, source, *state)}",
        conn=conn,
    )
    return held


async def create(client: Client, agent: str, schedule: Schedule, *, by: Principal) -> str:
    """Create ``agent``'s ``schedule`` at run time (as ``toren schedules create`` and
    ``POST /schedules`` do). Creating it again with the same declaration is a no-op (a
    declared schedule stays declared); two creates of one name with different declarations,
    at once or one after the other, are one created and one refused.

    Raises:
        AgentNotServed: workers are live and none runs ``agent``.
        ScheduleExists: a live schedule of that name has another declaration.
    """
    if not _AGENT.fullmatch(agent):
        raise ScheduleError("agent", "an agent name: 1 to 100 letters, digits, _ . -")
    await check_served(client, agent)
    name = full_name(agent, schedule.name)
    body = schedule.to_json()
    async with client.pool.acquire() as conn, conn.transaction():
        address = schedule_id(name)
        # Created now, or locked: a create of the same name at once waits for this one.
        args = {"agent": agent, "declared": _digest(agent, body)}
        held = None
        if not await client.spawn(SCHEDULE_KIND, address, args, conn=conn):
            held = await actor_row(conn, address, fields=("summary", "args"), lock=True)
        if held is not None and not held.summary_dict.get("deleted"):
            s, last = held.summary_dict, held.args_dict.get("declared")
            if last is None and s.get("schedule") is not None:
                last = _digest(agent, s["schedule"])
            if last is not None and last != _digest(agent, body):
                raise ScheduleExists(name)
            if last is not None and s.get("source") == "declared":
                return name  # what its agent declares already: it stays declared
        await _declare(client, conn, agent, schedule, source="api", by=by)
    return name


async def _live(client: Client, name: str) -> ActorRow:
    """The row of the live (declared, not deleted) schedule ``name``.

    Raises:
        ScheduleError: ``name`` is not a schedule's name.
        ScheduleNotFound: there is no such schedule.
    """
    split_name(name)
    row = await actor_row(client.pool, schedule_id(name), fields=("summary", "args"))
    if row is None or not row.summary_dict.get("schedule") or row.summary_dict.get("deleted"):
        raise ScheduleNotFound(name)
    return row


async def pause(client: Client, name: str, *, by: Principal, reason: str = "") -> None:
    """Pause ``name``: its slots start nothing until it is resumed (they are not fired then).

    Raises:
        ScheduleNotFound: see :func:`_live`.
    """
    _check_text("reason", reason, 1000)
    await _live(client, name)
    await client.send(schedule_id(name), Pause(by=by, reason=reason))


async def resume(client: Client, name: str, *, by: Principal) -> None:
    """Resume ``name`` from now (the slots of the pause are not fired)."""
    await _live(client, name)
    await client.send(schedule_id(name), Resume(by=by))


async def trigger(client: Client, name: str, *, by: Principal, id: str | None = None) -> str:
    """Start a run of ``name``'s agent now, whatever its slots and overlap policy; returns the
    run's id. ``id`` names the trigger: the same ``id`` again starts no second run.

    Raises:
        ScheduleError: ``id`` is not 1 to 64 letters, digits, ``_ . -``.
    """
    if id is None:
        id = uuid.uuid4().hex
    if not isinstance(id, str) or not _TRIGGER_ID.fullmatch(id):
        raise ScheduleError("id", "1 to 64 letters, digits, _ . -")
    row = await _live(client, name)
    agent = str(row.summary_dict.get("agent") or row.args_dict.get("agent"))
    await client.send(schedule_id(name), Trigger(by=by, id=id), dedupe_key=f"trigger:{id}")
    return keyed_run_id(agent, slot_idempotency_key(name, f"manual-{id}"))


async def backfill(
    client: Client,
    name: str,
    start: float,
    end: float,
    *,
    overlap: str = "buffer_all",
    by: Principal,
    clock: Clock | None = None,
) -> int:
    """Start ``name``'s slots in ``(start, end]`` (unix seconds, ``end`` not after now) under
    ``overlap``; returns how many slots the range holds. Slots that started a run already start
    none again.

    Raises:
        ScheduleError: a bad range or policy, or more than :data:`BACKFILL_SLOTS` slots.
    """
    if overlap not in OVERLAPS:
        raise ScheduleError("overlap", f"one of {', '.join(OVERLAPS)}")
    now = (clock or Clock()).now()
    for field, value in (("start", start), ("end", end)):
        number = isinstance(value, int | float) and not isinstance(value, bool)
        if not number or not math.isfinite(value):
            raise ScheduleError(field, "a time (unix seconds)")
    if not start < end:
        raise ScheduleError("end", "after start")
    if end > now:
        raise ScheduleError("end", "not in the future: a backfill starts past slots")
    row = await _live(client, name)
    schedule = Schedule.from_json(row.summary_dict["schedule"])
    slots = schedule.spec.slots(start, end, BACKFILL_SLOTS + 1)
    if len(slots) > BACKFILL_SLOTS:
        raise ScheduleError(
            "end", f"a range of at most {BACKFILL_SLOTS} slots: backfill it in parts"
        )
    # In parts of at most FIRED_PER_STEP slots, each a message (one step each), sent together.
    bounds = [float(start), *(slots[i - 1] for i in range(PART, len(slots), PART)), float(end)]
    if not slots:
        return 0
    async with client.pool.acquire() as conn, conn.transaction():
        for low, high in itertools.pairwise(bounds):
            await client.send(
                schedule_id(name), Backfill(by=by, start=low, end=high, overlap=overlap), conn=conn
            )
    return len(slots)


async def delete(client: Client, name: str, *, by: Principal) -> None:
    """Delete ``name``: it starts nothing more (its runs in flight go on). A declared schedule
    that its agent still declares comes back at the next start of a worker running it."""
    await _live(client, name)
    await client.send(schedule_id(name), Delete(by=by))


def _check_text(field: str, value: object, cap: int) -> None:
    if not isinstance(value, str) or len(value) > cap or "\x00" in value:
        raise ScheduleError(field, f"a text of at most {cap} characters, no NUL")
    try:
        value.encode()
    except UnicodeEncodeError:
        raise ScheduleError(field, "valid Unicode text (no lone surrogates)") from None


# --- listing -------------------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class SlotView:
    key: str
    outcome: str  # started, skipped, buffered
    how: str
    run: str | None
    run_status: str | None  # the run's status now (None: no run, or its row is gone)
    reason: str


@attrs.frozen(kw_only=True)
class ScheduleView:
    """A schedule as lists show it."""

    name: str
    agent: str
    schedule: dict[str, Any]
    source: str
    paused: bool
    paused_reason: str
    next: list[float]  # the next fire times (nominal, unix seconds): none while paused
    in_flight: list[str]
    buffered: int
    started: int
    skipped: int
    missed: int
    last_reason: str  # why the last slot that started nothing did not
    recent: list[SlotView]

    def to_json(self) -> dict[str, Any]:
        return attrs.asdict(self)


async def list_schedules(
    client: Client, *, agent: str | None = None, clock: Clock | None = None
) -> list[ScheduleView]:
    """The live schedules (of ``agent`` only, if given), by name."""
    rows = await actors_of_kind(
        client.pool, SCHEDULE_KIND, fields=("summary",), order="id", limit=10_000
    )
    live = [
        r
        for r in rows
        if r.summary_dict.get("schedule")
        and not r.summary_dict.get("deleted")
        and (agent is None or r.summary_dict.get("agent") == agent)
    ]
    return await _views(client, live, clock or Clock())


async def show(client: Client, name: str, *, clock: Clock | None = None) -> ScheduleView:
    """The live schedule ``name``.

    Raises:
        ScheduleNotFound: there is none.
    """
    return (await _views(client, [await _live(client, name)], clock or Clock()))[0]


async def _views(client: Client, rows: list[ActorRow], clock: Clock) -> list[ScheduleView]:
    runs = {
        str(slot.get("run"))
        for r in rows
        for slot in r.summary_dict.get("recent") or ()
        if slot.get("run")
    }
    found = await actor_rows(client.pool, runs, fields=("summary.status",))
    status = {r.actor_id: r.summary_dict.get("status") or "running" for r in found}
    now = clock.now()
    return [_view(r, status, now) for r in rows]


def next_fires(schedule: Schedule, after: float, count: int = NEXT_SHOWN) -> list[float]:
    """The first ``count`` slots of ``schedule`` after ``after`` (fewer past its end, or past
    the year 9999, which a huge interval reaches at once)."""
    fires: list[float] = []
    try:
        slot = schedule.spec.next_slot(after)
        while slot is not None and len(fires) < count:
            slot_key(slot)  # refuses a time past the year 9999
            fires.append(slot)
            slot = schedule.spec.next_slot(slot)
    except ScheduleError:
        pass
    return fires


def local_time(instant: float, timezone: str) -> datetime:
    """``instant`` (unix seconds) in ``timezone``; in UTC when that zone's date would be past
    the year 9999."""
    try:
        return datetime.fromtimestamp(instant, ZoneInfo(timezone or "UTC"))
    except (OverflowError, ValueError, OSError, ZoneInfoNotFoundError):
        return datetime.fromtimestamp(instant, UTC)


def _view(row: ActorRow, status: dict[str, Any], now: float) -> ScheduleView:
    s = row.summary_dict
    upcoming: list[float] = []
    try:
        schedule: Schedule | None = Schedule.from_json(s["schedule"])
    except ScheduleError:  # recorded by another version (a newer worker's field): no next
        schedule = None
    if schedule is not None and not s.get("paused"):
        after = max(float(s.get("cursor") or now), now)
        upcoming = next_fires(schedule, after)
    return ScheduleView(
        name=row.actor_id.removeprefix(SCHEDULE_PREFIX),
        agent=str(s.get("agent", "")),
        schedule=s["schedule"],
        source=str(s.get("source", "")),
        paused=bool(s.get("paused")),
        paused_reason=str(s.get("paused_reason") or ""),
        next=upcoming,
        in_flight=[str(r) for r in s.get("in_flight") or ()],
        buffered=int(s.get("buffered") or 0),
        started=int(s.get("started") or 0),
        skipped=int(s.get("skipped") or 0),
        missed=int(s.get("missed") or 0),
        last_reason=str(s.get("last_reason") or ""),
        recent=[
            SlotView(
                key=str(r.get("key")),
                outcome=str(r.get("outcome")),
                how=str(r.get("how") or ""),
                run=r.get("run"),
                run_status=status.get(r.get("run")) if r.get("run") else None,
                reason=str(r.get("reason") or ""),
            )
            for r in s.get("recent") or ()
        ],
    )
