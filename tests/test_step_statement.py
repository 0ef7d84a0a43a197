"""The step statement and the claim, composed from named fragments (:mod:`toren._core.step_sql`):
every fragment in place, parameters numbered from the inputs' fields without gaps, each typed by
Postgres as its field says, and the chaos mutations that replace fragments still composing
statements Postgres takes."""

from __future__ import annotations

import re
import uuid
from collections.abc import AsyncIterator, Mapping

import asyncpg
import attrs
import pytest

from toren._core import db, mailbox, step_sql
from toren._core.errors import InternalError

pytestmark = pytest.mark.anyio

STATEMENTS = {
    "step": (step_sql.STEP, step_sql.STEP_FRAGMENTS, step_sql.StepInputs),
    "claim": (step_sql.CLAIM, step_sql.CLAIM_FRAGMENTS, step_sql.ClaimInputs),
}

# How Postgres types each parameter: the record's field order is the statement's.
STEP_TYPES = {
    "actor_id": "text",
    "owner": "uuid",
    "epoch": "int8",
    "message_id": "int8",
    "event_seqs": "int8[]",
    "event_types": "text[]",
    "event_data": "text[]",
    "spawn_ids": "text[]",
    "spawn_kinds": "text[]",
    "spawn_args": "jsonb[]",
    "replaced_timers": "text[]",
    "out_recipients": "text[]",
    "out_lanes": "int4[]",
    "out_kinds": "text[]",
    "out_bodies": "text[]",
    "out_dedupe_keys": "text[]",
    "out_timer_keys": "text[]",
    "out_delays": "float8[]",
    "reply_to": "uuid",
    "reply_kind": "text",
    "reply_body": "text",
    "summary": "jsonb",
    "claim": "bool",
    "spawn_routes": "text[]",
    "spawn_limits": "text[]",
    "release": "bool",
    "route": "text",
}
CLAIM_TYPES = {"actor_id": "text", "owner": "uuid", "epoch": "int8"}

# A step that does a bit of everything: an event, a spawn, a timer, a message, a reply, a summary.
STEP = step_sql.StepInputs(
    actor_id="a/1",
    owner=uuid.UUID(int=1),
    epoch=1,
    message_id=1,
    event_seqs=[1],
    event_types=["t"],
    event_data=['{"x": 1}'],
    spawn_ids=["c/1"],
    spawn_kinds=["k"],
    spawn_args=[{"a": 1}],
    replaced_timers=["tm"],
    out_recipients=["b/1"],
    out_lanes=[1],
    out_kinds=["m"],
    out_bodies=["{}"],
    out_dedupe_keys=[None],
    out_timer_keys=[None],
    out_delays=[0.0],
    reply_to=uuid.UUID(int=2),
    reply_kind="r",
    reply_body="{}",
    summary={"s": 1},
    claim=True,
    spawn_routes=[None],
    spawn_limits=['["agent/x"]'],
    release=True,
    route="agent:x@0123456789ab",
)
CLAIM = step_sql.ClaimInputs(actor_id="a/1", owner=uuid.UUID(int=1), epoch=1)

# Data-modifying CTEs are never inlined: each is in every plan of the step.
WRITES = {
    "consumed",
    "claimed",
    "ev",
    "sp",
    "cancelled",
    "dd",
    "sent",
    "rep",
    "summed",
    "routed",
}


@pytest.fixture
async def conn(db_url: str) -> AsyncIterator[asyncpg.Connection]:
    c = await db.connect(db_url)
    yield c
    await c.close()


async def parameter_types(conn: asyncpg.Connection, statement: str) -> list[str]:
    prepared = await conn.prepare(statement)
    return [t.name for t in prepared.get_parameters()]


@pytest.mark.parametrize("name", STATEMENTS)
def test_every_fragment_is_in_the_statement_in_order(name: str) -> None:
    statement, fragments, inputs = STATEMENTS[name]
    at = [statement.index(step_sql.render(text, inputs)) for text in fragments.values()]
    assert at == sorted(at)
    assert "result" in fragments


@pytest.mark.parametrize("name", STATEMENTS)
def test_parameters_are_numbered_from_the_fields_each_used_without_gaps(name: str) -> None:
    statement, _, inputs = STATEMENTS[name]
    numbers = {int(n) for n in re.findall(r"\$(\d+)", statement)}
    assert numbers == set(range(1, len(attrs.fields(inputs)) + 1))
    assert not re.search(r"\{\w+\}", statement)


def test_the_arguments_follow_the_fields() -> None:
    assert step_sql.arguments(CLAIM) == ("a/1", uuid.UUID(int=1), 1)
    assert len(step_sql.arguments(STEP)) == len(STEP_TYPES)
    assert step_sql.arguments(STEP)[22] is True  # claim: $23


def test_an_input_that_is_no_field_fails_loudly() -> None:
    with pytest.raises(InternalError, match=r"\{epoch_\}"):
        step_sql.render("SELECT {epoch_}", step_sql.ClaimInputs)


def test_a_fragment_that_is_no_part_fails_loudly() -> None:
    with pytest.raises(InternalError, match="unknown \\['fencing'\\]"):
        step_sql.step_statement({**step_sql.STEP_FRAGMENTS, "fencing": "fence AS (SELECT 1)"})
    fragments = dict(step_sql.CLAIM_FRAGMENTS)
    del fragments["fence"]
    with pytest.raises(InternalError, match="missing \\['fence'\\]"):
        step_sql.claim_statement(fragments)


def test_the_mailbox_runs_the_composed_statements() -> None:
    assert step_sql.step_statement() == mailbox._COMMIT
    assert step_sql.claim_statement() == mailbox._CLAIM_NEXT


async def test_postgres_types_each_parameter_as_its_field(conn: asyncpg.Connection) -> None:
    assert await parameter_types(conn, step_sql.STEP) == list(STEP_TYPES.values())
    assert list(STEP_TYPES) == [f.name for f in attrs.fields(step_sql.StepInputs)]
    assert await parameter_types(conn, step_sql.CLAIM) == list(CLAIM_TYPES.values())


async def test_the_step_is_planned_with_every_write(conn: asyncpg.Connection) -> None:
    plan = await conn.fetch("EXPLAIN (COSTS OFF) " + step_sql.STEP, *step_sql.arguments(STEP))
    ctes = set(re.findall(r"^\s*CTE (\w+)$", "\n".join(r[0] for r in plan), re.MULTILINE))
    assert ctes >= WRITES, ctes
    assert "fence" in ctes
    claim = await conn.fetch("EXPLAIN (COSTS OFF) " + step_sql.CLAIM, *step_sql.arguments(CLAIM))
    assert {"fence", "claimed"} <= set(re.findall(r"CTE (\w+)", "\n".join(r[0] for r in claim)))


@pytest.mark.parametrize("mutation", ["no-fencing", "consume-on-claim"])
async def test_a_mutation_replaces_fragments_into_statements_postgres_takes(
    mutation: str, conn: asyncpg.Connection, monkeypatch: pytest.MonkeyPatch
) -> None:
    from chaos.mutations import load

    # Put back what the mutation replaces when the test ends.
    monkeypatch.setattr(mailbox, "_COMMIT", mailbox._COMMIT)
    monkeypatch.setattr(mailbox, "_CLAIM_NEXT", mailbox._CLAIM_NEXT)
    load(mutation)
    mutated: Mapping[str, str] = {"step": mailbox._COMMIT, "claim": mailbox._CLAIM_NEXT}
    assert mutated["step"] != step_sql.STEP
    assert mutated["claim"] != step_sql.CLAIM
    assert await parameter_types(conn, mutated["step"]) == list(STEP_TYPES.values())
    assert await parameter_types(conn, mutated["claim"]) == list(CLAIM_TYPES.values())


async def test_a_step_that_does_not_reroute_plans_no_work_for_the_route(
    conn: asyncpg.Connection,
) -> None:
    plain = attrs.evolve(STEP, route=None)
    plan = "\n".join(
        r[0]
        for r in await conn.fetch(
            "EXPLAIN (COSTS OFF) " + step_sql.STEP, *step_sql.arguments(plain)
        )
    )
    routed = plan[plan.index("CTE routed") :].split("\n  CTE ")[0]
    # The update is cut off before it reads anything: its condition is false at plan time.
    assert "One-Time Filter: false" in routed, routed
    summed = plan[plan.index("CTE summed") :].split("\n  CTE ")[0]
    assert "One-Time Filter: false" not in summed, summed
    rerouting = "\n".join(
        r[0]
        for r in await conn.fetch("EXPLAIN (COSTS OFF) " + step_sql.STEP, *step_sql.arguments(STEP))
    )
    summed = rerouting[rerouting.index("CTE summed") :].split("\n  CTE ")[0]
    assert "One-Time Filter: false" in summed, summed  # the route's update writes the summary
