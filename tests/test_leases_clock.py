"""The worker's own lease clock (``LeaseClock``), what checks it before an effect
(``Context.ensure_lease``, ``ToolContext.ensure_lease``), and ``parse_duration``."""

from __future__ import annotations

import math
import uuid

import pytest

from toren import Actor, ConfigError, Context, LeaseExpired, Settings, ToolContext, TorenError
from toren._agent.agents import parse_duration
from toren.kernel import Claim, LeaseClock


class FakeClock:
    """A monotonic clock that moves only when the test says so."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def lease_clock(now: FakeClock, *, sent_at: float | None = None) -> LeaseClock:
    return LeaseClock(
        "a/1", lease=15.0, margin=5.0, sent_at=now.now if sent_at is None else sent_at, clock=now
    )


def test_lease_holds_for_lease_minus_margin_after_the_claim_was_sent() -> None:
    now = FakeClock()
    clock = lease_clock(now, sent_at=now.now - 2.0)  # the claim's answer took 2 s to come back
    now.now += 8.0  # 10 s after sending: exactly lease - margin
    clock.ensure()
    assert clock.remaining() == pytest.approx(5.0)
    now.now += 0.001
    with pytest.raises(LeaseExpired) as caught:
        clock.ensure()
    assert caught.value.actor_id == "a/1"
    assert caught.value.over_by == pytest.approx(0.001)
    assert "a/1" in str(caught.value)


def test_renewal_extends_the_lease_from_when_it_was_sent() -> None:
    now = FakeClock()
    clock = lease_clock(now)
    sent = now.now + 9.0
    now.now += 12.0  # the renewal was sent at +9 s and answered at +12 s
    clock.renewed(sent)
    assert clock.remaining() == pytest.approx(15.0 - 3.0)
    now.now = sent + 10.0  # lease - margin after the renewal was sent: still fine
    clock.ensure()
    now.now += 0.001
    with pytest.raises(LeaseExpired):
        clock.ensure()


def test_a_late_answer_to_an_older_renewal_never_moves_the_lease_back() -> None:
    now = FakeClock()
    clock = lease_clock(now)
    clock.renewed(now.now + 5.0)
    extended = clock.expires_at
    clock.renewed(now.now + 1.0)  # an earlier renewal, answered after the later one
    clock.renewed(now.now - 100.0)
    assert clock.expires_at == extended
    now.now += 15.0  # past the original lease's margin, inside the renewed one
    clock.ensure()


def test_a_lost_claim_fails_the_next_check_at_once() -> None:
    now = FakeClock()
    clock = lease_clock(now)
    clock.ensure()
    clock.lost()
    with pytest.raises(LeaseExpired) as caught:
        clock.ensure()
    assert caught.value.over_by == math.inf


def test_a_paused_process_wakes_to_an_expired_clock_without_any_renewal() -> None:
    now = FakeClock()
    clock = lease_clock(now)
    now.now += 3600.0  # a stopped VM, a long GC pause: nobody told it the claim moved on
    with pytest.raises(LeaseExpired) as caught:
        clock.ensure()
    assert caught.value.over_by == pytest.approx(3600.0 - 10.0)


def test_lease_expired_is_a_stop_not_an_error_a_tool_can_swallow() -> None:
    assert issubclass(LeaseExpired, BaseException)
    assert not issubclass(LeaseExpired, Exception)
    assert not issubclass(LeaseExpired, TorenError)
    now = FakeClock()
    clock = lease_clock(now)
    clock.lost()
    swallowed: list[Exception] = []

    def careless_tool() -> str:
        try:
            clock.ensure()
        except Exception as exc:  # what user code writes around a flaky upstream
            swallowed.append(exc)
            return "carried on"
        return "effect"

    with pytest.raises(LeaseExpired):
        careless_tool()
    assert swallowed == []


def test_tool_context_outside_a_worker_has_no_lease_to_check() -> None:
    ctx = ToolContext(run_id="run/1", tool_call_id="c1", idempotency_key="k1")
    assert ctx.fencing_token == 0
    assert ctx.ensure_lease() is None  # a tool called directly (in a unit test) just runs


def test_tool_context_checks_the_lease_it_was_given() -> None:
    now = FakeClock()
    clock = lease_clock(now)
    ctx = ToolContext(
        run_id="run/1",
        tool_call_id="c1",
        idempotency_key="k1",
        fencing_token=7,
        ensure_lease=clock.ensure,
    )
    ctx.ensure_lease()
    now.now += 60.0
    with pytest.raises(LeaseExpired):
        ctx.ensure_lease()
    assert ctx.fencing_token == 7


def test_actor_context_checks_its_lease_and_is_a_no_op_without_one() -> None:
    actor: Actor[None] = Actor("a/1", {})
    Context(actor, None, 0, 1, None).ensure_lease()
    now = FakeClock()
    clock = lease_clock(now)
    ctx = Context(actor, None, 0, 1, None, lease=clock)
    ctx.ensure_lease()
    clock.lost()
    with pytest.raises(LeaseExpired):
        ctx.ensure_lease()


def test_worker_renews_only_the_clock_of_the_claim_at_the_renewed_epoch() -> None:
    from toren.supervisors.worker.hosts import HostRegistry

    settings = Settings(lease_seconds=60.0, renew_seconds=5.0)
    hosts = HostRegistry(None, uuid.uuid4(), settings)  # type: ignore[arg-type]  # no SQL here
    hosts.adopt(Claim(actor_id="a/1", kind="k", args={}, epoch=3, sent_at=100.0))
    hosts.adopt(Claim(actor_id="a/2", kind="k", args={}, epoch=1, sent_at=100.0))
    one, two = hosts._clocks["a/1"], hosts._clocks["a/2"]
    assert (one.lease, one.margin, one.expires_at) == (60.0, 5.0, 160.0)
    # a/2 was taken over and claimed again here meanwhile: a renewal held it at another epoch.
    hosts.renewed({("a/1", 3), ("a/2", 2)}, sent_at=130.0)
    assert one.expires_at == 190.0
    assert two.expires_at == 160.0
    hosts.cancel("a/1")
    with pytest.raises(LeaseExpired):
        one.ensure()
    # A renewal that was in flight when the claim was judged lost does not bring it back.
    hosts.renewed({("a/1", 3)}, sent_at=200.0)
    with pytest.raises(LeaseExpired):
        one.ensure()


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("30d", 30 * 86400.0),
        ("1d2h", 86400.0 + 7200.0),
        ("1d 2h 3m 4s", 86400.0 + 7200.0 + 180.0 + 4.0),
        ("1h30m", 5400.0),
        ("45s", 45.0),
        (90, 90.0),
        (0.5, 0.5),
    ],
)
def test_parse_duration_accepts_days_hours_minutes_seconds_and_numbers(
    text: str | float, seconds: float
) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize(
    "text",
    [
        "0s",
        "0d",
        "0d0h0m0s",
        0,
        0.0,
        -1,
        -0.5,
        "-5m",
        math.nan,
        math.inf,
        -math.inf,
        "",
        "30",
        "5 minutes",
        "1.5h",
    ],
)
def test_parse_duration_refuses_what_is_not_a_positive_finite_duration(text: str | float) -> None:
    with pytest.raises(ConfigError):
        parse_duration(text)
