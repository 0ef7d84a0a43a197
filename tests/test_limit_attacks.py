"""Attacks on concurrency limits and shared rate limits (issue 30, items 3 to 5): hostile
retry-after values, limit names that could confuse a family's prefix, and a repeated start that
names another concurrency key. Each test states what a user is promised; one that the code
does not yet keep would be marked xfail (strict) with the reason."""

from __future__ import annotations

import pytest

from toren import Client
from toren._core.limits import set_caps, set_family_cap, usage
from toren.providers._base import parse_retry_after
from toren.runs import IdempotencyConflict, start_run
from toren.runs.limits import concurrency

pytestmark = pytest.mark.anyio


@pytest.mark.parametrize(
    "headers",
    [
        {"retry-after": "nan"},
        {"retry-after": "NaN"},
        {"retry-after": "inf"},
        {"retry-after": "-inf"},
        {"retry-after": "1e400"},
        {"retry-after-ms": "nan"},
        {"retry-after-ms": "infinity"},
    ],
)
def test_a_retry_after_that_is_no_number_of_seconds_counts_as_absent(
    headers: dict[str, str],
) -> None:
    """A 429's retry-after of NaN or infinity would block every worker's calls for ever (or
    fail the step at ``to_timestamp``): it is unreadable, so absent."""
    assert parse_retry_after(headers) is None


def test_a_negative_retry_after_is_no_wait() -> None:
    assert parse_retry_after({"retry-after": "-5"}) == 0.0
    assert parse_retry_after({"retry-after": "1e9"}) == 1e9  # the run caps it (rates.BLOCK_CAP)


async def test_a_family_cap_changes_its_agents_keys_and_no_other_agents(client: Client) -> None:
    """``set_family_cap`` matches its prefix literally: ``%`` and ``_`` are no wildcards, and an
    agent whose name starts with another's is not in its family."""
    names = {
        "key/bot/a": 1,
        "key/bot/%": 1,
        "key/bot/_/x": 1,
        "key/bot2/a": 1,
        "key/bo_/a": 1,
        "key/bo%/a": 1,
        "keys/bot": 1,
        "agent/bot": 1,
    }
    await set_caps(client.pool, names)
    await set_family_cap(client.pool, "key/bot/", 3)
    caps = {u.name: u.cap for u in await usage(client.pool)}
    assert caps == {**names, "key/bot/a": 3, "key/bot/%": 3, "key/bot/_/x": 3}
    await set_family_cap(client.pool, "key/bo_/", 5)
    caps = {u.name: u.cap for u in await usage(client.pool)}
    assert (caps["key/bo_/a"], caps["key/bot/a"], caps["key/bot2/a"]) == (5, 3, 1)


async def test_hostile_but_valid_keys_get_limits_of_their_own(client: Client) -> None:
    """Keys with ``/``, ``%``, ``_`` and 200 bytes are limits of their own, each its own cap."""
    keys = ["a/b", "a", "%", "_", "x" * 200, "é" * 100]
    runs = [await start_run(client, "serial", "hi", concurrency_key=k) for k in keys]
    for run, key in zip(runs, keys, strict=True):
        c = await concurrency(client, run)
        assert (c.key, c.wait) == (key, None)
    names = {u.name for u in await usage(client.pool, prefix="key/serial/")}
    assert names == {f"key/serial/{k}" for k in keys}


async def test_a_repeated_start_naming_another_concurrency_key_is_a_conflict(
    client: Client,
) -> None:
    await start_run(client, "serial", "hi", idempotency_key="i", concurrency_key="a")
    with pytest.raises(IdempotencyConflict):
        await start_run(client, "serial", "hi", idempotency_key="i", concurrency_key="b")
    with pytest.raises(IdempotencyConflict):
        await start_run(client, "serial", "hi", idempotency_key="i")
    again = await start_run(client, "serial", "hi", idempotency_key="i", concurrency_key="a")
    assert again == await start_run(
        client, "serial", "hi", idempotency_key="i", concurrency_key="a"
    )


async def test_a_run_waiting_on_a_rate_limit_gives_its_keys_slot_back_once_passive(
    client: Client, db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tests.conftest import running_worker, wait_for
    from tests.test_rate_limits import T0, Counting, agents, model_server, waiting_now
    from toren._core.limits import permits_of
    from toren.kernel import RateLimit, ShiftedClock, take_rate
    from toren.runs import read_run

    model = "anthropic/claude-sonnet-4-6"
    clock = ShiftedClock.at(T0)
    limits = (RateLimit(name=model, requests_per_minute=1),)
    assert await take_rate(client.pool, limits, now=clock.now(), tokens=1) is None  # used up
    async with (
        model_server(monkeypatch, Counting(clock)),
        running_worker(db_url, agents(), clock=clock, rate_limits=limits),
    ):
        first = await start_run(client, "writer", "one", concurrency_key="k")
        second = await start_run(client, "writer", "two", concurrency_key="k")

        async def first_waits_and_rests() -> bool:
            state = await read_run(client, first)
            owner = await client.pool.fetchval(
                "SELECT owner FROM toren.actors WHERE actor_id = $1", first
            )
            return waiting_now(state, clock) and owner is None

        await wait_for(first_waits_and_rests, what="the first run waiting on the rate, passive")
        # As documented (docs/agents.md, rate limits): a passive wait holds no slot; the
        # next run of the key has it, and the first takes it again when it wakes.
        assert await permits_of(client.pool, first) == []

        async def second_has_it() -> bool:
            return await permits_of(client.pool, second) == ["key/writer/k"]

        await wait_for(second_has_it, what="the second run holding the key's slot")
