"""Shared provider rate limits (issue 30): three workers on one clock keep a fleet under N
requests a minute with no 429 and use the limit; a 429 with retry-after on one worker pauses the
others' calls on that key for its duration; bad declarations are refused; a worker that
declares none writes nothing.

The clock is a test's (``ShiftedClock``), shared by the workers and the model server, which
counts requests per minute of that clock. Runs wait on a timer of the clock's delay (up to a
real minute); the test moves the clock to the next minute instead and wakes them
(``RateWake``), as an expired timer would.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections import Counter
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import running_worker, wait_for
from toren import Agent, Client, ConfigError, Settings
from toren._cli.timeline import describe
from toren.kernel import (
    RateLimit,
    Refusal,
    ShiftedClock,
    block_rate,
    rate_windows,
    take_rate,
    window_of,
)
from toren.runs import Agents, RateWake, RunState, read_run, start_run
from toren.testing import AnthropicServer, Fail, Reply

pytestmark = pytest.mark.anyio

MODEL = "anthropic/claude-sonnet-4-6"
T0 = datetime(2026, 3, 2, 9, 0, 1, tzinfo=UTC).timestamp()  # a second into a minute


def agents() -> Agents:
    found = Agents()
    found.register([Agent(name="writer", model=MODEL)])
    return found


class Counting:
    """What the model server saw: each request's time on the test's clock."""

    def __init__(self, clock: ShiftedClock, first: Fail | None = None) -> None:
        self.clock = clock
        self.at: list[float] = []
        self.first = first

    def __call__(self, request: dict[str, Any], n: int) -> Reply | Fail:
        self.at.append(self.clock.now())
        if n == 1 and self.first is not None:
            return self.first
        return Reply("Done.")

    def per_minute(self) -> Counter[int]:
        return Counter(window_of(t) for t in self.at)


@contextlib.asynccontextmanager
async def model_server(
    monkeypatch: pytest.MonkeyPatch, script: Counting
) -> AsyncIterator[AnthropicServer]:
    async with AnthropicServer(script) as server:
        for key, value in server.env().items():
            monkeypatch.setenv(key, value)
        yield server


async def states(client: Client, run_ids: list[str]) -> list[RunState]:
    return [await read_run(client, r) for r in run_ids]


def waiting_now(state: RunState, clock: ShiftedClock) -> bool:
    """Waits on a rate limit, for a moment still ahead on the clock (not an earlier wait)."""
    wait = state.rate_wait
    return state.status == "running" and wait is not None and wait.until > clock.now()


async def wake(client: Client, run_ids: list[str], found: list[RunState]) -> None:
    for run_id, state in zip(run_ids, found, strict=True):
        if state.status == "running":
            await client.send(run_id, RateWake())


async def test_three_workers_share_n_requests_a_minute_and_use_them(
    client: Client, db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    n, runs = 6, 21
    clock = ShiftedClock.at(T0)
    script = Counting(clock)
    limits = (RateLimit(name=MODEL, requests_per_minute=n),)
    async with model_server(monkeypatch, script) as server, contextlib.AsyncExitStack() as stack:
        for _ in range(3):
            await stack.enter_async_context(
                running_worker(db_url, agents(), clock=clock, rate_limits=limits)
            )
        run_ids = [await start_run(client, "writer", f"note {i}") for i in range(runs)]
        minutes = 0
        while True:
            # Each run has called (and completed) or waits for the end of this minute.
            async def settled() -> list[RunState] | None:
                found = await states(client, run_ids)
                ok = all(s.status == "completed" or waiting_now(s, clock) for s in found)
                return found if ok else None

            found = await wait_for(settled, what="every run completed or waiting")
            minutes += 1
            if all(s.status == "completed" for s in found):
                break
            # The fleet waits: this minute's limit is used up, exactly.
            assert script.per_minute()[window_of(clock.now())] == n
            assert minutes < runs  # it goes on
            clock.advance((window_of(clock.now()) + 1) * 60 + 1 - clock.now())
            await wake(client, run_ids, found)
    counts = script.per_minute()
    assert sum(counts.values()) == runs == len(server.received)
    assert max(counts.values()) <= n  # no minute over the limit (and no 429: none was sent)
    full = sorted(counts)[:-1]  # every minute but the last, when fewer than n were left
    assert all(counts[m] >= 0.8 * n for m in full), counts
    assert len(counts) == -(-runs // n) == minutes
    # Each wait is on the timeline, and a waited call was never counted as lost in flight.
    for state in found:
        assert state.lost_calls == 0
        assert len(state.calls) == 1
    rows = await rate_windows(client.pool)
    assert {r["win"]: r["requests"] for r in rows} == dict(counts)


async def test_a_429_with_retry_after_on_one_worker_pauses_the_others(
    client: Client, db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    retry_after = 30.0
    clock = ShiftedClock.at(T0)
    script = Counting(clock, first=Fail(status=429, message="slow down", retry_after=retry_after))
    limits = (RateLimit(name="anthropic", requests_per_minute=100),)
    async with model_server(monkeypatch, script):
        async with running_worker(db_url, agents(), clock=clock, rate_limits=limits):
            first = await start_run(client, "writer", "first")

            async def blocked() -> RunState | None:
                state = await read_run(client, first)
                wait = state.rate_wait
                return state if wait is not None and wait.reason == "blocked" else None

            state = await wait_for(blocked, what="the first run blocked by the 429")
        refused_at = script.at[0]
        assert state.rate_wait is not None
        assert state.rate_wait.until == pytest.approx(refused_at + retry_after, abs=1.0)
        assert state.failed_attempts == 0
        assert state.lost_calls == 0
        # The worker that met the 429 is gone: two others take runs on the same key.
        async with contextlib.AsyncExitStack() as stack:
            for _ in range(2):
                await stack.enter_async_context(
                    running_worker(db_url, agents(), clock=clock, rate_limits=limits)
                )
            others = [await start_run(client, "writer", f"other {i}") for i in range(4)]
            run_ids = [first, *others]

            async def all_blocked() -> list[RunState] | None:
                found = await states(client, run_ids)
                return found if all(waiting_now(s, clock) for s in found) else None

            found = await wait_for(all_blocked, what="every run waiting on the block")
            assert {s.rate_wait.reason for s in found if s.rate_wait} == {"blocked"}
            assert len(script.at) == 1  # nobody called during the block
            clock.advance(retry_after)
            await wake(client, run_ids, found)

            async def done() -> list[RunState] | None:
                found = await states(client, run_ids)
                return found if all(s.status == "completed" for s in found) else None

            await wait_for(done, what="every run completed after the block")
    assert len(script.at) == 6
    assert all(t >= refused_at + retry_after for t in script.at[1:])


async def test_no_limits_declared_writes_no_rate_row(
    client: Client, db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = ShiftedClock.at(T0)
    script = Counting(clock)
    async with model_server(monkeypatch, script), running_worker(db_url, agents(), clock=clock):
        run_id = await start_run(client, "writer", "hello")

        async def completed() -> bool:
            return (await read_run(client, run_id)).status == "completed"

        await wait_for(completed, what="the run completed")
    assert await rate_windows(client.pool) == []
    assert await client.pool.fetchval("SELECT count(*) FROM toren.rate_blocks") == 0


BAD = [
    ("[rate_limits.anthropic]\nrequests_per_minute = 0\n", "requests_per_minute"),
    ("[rate_limits.anthropic]\nrequests_per_minute = -5\n", "requests_per_minute"),
    ("[rate_limits.anthropic]\ntokens_per_minute = 1.5\n", "tokens_per_minute"),
    ('[rate_limits.anthropic]\ntokens_per_minute = "40000"\n', "tokens_per_minute"),
    ("[rate_limits.anthropic]\nrequests_per_minute = true\n", "requests_per_minute"),
    ("[rate_limits.anthropic]\nrequests_per_minute = 4294967296\n", "requests_per_minute"),
    ("[rate_limits.anthropic]\nrequests_per_hour = 5\n", "requests_per_hour"),
    ("[rate_limits.anthropic]\n", "requests_per_minute"),
    ('[rate_limits."mistral/large"]\nrequests_per_minute = 5\n', "a rate limit names"),
    ("[rate_limits]\nanthropic = 5\n", "must be a table"),
]


@pytest.mark.parametrize(("toml", "named"), BAD)
def test_a_bad_rate_limit_is_refused_naming_its_table_and_key(
    tmp_path: Path, toml: str, named: str
) -> None:
    path = tmp_path / "toren.toml"
    path.write_text(toml)
    with pytest.raises(ConfigError) as raised:
        Settings.load(config_file=path, env={})
    assert "[rate_limits." in str(raised.value)
    assert named in str(raised.value)


def test_good_rate_limits_are_read_and_the_cli_refuses_a_bad_one_with_exit_2(
    tmp_path: Path,
) -> None:
    path = tmp_path / "toren.toml"
    path.write_text(
        '[rate_limits."anthropic/claude-sonnet-4-6"]\nrequests_per_minute = 50\n'
        "tokens_per_minute = 40000\n[rate_limits.openai]\nrequests_per_minute = 10\n"
    )
    loaded = Settings.load(config_file=path, env={})
    assert loaded.rate_limits == (
        RateLimit(name=MODEL, requests_per_minute=50, tokens_per_minute=40000),
        RateLimit(name="openai", requests_per_minute=10),
    )
    with pytest.raises(ConfigError):
        Settings(rate_limits=(RateLimit(name="openai", requests_per_minute=1),) * 2)
    path.write_text("[rate_limits.anthropic]\nrequests_per_minute = 0\n")
    result = subprocess.run(
        [sys.executable, "-m", "toren", "workers"],
        env={"TOREN_CONFIG": str(path), "PATH": "/usr/bin:/bin", "PYTHONPATH": str(Path.cwd())},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 2, result.stderr
    assert '[rate_limits."anthropic"]' in result.stderr
    assert "requests_per_minute must be a positive whole number" in result.stderr


async def test_a_take_counts_tokens_and_takes_every_limit_or_none(client: Client) -> None:
    model = RateLimit(name=MODEL, requests_per_minute=10)
    key = RateLimit(name="anthropic", tokens_per_minute=100)
    pool = client.pool
    assert await take_rate(pool, (model, key), now=T0, tokens=60) is None
    refusal = await take_rate(pool, (model, key), now=T0 + 1, tokens=60)
    assert refusal == Refusal(limit=key, reason="tokens", until=(window_of(T0) + 1) * 60.0)
    rows = {r["name"]: r for r in await rate_windows(pool)}
    assert rows[MODEL]["requests"] == 1  # the model's limit gave back what the key refused
    assert (rows["anthropic"]["requests"], rows["anthropic"]["tokens"]) == (1, 60)
    # The next minute has room again; a call over the token cap goes alone in its minute.
    assert await take_rate(pool, (model, key), now=T0 + 60, tokens=40) is None
    assert await take_rate(pool, (key,), now=T0 + 120, tokens=500) is None
    assert (await take_rate(pool, (key,), now=T0 + 121, tokens=1)) is not None
    # A block holds every take of its limit until it ends, on the clock given.
    await block_rate(pool, ["anthropic"], T0 + 200)
    blocked = await take_rate(pool, (model, key), now=T0 + 190, tokens=1)
    assert blocked == Refusal(limit=key, reason="blocked", until=T0 + 200)
    assert await take_rate(pool, (model, key), now=T0 + 200.5, tokens=1) is None


def test_the_timeline_says_which_limit_and_until_when() -> None:
    data = {"limit": "anthropic", "caps": "50 requests/min", "reason": "requests", "until": T0}
    assert describe("rate.waited", data) == (
        "waiting for rate limit anthropic (50 requests/min) until 09:00:01 UTC: requests used up"
    )
