"""The kill matrix: which kill points are faulted how, and the table that shows the results."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

import attrs
from rich.table import Table

from chaos.calls import CallExpected, CallObserved
from chaos.harness import (
    DECISION_POINTS,
    FAULTS,
    HARNESS_POINTS,
    TELEGRAM_SHAPES,
    Cell,
    CellResult,
    Fault,
    Harness,
    Shape,
)
from chaos.oracle import Expected, Observed, judge
from chaos.sandbox import SandboxExpected, SandboxObserved, judge_sandbox
from chaos.schedules import BEFORE, ScheduleExpected, ScheduleObserved, calls_of, judge_schedule
from chaos.servers import SANDBOX_CALLS, SANDBOX_COMMANDS, TELEGRAM_REPLIES
from chaos.telegram import TelegramExpected, TelegramObserved, judge_telegram

# (point, occurrence): the occurrence picks a moment in the middle of the scripted run (see
# docs/chaos.md for the run's steps). A clean run is traced first (and one that sends the decision
# cells' stale, repeated and concurrent decisions, for the points in DECISION_POINTS); a cell
# whose point it does not reach that often is a harness error, reported as such.
POINTS: tuple[tuple[str, int], ...] = (
    ("actor.claiming", 1),
    ("actor.claimed", 2),  # re-activation when the approval arrives
    ("actor.rebuilt", 3),  # re-activation when the timer fires
    ("snapshot.writing", 2),
    ("snapshot.written", 2),
    # Since issue 33 a tool's intent commits with the model's answer (or the approval) that made
    # it next, one step fewer per call: these four count down to the moments they hit before.
    ("message.claimed", 4),  # model call 2's step, its request not yet sent
    ("step.committing", 2),  # the ticket's intent (with model call 1's record) about to commit
    ("step.committed", 2),  # model call 1's record and the ticket's intent committed
    ("outbox.inserted", 3),  # the ticket's result committed, model call 2 announced
    # The sleep's intent committed (its timer not yet set; the refund's intent, its moment
    # before issue 33, now commits with the approval: committed:approval.decided#1).
    ("outbox.consumed", 6),
    ("model.sending", 1),
    ("model.in_flight", 2),
    ("model.received", 3),
    ("committed:model.called", 4),
    ("committed:tool.intent", 1),  # with model call 1's record: the ticket not yet run
    ("tool.running", 2),
    ("tool.in_flight", 1),
    ("committed:tool.result", 2),
    ("committed:approval.requested", 1),  # with model call 2's record: the run parked
    ("committing:decision.refused", 1),  # the stale approval sent while the refund waits
    ("decision.received", 1),
    # The refund's approval (with its intent), with more decisions queued; then committed.
    ("committing:approval.decided", 1),
    ("committed:approval.decided", 1),
    ("committed:timer.set", 1),
    ("timer.fired", 1),
    ("committed:timer.fired", 1),
    ("committing:run.completed", 1),
    ("committed:run.completed", 1),
    ("lease.renewing", 1),
    ("lease.renewed", 1),
    ("shutdown.draining", 1),
    ("shutdown.released", 1),
)

# SIGSTOP past the lease, then SIGCONT: where the zombie has a write to attempt when continued.
SIGSTOP_AT = frozenset(
    {
        "message.claimed",
        "snapshot.writing",
        "step.committing",
        "model.in_flight",
        "model.received",
        "tool.running",
        "committing:decision.refused",
        "decision.received",
        "committing:approval.decided",
        "committing:run.completed",
        "lease.renewing",
    }
)

# After the worker drained and released its leases it holds no session to terminate.
NO_SESSIONS = frozenset({"shutdown.released"})


# The early cells: the chaos agent's run told something before a worker handled its start (a
# say() right after start_run; the message is taken first, sent again behind the start, heard
# after the input). Its first steps: the message sent again (step 1, no event), the start, the
# message heard, then the run as in the plain cells.
EARLY_POINTS: tuple[tuple[str, int, tuple[Fault, ...]], ...] = (
    ("step.committed", 1, ("sigkill",)),  # the message sent again behind the start
    ("committed:run.started", 1, ("sigkill", "pg_terminate")),
    ("committing:message.received", 1, ("sigkill",)),
)


def cells() -> list[Cell]:
    out = []
    for point, k in POINTS:
        out.append(Cell(point, k, "sigkill"))
        if point not in NO_SESSIONS:
            out.append(Cell(point, k, "pg_terminate"))
        if point in SIGSTOP_AT:
            out.append(Cell(point, k, "sigstop"))
    out.extend(Cell(p, k, f, shape="early") for p, k, faults in EARLY_POINTS for f in faults)
    return out


# The cross-agent call cells: (point, occurrence, faults). The victim runs the caller and its
# child; its model requests come in this order: the caller's first (1), the child's two (2, 3),
# the caller's answer (4); the first run.completed is the child's. Each phase of the call: the
# caller before its child starts, the child started and not yet running, the child mid-run, the
# child done and its caller not yet resumed, the caller recording the child's end.
CALL_POINTS: tuple[tuple[str, int, tuple[Fault, ...]], ...] = (
    ("child.starting", 1, ("sigkill",)),
    ("committed:child.started", 1, ("sigkill", "pg_terminate")),
    ("model.in_flight", 2, ("sigkill",)),  # the child's first call, at the server
    ("model.received", 3, ("sigkill",)),  # the child's answer, in hand, not recorded
    ("committed:run.completed", 1, ("sigkill", "pg_terminate")),  # the child's end
    ("child.finished", 1, ("sigkill", "pg_terminate", "sigstop")),
    ("committed:child.finished", 1, ("sigkill",)),
)


def call_cells() -> list[Cell]:
    return [Cell(p, k, f, shape="call") for p, k, faults in CALL_POINTS for f in faults]


# The sandbox cells: (point, occurrence, faults, shape). The victim runs the run and its sandbox;
# the sandboxed calls are s0 list_files (it makes the container), s1 write_file, s2 the quick
# command, s3 the long one, s4 ps, s5 ls of the commands' records, one per model step. Every
# call passes the sandbox's points in turn (executing, executed, and for s1-s5 checkpointing),
# so the k-th executing is call s{k-1} and the k-th checkpointing call s{k}.
SANDBOX_POINTS: tuple[tuple[str, int, tuple[Fault, ...], Shape], ...] = (
    # the run's first call sent, its sandbox spawned in the same commit, not yet running
    ("committed:sandbox.requested", 1, ("sigkill",), "sandbox"),
    ("sandbox.creating", 1, ("sigkill", "pg_terminate"), "sandbox"),  # no container yet
    ("sandbox.starting", 1, ("sigkill",), "sandbox"),  # created, not started, not recorded
    ("committed:sandbox.created", 1, ("sigkill",), "sandbox"),
    ("committing:command.intended", 3, ("sigkill",), "sandbox"),  # the quick command's
    ("committed:command.intended", 3, ("sigkill",), "sandbox"),
    ("sandbox.executing", 3, ("sigkill", "pg_terminate", "sigstop"), "sandbox"),
    ("sandbox.executed", 3, ("sigkill", "pg_terminate", "sigstop"), "sandbox"),
    ("sandbox.checkpointing", 2, ("sigkill", "pg_terminate"), "sandbox"),  # the quick one's
    ("committed:workspace.checkpointed", 2, ("sigkill",), "sandbox"),
    ("sandbox.in_flight", 1, ("sigkill", "pg_terminate", "sigstop"), "sandbox"),
    ("sandbox.executed", 4, ("sigkill",), "sandbox"),
    ("committing:command.finished", 4, ("sigkill", "pg_terminate"), "sandbox"),
    ("committed:command.finished", 4, ("sigkill",), "sandbox"),
    # declared rerunnable: the command in flight runs again
    ("sandbox.in_flight", 1, ("sigkill",), "rerunnable"),
    ("sandbox.executed", 4, ("sigkill",), "rerunnable"),
)


def sandbox_cells() -> list[Cell]:
    return [Cell(p, k, f, shape=shape) for p, k, faults, shape in SANDBOX_POINTS for f in faults]


# The Telegram cells: (point, occurrence, faults), each for both deliveries (the cell's shape),
# and those of at-most-once delivery alone. The victim runs the channel and the conversation run;
# its sends, in queue order: 1 the pairing notice, 2 answer 1, 3-5 answer 2's three pieces, 6
# answer 3; its update.handled commits: 1 the pairing and message 1 (its first poll), 2 message 2,
# 3 message 3. The held sends (telegram.in_flight, telegram.delivered) are answer 2's first piece.
TELEGRAM_POINTS: tuple[tuple[str, int, tuple[Fault, ...]], ...] = (
    ("telegram.polled", 1, ("sigkill", "pg_terminate")),  # /pair and message 1, not recorded
    ("committed:update.handled", 1, ("sigkill",)),  # paired, the run started: recorded
    ("committed:update.handled", 2, ("sigkill", "pg_terminate")),  # message 2 sent to the run
    ("telegram.sending", 4, ("sigkill", "pg_terminate")),  # answer 2's second piece, about to go
    ("telegram.in_flight", 1, ("sigkill", "pg_terminate")),  # held before Telegram acts on it
    ("telegram.delivered", 1, ("sigkill",)),  # Telegram delivered it; its answer held
    ("telegram.sent", 4, ("sigkill", "pg_terminate")),  # delivered, its delivery not recorded
)
# At most once: the piece recorded sending, its send step (channel.send) not yet handled.
AT_MOST_ONCE_POINTS: tuple[tuple[str, int, tuple[Fault, ...]], ...] = (
    ("committed:outbox.sending", 4, ("sigkill",)),
)


# The interrupted chat (at least once): message 2 is sent to the run while the model answers
# message 1. Answer 1 and the end of its turn commit together (run.completed#1), then the run
# takes message 2 (message.received#1); the chat must get every answer, each once, in order.
INTERRUPTED_POINTS: tuple[tuple[str, int, tuple[Fault, ...]], ...] = (
    ("committed:run.completed", 1, ("sigkill", "pg_terminate")),
    ("committed:message.received", 1, ("sigkill",)),
)


def telegram_cells() -> list[Cell]:
    both: list[tuple[str, int, Fault, Shape]] = [
        (p, k, f, shape)
        for p, k, faults in TELEGRAM_POINTS
        for f in faults
        for shape in TELEGRAM_SHAPES
    ]
    once: list[tuple[str, int, Fault, Shape]] = [
        (p, k, f, "at_most_once") for p, k, faults in AT_MOST_ONCE_POINTS for f in faults
    ]
    interrupted: list[tuple[str, int, Fault, Shape]] = [
        (p, k, f, "interrupted") for p, k, faults in INTERRUPTED_POINTS for f in faults
    ]
    return [Cell(p, k, f, shape=shape) for p, k, f, shape in both + once + interrupted]


# The schedule cells: the victim fires the ticker's slots alone; its third firing (two slots
# started before it) is faulted before and after the commit that spawns the slot's run, sends it
# its start and records the slot; two more workers join at the fault.
SCHEDULE_POINTS: tuple[tuple[str, int, tuple[Fault, ...]], ...] = (
    ("committing:schedule.slot_started", 3, FAULTS),
    ("committed:schedule.slot_started", 3, FAULTS),
)


def schedule_cells() -> list[Cell]:
    return [Cell(p, k, f, shape="schedule") for p, k, faults in SCHEDULE_POINTS for f in faults]


# Each mutation runs where the protection it removes is what saves the run.
MUTATION_CELLS: dict[str, tuple[Cell, ...]] = {
    # Not tool.running: there the zombie's own lease clock stops it before the tool runs.
    "no-fencing": (
        Cell("step.committing", 2, "sigstop"),
        Cell("model.received", 3, "sigstop"),
        Cell("decision.received", 1, "sigstop"),
        Cell("committing:approval.decided", 1, "sigstop"),
    ),
    "effect-before-intent": (
        Cell("committed:tool.intent", 1, "sigkill"),
        Cell("tool.running", 2, "sigkill"),
        Cell("tool.in_flight", 1, "sigkill"),
    ),
    "consume-on-claim": (
        Cell("message.claimed", 4, "sigkill"),
        Cell("model.received", 3, "sigkill"),
        Cell("model.in_flight", 2, "pg_terminate"),
    ),
    # Decision cells send a stale approval (for the ticket's call) before the refund's own:
    # applied to the waiting refund, it approves it for a sender who meant another call.
    "unbound-decisions": (
        Cell("committing:approval.decided", 1, "sigkill"),
        Cell("committing:approval.decided", 1, "sigstop"),
        Cell("decision.received", 1, "pg_terminate"),
    ),
    # The child's end sent after its run.completed committed, not with it: a crash between the
    # two leaves the caller parked for ever.
    "child-end-after-commit": (Cell("committed:run.completed", 1, "sigkill", shape="call"),),
    # The long command ran (or runs) when its worker died: looked for, it is reported; run again,
    # the workspace's log shows it twice.
    "sandbox-runs-again": (
        Cell("sandbox.executed", 4, "sigkill", shape="sandbox"),
        Cell("sandbox.in_flight", 1, "sigkill", shape="sandbox"),
    ),
    # The updates of a poll confirmed to Telegram (the next getUpdates' offset) before they are
    # recorded: a crash in between and Telegram never gives them again.
    "telegram-confirm-before-record": (
        Cell("telegram.polled", 1, "sigkill", shape="at_least_once"),
    ),
    # At-most-once without its sending record: a crash between a send and its record sends the
    # piece again.
    "telegram-send-unrecorded": (
        Cell("telegram.sent", 4, "sigkill", shape="at_most_once"),
        Cell("telegram.delivered", 1, "sigkill", shape="at_most_once"),
    ),
    # The call at the server when its worker died, made again with nothing announced: the
    # journal counts one request fewer than the server received.
    "calls-unannounced": (
        Cell("model.in_flight", 2, "sigkill"),
        Cell("model.received", 3, "sigkill"),
    ),
    # The chat writes while the model answers: the answer's turn ends after the message came.
    "turn-ends-later": (Cell("committed:message.received", 1, "sigkill", shape="interrupted"),),
    # Told something before its start: recorded at once, the start's fold leaves it out.
    "early-message-dropped": (Cell("committed:run.started", 1, "sigkill", shape="early"),),
    # A slot's run under a fresh id: the faults start each slot once all the same (the step that
    # spawns it commits once), but the backfill over the window starts a second run per slot.
    "schedule-slot-unkeyed": (
        Cell("committed:schedule.slot_started", 3, "sigkill", shape="schedule"),
    ),
    # The move to another version taken by replay though the policy says by value: the calls
    # of the old version are checked against the new one's requests and paid again.
    "upgrade-by-replay": (Cell("committed:run.upgraded", 1, "sigkill", shape="upgrade"),),
    # The fork's journal copied one event short (the ticket's result left out): the fork runs
    # the ticket's call again, under its source's key, whatever the fault.
    "fork-prefix-short": (Cell("committed:model.called", 1, "sigkill", shape="fork"),),
    # The batch's members told it landed as soon as it left: they go on from steps that are not
    # committed yet and, the batch refused, never are, and write after them.
    "ack-before-commit": (Cell("batch.sending", 2, "refuse_one", shape="batch"),),
}


# What a red cell must show for its mutation to count as caught: the failure the mutation stands
# for, not another one (a mutation that broke the worker outright would turn every cell red).
MUTATION_EVIDENCE: dict[str, str] = {
    "no-fencing": "stale write",
    "effect-before-intent": "applied before its tool.intent was recorded",
    "consume-on-claim": "stuck: the run is still running",
    "unbound-decisions": "was applied to call",
    "child-end-after-commit": "its caller never recorded its end",
    "sandbox-runs-again": "ran 2 times",
    "telegram-confirm-before-record": "handled 0 times, expected once (lost)",
    "telegram-send-unrecorded": "delivered twice, in an at-most-once cell",
    "calls-unannounced": "made and 0 lost in flight",
    "turn-ends-later": "never ended its turn",
    "early-message-dropped": "heard out of place",
    "schedule-slot-unkeyed": "the backfill started a second run for slot",
    "upgrade-by-replay": "calls taken by value were re-asked",
    "fork-prefix-short": "the source's effects were asked for again",
    "ack-before-commit": "journal sequence not contiguous",
}


def caught(mutation: str, result: CellResult) -> bool:
    """Whether ``result`` (a cell run under ``mutation``) is red for the mutation's reason."""
    return any(MUTATION_EVIDENCE[mutation] in problem for problem in result.problems)


def verdict(result: CellResult) -> str:
    if not result.passed:
        return "[red]FAIL[/red]"
    seen = f" ({result.note})" if result.note else ""
    if result.duplicate_calls:
        return (
            f"[green]pass[/green] +{result.duplicate_calls} call (${result.duplicate_usd:.6f})"
            f"{seen}"
        )
    return f"[green]pass[/green]{seen}"


def table(results: Iterable[CellResult], title: str) -> Table:
    """Kill point by fault: pass or FAIL, and the duplicate spend of each cell."""
    results = list(results)
    by_cell = {(r.cell.label, r.cell.fault): r for r in results}
    grid = Table(title=title, title_justify="left")
    grid.add_column("kill point")
    # The three faults, and any other the results hold (the batch cells' fence_one, refuse_one)
    more = dict.fromkeys(r.cell.fault for r in results if r.cell.fault not in (*FAULTS, None))
    faults = [*FAULTS, *(f for f in more if f is not None)]
    for fault in faults:
        grid.add_column(fault)
    seen: list[str] = []
    for r in results:
        if r.cell.label not in seen:
            seen.append(r.cell.label)
    for label in seen:
        row = [label]
        for fault in faults:
            found = by_cell.get((label, fault))
            row.append(verdict(found) if found else "[dim]-[/dim]")
        grid.add_row(*row)
    return grid


def summary(results: Iterable[CellResult]) -> str:
    results = list(results)
    failed = [r for r in results if not r.passed]
    dup_calls = sum(r.duplicate_calls for r in results)
    dup_usd = sum((r.duplicate_usd for r in results), start=0)
    return (
        f"{len(results)} cells, {len(results) - len(failed)} passed, {len(failed)} failed; "
        f"duplicate spend {dup_calls} model calls (${dup_usd:.6f}), all of them calls in "
        "flight at the fault"
        if not failed
        else f"{len(results)} cells, {len(failed)} FAILED; duplicate spend {dup_calls} calls"
    )


async def clean_run(harness: Harness) -> Expected:
    """Run the scenario without a fault, twice: plain (the expected result), and with the
    decision cells' extra decisions (which must pass the oracle too); check that each reaches
    every point of its cells as often as they need.

    Raises:
        RuntimeError: a clean run failed, or misses a point (the matrix is out of date).
    """
    plain = Cell("clean", 0, None)
    result, seen = await harness.run_cell(plain, None)
    if not isinstance(seen, Observed):
        raise TypeError("the clean run observed as a call")
    if not result.passed or seen.state.status != "completed":
        raise RuntimeError(f"the clean run failed: {result.problems} {seen.state.error}")
    expected = Expected(
        output=seen.state.output or "",
        steps=len(seen.state.calls),
        effect_kinds=tuple(sorted(e.kind for e in seen.effects)),
    )
    deciding = Cell("clean", 0, None, decisions=True)
    result, seen = await harness.run_cell(deciding, None)
    if not isinstance(seen, Observed):
        raise TypeError("the clean run observed as a call")
    verdict = judge(seen, expected)
    if not result.passed or verdict.problems:
        raise RuntimeError(
            f"the clean run with extra decisions failed: {[*result.problems, *verdict.problems]}"
        )
    traces = {
        cell.decisions: Counter((harness.workdir / cell.slug / "trace").read_text().split())
        for cell in (plain, deciding)
    }
    timing = ("lease.", "shutdown.")  # reached by the clock or by SIGTERM, not by the script
    short = []
    for p, k in POINTS:
        trace = traces[p in DECISION_POINTS]
        if p not in HARNESS_POINTS and not p.startswith(timing) and trace[p] < k:
            short.append(f"{p}#{k} (reached {trace[p]} times)")
    if short:
        raise RuntimeError(f"the clean run does not reach: {', '.join(short)}")
    early = Cell("clean", 0, None, shape="early")
    result, seen = await harness.run_cell(early, expected)
    if not result.passed:
        raise RuntimeError(f"the clean early run failed: {list(result.problems)}")
    short = _unreached(harness, early, [(p, k) for p, k, _ in EARLY_POINTS])
    if short:
        raise RuntimeError(f"the clean early run does not reach: {', '.join(short)}")
    return expected


async def clean_call_run(harness: Harness) -> CallExpected:
    """Run the cross-agent call without a fault (the expected result) and check that it reaches
    every point of the call cells as often as they need.

    Raises:
        RuntimeError: the clean run failed, or misses a point (the cells are out of date).
    """
    cell = Cell("clean", 0, None, shape="call")
    result, seen = await harness.run_cell(cell, None)
    if not isinstance(seen, CallObserved):
        raise TypeError("the clean call run observed as a plain run")
    if not result.passed or seen.state.status != "completed" or len(seen.children) != 1:
        raise RuntimeError(
            f"the clean call run failed: {result.problems} {seen.state.error} "
            f"({len(seen.children)} child runs)"
        )
    child = seen.children[0]
    expected = CallExpected(
        output=seen.state.output or "",
        steps=len(seen.state.calls),
        child_output=child.state.output or "",
        child_steps=len(child.state.calls),
        effect_kinds=tuple(sorted(e.kind for e in seen.effects)),
    )
    short = _unreached(harness, cell, [(p, k) for p, k, _ in CALL_POINTS])
    if short:
        raise RuntimeError(f"the clean call run does not reach: {', '.join(short)}")
    return expected


async def clean_sandbox_run(harness: Harness) -> SandboxExpected:
    """Run the sandboxed agent without a fault (the expected result) and check that it reaches
    every point of the sandbox cells as often as they need.

    Raises:
        RuntimeError: the clean run failed, or misses a point (the cells are out of date).
    """
    cell = Cell("clean", 0, None, shape="sandbox")
    result, seen = await harness.run_cell(cell, None)
    if not isinstance(seen, SandboxObserved):
        raise TypeError("the clean sandbox run observed as another shape")
    results = {
        r.data["call_id"]: r.data["content"] for r in seen.journal if r.type == "tool.result"
    }
    if (
        not result.passed
        or seen.state.status != "completed"
        or sorted(results) != sorted(c.id for c in SANDBOX_CALLS)
        or seen.store_problem
        or seen.gone_after is None
    ):
        raise RuntimeError(
            f"the clean sandbox run failed: {result.problems} {seen.state.error} "
            f"(results {sorted(results)}; {seen.store_problem or 'workspace read'}; "
            f"container gone after {seen.gone_after}s)"
        )
    expected = SandboxExpected(
        output=seen.state.output or "",
        steps=len(seen.state.calls),
        results=results,
        log=tuple(seen.files.get("log.txt", "").splitlines()),
    )
    ran = tuple(f"{name} {end}" for name in SANDBOX_COMMANDS for end in ("start", "end"))
    problems = list(judge_sandbox(seen, expected).problems)
    if expected.log != ran:
        problems.append(f"log.txt holds {list(expected.log)}, expected {list(ran)}")
    if problems:
        raise RuntimeError(f"the clean sandbox run is not what its oracle expects: {problems}")
    short = _unreached(harness, cell, [(p, k) for p, k, _, _ in SANDBOX_POINTS])
    if short:
        raise RuntimeError(f"the clean sandbox run does not reach: {', '.join(short)}")
    return expected


async def clean_telegram_run(harness: Harness) -> TelegramExpected:
    """Run the Telegram chat without a fault, with each delivery (the expected result: the same
    but for the agent's name in the pairing notice), and check that each reaches every point of
    its cells as often as they need.

    Raises:
        RuntimeError: a clean run failed, is not the chat the cells count on, or misses a point.
    """
    found: list[TelegramExpected] = []
    for shape in TELEGRAM_SHAPES:
        cell = Cell("clean", 0, None, shape=shape)
        result, seen = await harness.run_cell(cell, None)
        if not isinstance(seen, TelegramObserved):
            raise TypeError("the clean Telegram run observed as another shape")
        queued = tuple(
            row.data["text"] for row in seen.channel_journal if row.type == "outbox.queued"
        )
        expected = TelegramExpected(
            output=seen.state.output or "",
            steps=len(seen.state.calls),
            queued={shape: queued},
            outcomes=tuple(
                row.data["outcome"] for row in seen.channel_journal if row.type == "update.handled"
            ),
        )
        problems = [*result.problems, *judge_telegram(seen, expected).problems]
        answers = (queued[1], "".join(queued[2:5]), queued[5]) if len(queued) == 6 else ()
        if answers != TELEGRAM_REPLIES or not queued[0].startswith("Paired with"):
            problems.append(
                f"queued {[q[:30] for q in queued]}: not the pairing notice, then the three "
                "answers, the second in three pieces"
            )
        first = found[0] if found else expected
        if (first.output, first.steps, first.outcomes) != (
            expected.output,
            expected.steps,
            expected.outcomes,
        ):
            problems.append(f"the clean runs of the two deliveries differ: {first} {expected}")
        if problems:
            raise RuntimeError(f"the clean {shape} Telegram run failed: {problems}")
        points = [(p, k) for p, k, _ in TELEGRAM_POINTS]
        if shape == "at_most_once":
            points += [(p, k) for p, k, _ in AT_MOST_ONCE_POINTS]
        short = _unreached(harness, cell, points)
        if short:
            raise RuntimeError(f"the clean {shape} Telegram run does not reach: {', '.join(short)}")
        found.append(expected)
    queued = {shape: q for e in found for shape, q in e.queued.items()}
    expected = attrs.evolve(found[0], queued=queued)
    # The interrupted chat ends as the plain one does: every answer queued once, in order.
    interrupted = Cell("clean", 0, None, shape="interrupted")
    result, _ = await harness.run_cell(interrupted, expected)
    if not result.passed:
        raise RuntimeError(f"the clean interrupted Telegram run failed: {list(result.problems)}")
    short = _unreached(harness, interrupted, [(p, k) for p, k, _ in INTERRUPTED_POINTS])
    if short:
        raise RuntimeError(f"the clean interrupted Telegram run does not reach: {', '.join(short)}")
    return expected


async def clean_schedule_run(harness: Harness) -> ScheduleExpected:
    """Run a schedule cell without a fault (three workers, the pause and the backfill): every
    run alike, the oracle satisfied, the victim's firings enough for the cells' occurrences.

    Raises:
        RuntimeError: the clean cell failed, or misses a point (the cells are out of date).
    """
    cell = Cell("clean", 0, None, shape="schedule")
    result, seen = await harness.run_cell(cell, None)
    if not isinstance(seen, ScheduleObserved):
        raise TypeError("the clean schedule cell observed as another shape")
    calls = calls_of(seen)
    if not result.passed or len(calls) != 1 or len(seen.runs) < BEFORE:
        raise RuntimeError(
            f"the clean schedule cell failed: {result.problems} ({len(seen.runs)} runs, model "
            f"calls per run {dict(calls)})"
        )
    expected = ScheduleExpected(steps=next(iter(calls)))
    problems = judge_schedule(seen, expected).problems
    if problems:
        raise RuntimeError(f"the clean schedule cell is not what its oracle expects: {problems}")
    short = _unreached(harness, cell, [(p, k) for p, k, _ in SCHEDULE_POINTS])
    if short:
        raise RuntimeError(f"the clean schedule cell does not reach: {', '.join(short)}")
    return expected


def _unreached(harness: Harness, clean: Cell, points: list[tuple[str, int]]) -> list[str]:
    """The points (with their occurrence) that the clean run ``clean`` traced too few times."""
    trace = Counter((harness.workdir / clean.slug / "trace").read_text().split())
    return [
        f"{p}#{k} (reached {trace[p]} times)"
        for p, k in points
        if p not in HARNESS_POINTS and trace[p] < k
    ]
