"""The sandbox cells' oracle against hand-made journals and workspaces: each check can fail (no
worker, no Docker needed)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import attrs
import pytest

from chaos.oracle import Row
from chaos.sandbox import SandboxExpected, SandboxObserved, gave_up, judge_sandbox, report
from chaos.servers import SANDBOX_CALLS, STEP_PY
from toren.runs import RunState

QUICK = "$ python3 step.py quick\n[in /workspace; exit 0]\nquick done\n"
LONG = "$ python3 step.py long 1.5\n[in /workspace; exit 0]\nlong done\n"
PS = "$ ps -eo args\n[in /workspace; exit 0]\nCOMMAND\nsleep infinity\nps -eo args\n"
RECORDS = "$ ls /run/toren\n[in /workspace; exit 0]\nab12.out\nab12.pid\nab12.started\n"
LEFT = "cd34.exit\ncd34.out\n"  # a journaled command's record, never dropped
KEPT = "ef56.started\n"  # what stays of a journaled command's record, on purpose
INTERRUPTED = (
    "$ python3 step.py long 1.5\n[in /workspace; interrupted: the worker running it stopped "
    "before it finished. Exit status unknown; it was killed if it was still running, and is not "
    "run again by itself (at-most-once). Check what it did before running it again.]"
)
RECOVERED = (
    "$ python3 step.py long 1.5\n[in /workspace; exit 0; finished while its worker was "
    "stopping: the output is what was kept]\nlong done\n"
)
CLEAN = {
    "s0": ".: empty",
    "s1": "wrote 9 bytes to step.py",
    "s2": QUICK,
    "s3": LONG,
    "s4": PS,
    "s5": RECORDS,
}
LOG = ("quick start", "quick end", "long start", "long end")
EXPECTED = SandboxExpected(output="done", steps=0, results=CLEAN, log=LOG)


def _seen(
    told: dict[str, str] | None = None,
    log: tuple[str, ...] = LOG,
    *,
    open_at_fault: frozenset[str] = frozenset(),
    rerunnable: bool = False,
    gone_after: float | None = 0.5,
    gave: tuple[float, ...] = (),
) -> SandboxObserved:
    told = {**CLEAN, **(told or {})}
    journal = tuple(
        Row(i + 1, 1, "tool.result", {"call_id": c, "content": told[c], "checkpoint": "c1"}, 0.0)
        for i, c in enumerate(told)
    )
    sandbox: list[Row] = []
    for i, call in enumerate(SANDBOX_CALLS):
        for kind, at in (("command.intended", 10.0 * i), ("command.finished", 10.0 * i + 5)):
            data: dict[str, Any] = {"call_id": call.id, "at": at}
            sandbox.append(Row(len(sandbox) + 1, 1, kind, data, 0.0))
    sandbox.append(Row(len(sandbox) + 1, 1, "workspace.checkpointed", {"checkpoint": "c1"}, 0.0))
    return SandboxObserved(
        state=RunState(status="completed", output="done"),
        journal=journal,
        sandbox_journal=tuple(sandbox),
        arrivals=(),
        checkpoint="c1",
        files={"step.py": STEP_PY, "log.txt": "".join(f"{line}\n" for line in log)},
        store_problem="",
        deadletters=0,
        allowed_repeats=0,
        open_at_fault=open_at_fault,
        rerunnable=rerunnable,
        gone_after=gone_after,
        gave_up=gave,
    )


def _problems(seen: SandboxObserved) -> tuple[str, ...]:
    return judge_sandbox(seen, EXPECTED).problems


def test_the_clean_run_and_a_command_in_flight_told_interrupted_or_recovered_pass() -> None:
    assert _problems(_seen()) == ()
    cut = _seen({"s3": INTERRUPTED}, LOG[:3], open_at_fault=frozenset({"s3"}))
    assert _problems(cut) == ()
    assert _problems(_seen({"s3": RECOVERED}, open_at_fault=frozenset({"s3"}))) == ()
    assert [report(c) for c in (LONG, INTERRUPTED, RECOVERED)] == [
        "as run",
        "interrupted",
        "recovered",
    ]


def test_a_command_run_twice_is_caught_unless_the_sandbox_is_rerunnable() -> None:
    twice = ("quick start", "quick end", "long start", "long start", "long end", "long end")
    assert any("long ran 2 times" in p for p in _problems(_seen(log=twice)))
    assert _problems(_seen(log=twice, rerunnable=True)) == ()
    never = _problems(_seen(log=LOG[:2], rerunnable=True))
    assert any("long: started 0, ended 0 times" in p for p in never)


def test_an_interrupted_call_that_was_not_in_flight_or_a_rerunnable_one_is_caught() -> None:
    stray = _problems(_seen({"s3": INTERRUPTED}, LOG[:3], open_at_fault=frozenset({"s2"})))
    assert any("told interrupted, but it was not in flight" in p for p in stray)
    rerun = _problems(
        _seen({"s3": INTERRUPTED}, LOG[:3], open_at_fault=frozenset({"s3"}), rerunnable=True)
    )
    assert any("of a rerunnable sandbox told interrupted" in p for p in rerun)
    # A worker that gave its actors up by itself while the call ran explains it.
    assert _problems(_seen({"s3": INTERRUPTED}, LOG[:3], gave=(32.0,))) == ()


def test_a_result_lost_or_told_otherwise_or_a_log_that_differs_is_caught() -> None:
    lost = attrs.evolve(_seen(), journal=_seen().journal[:-1])
    assert any(
        "0 tool.result for call s5, expected one (silently lost)" in p for p in _problems(lost)
    )
    wrong = _problems(_seen({"s2": QUICK.replace("exit 0", "exit 1")}))
    assert any("call s2 told" in p for p in wrong)
    unfinished = _problems(_seen(log=LOG[:3]))
    assert any("long told as run, but started 1 and ended 0 times" in p for p in unfinished)
    recovered_early = _problems(_seen({"s3": RECOVERED}, LOG[:3], open_at_fault=frozenset({"s3"})))
    assert any("long told recovered" in p for p in recovered_early)


def test_a_command_still_running_a_container_left_or_a_dead_letter_is_caught() -> None:
    running = _problems(_seen({"s4": PS + "python3 step.py long 1.5\n"}))
    assert any("ps shows step.py" in p for p in running)
    assert any("still there 60s after its end" in p for p in _problems(_seen(gone_after=None)))
    dead = attrs.evolve(_seen(), deadletters=1)
    assert "1 messages dead-lettered" in _problems(dead)


def test_a_record_of_a_journaled_command_left_in_the_container_is_caught() -> None:
    left = _problems(_seen({"s5": RECORDS + LEFT}))
    assert any("records of 1 journaled command(s) left" in p and "cd34" in p for p in left)
    assert _problems(_seen({"s5": RECORDS + KEPT})) == ()


def test_workers_giving_up_are_read_from_their_logs() -> None:
    log = (
        "2026-12-02T03:03:38.190Z ERROR toren.worker: lease renewal keeps failing; stopping\n"
        "Traceback (most recent call last):\n"
        "2026-12-02T03:03:39.000Z INFO toren.worker: worker up\n"
        "2026-12-02T03:03:40.500Z WARNING toren.worker: sandbox/x: lease lost to another worker\n"
    )
    at = datetime(2026, 12, 2, 3, 3, 38, 190000, tzinfo=UTC).timestamp()
    assert gave_up([log]) == pytest.approx((at, at + 2.31))
