"""The schedule cells' oracle against hand-made journals and runs: each check can fail (no
worker needed)."""

from __future__ import annotations

from typing import Any

import attrs

from chaos.matrix import MUTATION_EVIDENCE
from chaos.oracle import Row, Takeover
from chaos.schedules import ScheduledRun, ScheduleExpected, ScheduleObserved, judge_schedule
from chaos.servers import schedule_answer
from toren.schedules import slot_key

T0 = 1_796_000_000.0  # a whole second: the ticker's slots are T0 + 1, T0 + 2, ...
SLOTS = tuple(T0 + i for i in range(1, 6))
EXPECTED = ScheduleExpected(steps=1)


def run_id(slot: float, copy: int = 0) -> str:
    return f"run/{int(slot)}-{copy}"


def _rows(*events: tuple[str, dict[str, Any]], epoch: int = 1) -> tuple[Row, ...]:
    return tuple(Row(i + 1, epoch, kind, data, 0.0) for i, (kind, data) in enumerate(events))


def started(slot: float, how: str = "on_time", copy: int = 0) -> tuple[str, dict[str, Any]]:
    data = {"slot": slot, "key": slot_key(slot), "run": run_id(slot, copy), "how": how, "at": slot}
    return ("schedule.slot_started", data)


def skipped(slot: float) -> tuple[str, dict[str, Any]]:
    data = {"slot": slot, "key": slot_key(slot), "reason": "its run was started already"}
    return ("schedule.slot_skipped", {**data, "at": slot})


def ran(slot: float, copy: int = 0, **changes: Any) -> ScheduledRun:
    text = f"tick {slot_key(slot)}"
    seen = ScheduledRun(
        run=run_id(slot, copy),
        slot=slot_key(slot),
        status="completed",
        input=text,
        output=schedule_answer(text),
        error="",
        calls=1,
        started=1,
        backfilled=False,
    )
    return attrs.evolve(seen, **changes)


def _seen(
    slots: tuple[float, ...] = SLOTS,
    runs: tuple[ScheduledRun, ...] | None = None,
    backfill: tuple[tuple[str, dict[str, Any]], ...] | None = None,
    **changes: Any,
) -> ScheduleObserved:
    """A cell as observed: the slots started (one run each), the pause, then a backfill of the
    window that skipped every slot (or ``backfill``'s events)."""
    events: list[tuple[str, dict[str, Any]]] = [("schedule.declared", {"at": T0 + 0.2})]
    events += [started(s) for s in slots]
    events.append(("schedule.paused", {"reason": "over", "at": T0 + 9}))
    cut = len(events)
    events += backfill if backfill is not None else [skipped(s) for s in SLOTS]
    seen = ScheduleObserved(
        slots=tuple(slot_key(s) for s in SLOTS),
        journal=_rows(*events),
        backfill_seq=cut,
        runs=runs if runs is not None else tuple(ran(s) for s in slots),
        deadletters=0,
        takeover=None,
    )
    return attrs.evolve(seen, **changes)


def problems(seen: ScheduleObserved) -> tuple[str, ...]:
    return judge_schedule(seen, EXPECTED).problems


def test_a_clean_cell_passes() -> None:
    assert problems(_seen()) == ()


def test_a_slot_with_two_runs_is_red() -> None:
    runs = (*(ran(s) for s in SLOTS), ran(SLOTS[2], copy=1))
    assert any(f"slot {slot_key(SLOTS[2])} started 2 runs" in p for p in problems(_seen(runs=runs)))


def test_a_slot_with_no_run_and_no_record_is_red() -> None:
    kept = SLOTS[:2] + SLOTS[3:]
    found = problems(_seen(slots=kept))
    assert found == (
        f"slot {slot_key(SLOTS[2])} started no run and the schedule's journal never names it",
    )


def test_a_slot_missed_by_the_record_is_accounted_for() -> None:
    kept = SLOTS[:2] + SLOTS[3:]
    seen = _seen(slots=kept)
    missed = Row(
        len(seen.journal) + 1,
        1,
        "schedule.slots_missed",
        {"count": 1, "first": SLOTS[2], "last": SLOTS[2], "at": SLOTS[3]},
        0.0,
    )
    journal = (*seen.journal[: seen.backfill_seq], missed)
    journal = tuple(attrs.evolve(r, seq=i + 1) for i, r in enumerate(journal))
    assert problems(attrs.evolve(seen, journal=journal, backfill_seq=len(journal))) == ()


def test_a_slot_recorded_started_without_its_run_is_red() -> None:
    runs = tuple(ran(s) for s in SLOTS if s != SLOTS[1])
    assert any("which does not exist" in p for p in problems(_seen(runs=runs)))


def test_a_slot_recorded_started_twice_is_red() -> None:
    seen = _seen()
    twice = Row(0, 1, *started(SLOTS[0]), 0.0)
    journal = (*seen.journal[: seen.backfill_seq], twice)
    journal = tuple(attrs.evolve(r, seq=i + 1) for i, r in enumerate(journal))
    found = problems(attrs.evolve(seen, journal=journal, backfill_seq=len(journal)))
    assert any("recorded started 2 times" in p for p in found)


def test_a_run_started_twice_or_stuck_or_failed_is_red() -> None:
    runs = (
        ran(SLOTS[0], started=2),
        ran(SLOTS[1], status="running"),
        ran(SLOTS[2], status="failed", error="provider"),
        ran(SLOTS[3], output="something else"),
        *(ran(s) for s in SLOTS[4:]),
    )
    found = problems(_seen(runs=runs))
    assert any("started 2 times" in p for p in found)
    assert any(p.startswith("stuck: run") for p in found)
    assert any("failed: provider" in p for p in found)
    assert any("answered 'something else'" in p for p in found)


def test_a_run_outside_the_window_is_red() -> None:
    runs = (*(ran(s) for s in SLOTS), ran(T0 + 60))
    assert any("not a slot of the window" in p for p in problems(_seen(runs=runs)))


def test_a_backfill_that_starts_second_runs_is_red_for_the_mutation() -> None:
    runs = (*(ran(s) for s in SLOTS), ran(SLOTS[0], copy=1, backfilled=True))
    backfill = (started(SLOTS[0], how="backfill", copy=1), *(skipped(s) for s in SLOTS[1:]))
    found = problems(_seen(runs=runs, backfill=backfill))
    assert any(MUTATION_EVIDENCE["schedule-slot-unkeyed"] in p for p in found)


def test_a_dead_letter_and_a_stale_write_are_red() -> None:
    seen = _seen(deadletters=1, takeover=Takeover(seq=3, epoch=2))
    found = problems(seen)
    assert "1 messages dead-lettered" in found
    assert any("stale write" in p for p in found)
