"""Provider rate limits shared by every worker: requests and tokens per minute, in Postgres.

A :class:`RateLimit` is a name and its caps per minute. Which calls it covers is the caller's
business (the agent layer names limits after a model, ``anthropic/claude-sonnet-4-6``, or a
provider, ``anthropic``); a call takes from every limit that covers it, all or none.

Windows are fixed minutes of the worker's clock: ``win = floor(now / 60)``, computed by the
caller from its :class:`~toren._core.clock.Clock` and passed to SQL as a number, so a test's
clock moves them and the database's own time never enters them. One row per (limit, window)
counts the requests and tokens taken in it (``toren.rate_windows``); :func:`take` adds to it in
one statement, ``INSERT ... ON CONFLICT DO UPDATE ... WHERE`` under the caps, so concurrent
takes on any number of workers serialize on the row and never go over. A provider's 429 with a
retry-after is recorded by :func:`block` (``toren.rate_blocks``): every take of that limit is
refused until then.

Who writes what: a take writes one row per limit covering the call (none when no limit covers
it, so a worker with no limits declared writes nothing); a 429 writes one row per limit covering
its call. Old windows are deleted by housekeeping (:func:`toren._core.workers.housekeep`), by
the database's time of their last write.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal

import attrs

from toren._core.errors import ConfigError

if TYPE_CHECKING:
    from typing import TypeAlias

    import asyncpg

    from toren._core.client import Connection

    Db: TypeAlias = asyncpg.Pool | Connection

WINDOW_SECONDS = 60
_MAX_NAME = 200

Reason = Literal["requests", "tokens", "blocked"]


def _per_minute(inst: Any, attribute: attrs.Attribute[Any], value: int | None) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value < 2**31:
        raise ConfigError(
            f"rate limit {inst.name!r}: {attribute.name} must be a positive whole number "
            "(below 2**31)",
            hint="Give requests_per_minute and/or tokens_per_minute, such as 50 or 40000.",
        )


def _name(inst: Any, attribute: attrs.Attribute[Any], value: str) -> None:
    if (
        not isinstance(value, str)
        or not value
        or len(value) > _MAX_NAME
        or not value.isprintable()
        or value != value.strip()
    ):
        raise ConfigError(
            "a rate limit's name must be a model (provider/model) or a provider, printable, "
            f"at most {_MAX_NAME} characters"
        )


@attrs.frozen(kw_only=True)
class RateLimit:
    """At most ``requests_per_minute`` requests and ``tokens_per_minute`` tokens per minute of
    the calls ``name`` covers, across every worker (either cap may be left out, not both).

    Raises:
        ConfigError: a cap that is not a positive whole number, or neither cap given.
    """

    name: str = attrs.field(validator=_name)
    requests_per_minute: int | None = attrs.field(default=None, validator=_per_minute)
    tokens_per_minute: int | None = attrs.field(default=None, validator=_per_minute)

    def __attrs_post_init__(self) -> None:
        if self.requests_per_minute is None and self.tokens_per_minute is None:
            raise ConfigError(
                f"rate limit {self.name!r} has no cap",
                hint="Give requests_per_minute and/or tokens_per_minute.",
            )

    def caps(self) -> str:
        """Its caps as a timeline shows them: ``50 requests/min, 40000 tokens/min``."""
        parts = []
        if self.requests_per_minute is not None:
            parts.append(f"{self.requests_per_minute} requests/min")
        if self.tokens_per_minute is not None:
            parts.append(f"{self.tokens_per_minute} tokens/min")
        return ", ".join(parts)


@attrs.frozen(kw_only=True)
class Refusal:
    """Why a take was refused: ``limit`` is full of ``reason`` (requests or tokens) for its
    window, or ``blocked`` after a 429; try again at ``until`` (seconds of the clock the take
    was given)."""

    limit: RateLimit
    reason: Reason
    until: float


def window_of(now: float) -> int:
    """The window (minute) of clock time ``now``."""
    return math.floor(now / WINDOW_SECONDS)


_TAKE = """
WITH wanted AS (
    SELECT * FROM unnest($1::text[], $2::int[], $3::bigint[]) AS w(name, rpm, tpm)
), current AS (
    SELECT w.name, w.rpm, w.tpm,
           coalesce(r.requests, 0) AS requests, coalesce(r.tokens, 0) AS tokens,
           extract(epoch FROM b.blocked_until)::float8 AS blocked_until
    FROM wanted w
    LEFT JOIN toren.rate_windows r ON r.name = w.name AND r.win = $4::bigint
    LEFT JOIN toren.rate_blocks b ON b.name = w.name AND b.blocked_until > to_timestamp($6::float8)
), fits AS (
    SELECT bool_and(blocked_until IS NULL
                    AND (rpm IS NULL OR requests < rpm)
                    AND (tpm IS NULL OR tokens + $5::bigint <= tpm OR requests = 0)) AS ok
    FROM current
), taken AS (
    INSERT INTO toren.rate_windows AS r (name, win, requests, tokens, requests_cap, tokens_cap)
    SELECT w.name, $4::bigint, 1, $5::bigint, w.rpm, w.tpm FROM wanted w WHERE (SELECT ok FROM fits)
    ORDER BY w.name  -- row locks in one order: concurrent takes never wait in a cycle
    ON CONFLICT (name, win) DO UPDATE
    SET requests = r.requests + 1, tokens = r.tokens + excluded.tokens,
        requests_cap = excluded.requests_cap, tokens_cap = excluded.tokens_cap, touched_at = now()
    -- checked again on the row as it is now, locked: the caps hold under any concurrency (a
    -- call alone in its window may exceed the token cap: it could never go otherwise)
    WHERE (excluded.requests_cap IS NULL OR r.requests < excluded.requests_cap)
      AND (excluded.tokens_cap IS NULL OR r.tokens + excluded.tokens <= excluded.tokens_cap
           OR r.requests = 0)
    RETURNING r.name
)
SELECT c.name, c.requests, c.tokens, c.blocked_until, c.name IN (SELECT name FROM taken) AS took
FROM current c
"""

# A take that won some limits' rows and lost another's to a concurrent take (rare: both saw
# room): what it took is given back, so it takes all of its limits or none.
_GIVE_BACK = """
UPDATE toren.rate_windows SET requests = requests - 1, tokens = tokens - $3::bigint
WHERE name = ANY($1::text[]) AND win = $2::bigint
"""

_BLOCK = """
INSERT INTO toren.rate_blocks (name, blocked_until)
SELECT n, to_timestamp($2::float8) FROM unnest($1::text[]) AS n ORDER BY n
ON CONFLICT (name) DO UPDATE
SET blocked_until = greatest(toren.rate_blocks.blocked_until, excluded.blocked_until),
    noted_at = now()
"""


async def take(db: Db, limits: Sequence[RateLimit], *, now: float, tokens: int) -> Refusal | None:
    """Take one request and ``tokens`` tokens from each of ``limits`` in the window of clock
    time ``now``: all of them, or none.

    Returns:
        ``None``: taken. Otherwise why not (a limit blocked after a 429 first, else the first
        full one) and when to try again (the block's end, or the window's).
    """
    if not limits:
        return None
    by_name = {limit.name: limit for limit in limits}
    names = sorted(by_name)
    win = window_of(now)
    rows = await db.fetch(
        _TAKE,
        names,
        [by_name[n].requests_per_minute for n in names],
        [by_name[n].tokens_per_minute for n in names],
        win,
        max(0, tokens),
        now,
    )
    if all(r["took"] for r in rows):
        return None
    took = [r["name"] for r in rows if r["took"]]
    if took:
        await db.execute(_GIVE_BACK, took, win, max(0, tokens))
    blocked = [r for r in rows if r["blocked_until"] is not None]
    if blocked:
        last = max(blocked, key=lambda r: r["blocked_until"])
        return Refusal(limit=by_name[last["name"]], reason="blocked", until=last["blocked_until"])
    end = float((win + 1) * WINDOW_SECONDS)
    for r in rows:
        limit = by_name[r["name"]]
        rpm, tpm = limit.requests_per_minute, limit.tokens_per_minute
        if rpm is not None and r["requests"] >= rpm:
            return Refusal(limit=limit, reason="requests", until=end)
        if tpm is not None and r["tokens"] + tokens > tpm and r["requests"] > 0:
            return Refusal(limit=limit, reason="tokens", until=end)
    # Every limit had room as this take saw it, and one filled meanwhile (the race above).
    lost = next(by_name[r["name"]] for r in rows if not r["took"])
    reason: Reason = "requests" if lost.requests_per_minute is not None else "tokens"
    return Refusal(limit=lost, reason=reason, until=end)


async def block(db: Db, names: Sequence[str], until: float) -> None:
    """No take of the limits ``names`` until clock time ``until`` (a provider's 429 with
    retry-after), on every worker; a later block already recorded stands."""
    if names:
        await db.execute(_BLOCK, sorted(set(names)), until)


async def rate_windows(db: Db) -> list[dict[str, Any]]:
    """Every window row (name, win, requests, tokens, caps), oldest first: for operators and
    tests."""
    rows = await db.fetch(
        "SELECT name, win, requests, tokens, requests_cap, tokens_cap FROM toren.rate_windows "
        "ORDER BY win, name"
    )
    return [dict(r) for r in rows]
