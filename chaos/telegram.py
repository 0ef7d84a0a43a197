"""The Telegram cells: a chat with an agent through its bot, the worker faulted at each phase of
an update's handling and of a message's delivery, judged by what the chat received.

Each cell has its own Bot API server (:class:`toren.testing.telegram_server.TelegramServer`, in
the harness's event loop), bot token and chat; its shape is the bot's delivery (the ``chatty``
agent delivers at least once, ``chatty_once`` at most once, see :mod:`chaos.app`). Before any
worker runs, the harness creates the bot's channel actor as a worker would and puts a pairing
code's issue in its mailbox as ``toren channels pair`` does, and the user sends ``/pair CODE``
and the first message: the victim's first poll brings both, and its first ``update.handled``
commit pairs the chat and starts the conversation run. The user writes again each time the
previous answer has reached the chat (every piece of it sent or failed): three messages, three
answers (:data:`chaos.servers.TELEGRAM_REPLIES`), the second in three pieces. So the victim's
sends are, in queue order: 1 the pairing notice, 2 answer 1, 3-5 answer 2's pieces, 6 answer 3
(``telegram.sending#4`` is answer 2's second piece), and its ``update.handled`` commits: 1 the
pairing and message 1, 2 message 2, 3 message 3.

Two points are the server's: ``telegram.in_flight`` holds answer 2's first piece before Telegram
acts on it (the worker killed meanwhile, the message is never delivered) and
``telegram.delivered`` delivers it and holds the answer (the worker never learns it went out).

What must hold after a cell (:func:`judge_telegram`):

- every update pushed has exactly one ``update.handled`` in the channel's journal, each with the
  clean run's outcome (paired, started, forwarded); every message of the user reached the run
  once, in order (its ``run.started`` input, then its ``message.received`` events);
- the run completed with the clean run's answer; every model call made once, plus the repeats
  the cell allows (the call in flight at the fault); none sent again once recorded;
- the outbox queued what the clean run queued, each piece once, in the same order; each piece
  has exactly one ``outbox.sent`` or ``outbox.failed``; none is pending at the end; nothing
  recorded sent that the chat never received, nothing received that was never queued;
- the chat received the pieces in queue order, a repeat of the piece just before aside;
- at-least-once: no piece lost (failed, or never received), at most one received twice per
  crash; at-most-once: no piece received twice, at most one lost per crash (recorded ``lost``,
  or never received); one piece either way per crash at most. A worker that gave its actors up
  by itself (a lease renewal starved on a loaded machine, seen in its log) counts as a crash;
- both journals contiguous, their epochs never going back; the channel's folds from its
  journal; nothing dead-lettered; the bot token nowhere in the journal, the mailboxes, the
  actors' rows, the dead letters or the workers' logs.
"""

from __future__ import annotations

import secrets
import time
import uuid
from collections import Counter
from collections.abc import Iterable, Mapping
from decimal import Decimal
from pathlib import Path
from typing import Any

import anyio
import attrs
import orjson

from chaos import app
from chaos.harness import (
    CHAOS,
    HARNESS_POINTS,
    Cell,
    CellFailed,
    CellResult,
    Harness,
    _Execution,
    _poll,
    _Recorder,
)
from chaos.oracle import Row, Verdict, duplicate_usd, journal_problems, run_problems
from chaos.processes import Worker
from chaos.sandbox import gave_up
from chaos.servers import EffectServer, position
from toren import Agent, Client
from toren._core.codec import decode
from toren.channels import (
    CHANNEL_KIND,
    ChannelState,
    IssueCode,
    Telegram,
    channel_address,
    channel_route,
    fold,
    pairing_key,
)
from toren.channels.client import new_code
from toren.runs import RunState, read_run
from toren.testing import AnthropicServer
from toren.testing import Hold as ModelHold
from toren.testing.telegram_server import Hold, TelegramServer

CHAT = 7001  # the user's private chat with the bot (each cell has its own server)
USER = 7001
HELD = ("telegram.in_flight", "telegram.delivered")  # the server's points: a send held


def delivery(shape: str) -> str:
    """The delivery of a Telegram cell's bot (an interrupted chat's is at least once)."""
    return "at_most_once" if shape == "at_most_once" else "at_least_once"


def agent(shape: str) -> Agent:
    """The agent a Telegram cell of ``shape`` talks to (its bot has the shape's delivery)."""
    return app.chatty if delivery(shape) == "at_least_once" else app.chatty_once


def bot_settings(shape: str) -> Telegram:
    """The bot of that agent."""
    found = agent(shape).telegram
    if found is None:  # pragma: no cover  (chaos.app gives both a bot)
        raise RuntimeError(f"agent {agent(shape).name} has no Telegram bot")
    return found


def said(case: str) -> tuple[str, ...]:
    """What the user writes, in turn (the first starts the conversation; ``case`` makes it the
    cell's own)."""
    return (f"case {case}: my parcel never came", "tell me everything", "thanks")


@attrs.frozen
class TelegramExpected:
    """What the clean run did."""

    output: str
    steps: int
    queued: Mapping[str, tuple[str, ...]]  # the outbox's pieces in queue order, by delivery
    outcomes: tuple[str, ...]  # the outcome of each update, in the order handled


@attrs.frozen
class TelegramObserved:
    delivery: str
    state: RunState  # the conversation run's
    journal: tuple[Row, ...]  # the conversation run's
    channel_journal: tuple[Row, ...]
    arrivals: tuple[tuple[float, int], ...]  # (when, step) of each model request
    allowed_repeats: int
    pushed: Mapping[int, str]  # every update pushed, by id: its text
    said: tuple[str, ...]  # what the user wrote, in order
    delivered: tuple[str, ...]  # what the chat received, in order
    deadletters: int
    crashes: int  # the cell's fault (0 or 1), and every worker that gave its actors up itself
    leaks: tuple[str, ...] = ()  # where the bot token was found
    # Not known: a worker may give its actors up by itself too (see chaos.oracle.lost_problems)
    unsent: frozenset[int] | None = None


@attrs.frozen
class Outbound:
    """The channel's outbox as its journal records it, beside what the chat received."""

    queued: Mapping[int, str]  # n -> text
    sent: Counter[int]  # outbox.sent records per n
    failed: Mapping[int, tuple[str, ...]]  # n -> the reasons of its outbox.failed records
    received: Counter[int]  # how often the chat received each piece
    order: tuple[int, ...]  # the piece of each message the chat received, in order
    strangers: tuple[str, ...]  # messages the chat received that were never queued

    @property
    def duplicates(self) -> dict[int, int]:
        """Pieces received more than once: how many times too many."""
        return {n: c - 1 for n, c in sorted(self.received.items()) if c > 1}

    @property
    def lost(self) -> list[int]:
        """Pieces queued that the chat never received."""
        return [n for n in sorted(self.queued) if not self.received[n]]


def outbound(seen: TelegramObserved) -> Outbound:
    queued: dict[int, str] = {}
    sent: Counter[int] = Counter()
    failed: dict[int, tuple[str, ...]] = {}
    for row in seen.channel_journal:
        n = row.data.get("n") if isinstance(row.data, dict) else None
        if row.type == "outbox.queued" and n is not None:
            queued[n] = row.data["text"]
        elif row.type == "outbox.sent" and n is not None:
            sent[n] += 1
        elif row.type == "outbox.failed" and n is not None:
            failed[n] = (*failed.get(n, ()), row.data["reason"])
    by_text = {text: n for n, text in queued.items()}
    order = tuple(by_text[text] for text in seen.delivered if text in by_text)
    strangers = tuple(text for text in seen.delivered if text not in by_text)
    return Outbound(queued, sent, failed, Counter(order), order, strangers)


def judge_telegram(seen: TelegramObserved, expected: TelegramExpected) -> Verdict:
    problems, counts = run_problems(seen, output=expected.output, steps=expected.steps)
    if not seen.journal:
        problems.insert(0, "the chat's conversation run was never started")
    problems.extend(f"run: {p}" for p in journal_problems(seen.journal, None))
    problems.extend(f"channel: {p}" for p in journal_problems(seen.channel_journal, None))
    problems.extend(_fold_problems(seen.channel_journal))
    problems.extend(_update_problems(seen, expected))
    problems.extend(_heard_problems(seen))
    problems.extend(_answer_problems(seen))
    problems.extend(delivery_problems(seen, expected))
    if seen.deadletters:
        problems.append(f"{seen.deadletters} messages dead-lettered")
    problems.extend(f"the bot token appears in {where}" for where in seen.leaks)
    repeats = sum(n - 1 for n in counts.values())
    return Verdict(tuple(problems), repeats, duplicate_usd(seen.state, counts))


def _fold_problems(rows: Iterable[Row]) -> list[str]:
    """The channel's state folds from its journal, and leaves nothing pending."""
    state = ChannelState()
    for row in rows:
        try:
            state = fold(state, decode(row.type, row.data))
        except Exception as exc:
            return [f"the channel's journal does not fold at seq {row.seq} ({row.type}): {exc!r}"]
    if state.pending:
        return [f"messages {list(state.pending)} left pending (neither sent nor failed)"]
    return []


def _update_problems(seen: TelegramObserved, expected: TelegramExpected) -> list[str]:
    """Every update pushed handled once, as in the clean run."""
    handled = [r for r in seen.channel_journal if r.type == "update.handled"]
    times = Counter(r.data["update_id"] for r in handled)
    problems = []
    for update_id, text in sorted(seen.pushed.items()):
        if times[update_id] != 1:
            lost = " (lost)" if not times[update_id] else ""
            problems.append(
                f"update {update_id} ({text[:40]!r}) handled {times[update_id]} times, expected "
                f"once{lost}"
            )
    problems.extend(
        f"update {update_id} handled {n} times, never pushed"
        for update_id, n in sorted(times.items())
        if update_id not in seen.pushed
    )
    outcomes = tuple(r.data["outcome"] for r in handled)
    if outcomes != expected.outcomes:
        problems.append(f"updates handled as {list(outcomes)}, clean {list(expected.outcomes)}")
    return problems


def _heard_problems(seen: TelegramObserved) -> list[str]:
    """Every message of the user reached the run once, in the order written."""
    heard = [
        r.data["input"] if r.type == "run.started" else r.data["text"]
        for r in seen.journal
        if r.type in ("run.started", "message.received")
    ]
    if heard == list(seen.said):
        return []
    times = Counter(heard)
    counted = ", ".join(f"{text[:30]!r} {times[text]}x" for text in seen.said)
    return [f"the run heard {[h[:30] for h in heard]} ({counted}): each message once, in order"]


def _answer_problems(seen: TelegramObserved) -> list[str]:
    """Every answer that asked for no tool ended its turn (``run.completed``) before the run
    took another message: else the model believes the chat saw an answer it never got."""
    problems, answered = [], None
    for row in seen.journal:
        if row.type == "model.called":
            called = decode(row.type, row.data)
            answered = None if called.response.tool_calls else called.step
        elif row.type in ("run.completed", "run.failed", "steps.invalidated"):
            answered = None
        elif row.type == "message.received" and answered is not None:
            problems.append(
                f"the answer of model call {answered} never ended its turn: the run took "
                f"{str(row.data.get('text'))[:30]!r} first, and the chat never got the answer"
            )
            answered = None
    return problems


def delivery_problems(seen: TelegramObserved, expected: TelegramExpected) -> list[str]:
    """The outbox as the clean run's, each piece recorded once and received in queue order;
    duplicates only at least once, losses only at most once, one either way per crash."""
    out = outbound(seen)
    problems = []
    texts = tuple(out.queued[n] for n in sorted(out.queued))
    clean = expected.queued.get(seen.delivery, ())
    if texts != clean:
        problems.append(f"queued {_shown(texts)}, clean {_shown(clean)}")
    for n, text in sorted(out.queued.items()):
        failed = out.failed.get(n, ())
        if out.sent[n] + len(failed) != 1:
            problems.append(
                f"message {n} ({text[:30]!r}): {out.sent[n]} outbox.sent and {len(failed)} "
                "outbox.failed, expected one of them"
            )
        problems.extend(f"message {n} failed ({why})" for why in failed if why != "lost")
        if out.sent[n] and not out.received[n]:
            problems.append(f"message {n} ({text[:30]!r}) recorded sent, never received")
    problems.extend(f"the chat received {text[:40]!r}, never queued" for text in out.strangers)
    collapsed = [n for i, n in enumerate(out.order) if i == 0 or out.order[i - 1] != n]
    if collapsed != sorted(set(collapsed)):
        problems.append(f"the chat received messages out of queue order: {collapsed}")
    duplicates, lost = out.duplicates, out.lost
    if seen.delivery == "at_least_once":
        if lost:
            problems.append(f"messages {lost} never reached the chat, in an at-least-once cell")
        elif sum(duplicates.values()) > seen.crashes:
            problems.append(
                f"messages received too often {duplicates}: at most one duplicate per crash "
                f"({seen.crashes})"
            )
    else:
        if duplicates:
            times = {n: d + 1 for n, d in duplicates.items()}
            problems.append(f"messages {times} delivered twice, in an at-most-once cell")
        elif len(lost) > seen.crashes:
            problems.append(f"messages {lost} lost: at most one per crash ({seen.crashes})")
    return problems


def _shown(texts: Iterable[str]) -> list[str]:
    return [text[:24] for text in texts]


def note(seen: TelegramObserved) -> str:
    """What became of the piece in flight: received twice, lost, or recorded lost though the
    chat received it."""
    out = outbound(seen)
    parts = [f"n{n} twice" for n in out.duplicates]
    parts.extend(f"n{n} lost" for n in out.lost)
    parts.extend(
        f"n{n} recorded lost, received"
        for n, reasons in sorted(out.failed.items())
        if "lost" in reasons and out.received[n]
    )
    return ", ".join(parts)


# -- the scenario --------------------------------------------------------------------------------


@attrs.frozen
class Progress:
    """How far the chat is: answers queued, and pieces queued but neither sent nor failed."""

    answers: int
    pending: int

    def settled(self, answers: int) -> bool:
        """Whether ``answers`` answers were queued and every piece queued is done."""
        return self.answers >= answers and not self.pending


class TelegramExecution(_Execution):
    """One Telegram cell: pair the chat, converse, fault the victim at its point."""

    def __init__(
        self,
        harness: Harness,
        cell: Cell,
        folder: Path,
        client: Client,
        model: AnthropicServer,
        effects: EffectServer,
        url: str,
        recorder: _Recorder,
        server: TelegramServer,
        token: str,
    ) -> None:
        super().__init__(harness, cell, folder, client, model, effects, url, recorder)
        self.settings = bot_settings(cell.shape)
        self.server = server
        self.token = token
        self.channel = channel_address(self.settings.bot)
        self.env.update({self.settings.token_env: token, **server.env()})
        self.said = said(uuid.uuid4().hex[:8])
        self.pushed: dict[int, str] = {}
        self.hold: Hold | None = None
        # an interrupted chat: the model's first request, held while message 2 is sent
        self.asked: ModelHold | None = None
        self.hold_set = anyio.Event()

    def _push(self, text: str) -> None:
        self.pushed[self.server.push_message(CHAT, text, user_id=USER)] = text

    async def run(self) -> str:
        cell, settings = self.cell, self.settings
        # The channel actor made as a worker makes it at boot, and a code issued with the message
        # `toren channels pair` asks it (sent, not asked: nothing runs yet to answer). It waits
        # ahead of the tick the victim sends at boot (both on the system lane), so the channel
        # records the code first and its first poll brings /pair and message 1 together.
        args = {"bot": settings.bot, "agent": agent(cell.shape).name}
        await self.client.spawn(CHANNEL_KIND, self.channel, args, route=channel_route(settings.bot))
        code = new_code()
        key = await pairing_key(self.client.pool, self.env)  # as the victim will read it
        issue = IssueCode(code_hash=key.digest(code), key_id=key.id, by=CHAOS)
        await self.client.send(self.channel, issue, system=True)
        self._push(f"/pair {code}")
        self._push(self.said[0])
        victim_env = dict(self.env)
        if cell.fault is None:
            victim_env["TOREN_KILL_POINT_TRACE"] = str(self.folder / "trace")
        elif cell.point not in HARNESS_POINTS:
            victim_env["TOREN_KILL_POINT"] = f"{cell.point}#{cell.occurrence}"
            victim_env["TOREN_KILL_POINT_DIR"] = str(self.points)
        if cell.shape == "interrupted":
            self.asked = self.model.hold(1)
        victim = self.start(victim_env, "victim")
        evidence = ""
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._converse)
            try:
                if cell.fault is not None:
                    hold = await self._held()
                    await self._reach(victim, hold)
                    landed = await self._landed()
                    await self._count_in_flight()
                    fault = getattr(self, f"_{cell.fault}")
                    evidence = f"{landed}{await fault(victim, hold)}"
                await self._finish()
            except CellFailed as exc:
                self.problems.append(str(exc))
            tg.cancel_scope.cancel()
        return evidence

    # -- the user ----------------------------------------------------------------------------

    async def _converse(self) -> None:
        """Write the next message once the previous answer reached the chat; in a cell at a
        held send, hold the first send after the first answer (answer 2's first piece). In an
        interrupted chat, message 2 comes while the model is answering message 1: its request
        is held until message 2 waits in the run's mailbox."""
        for i in range(1, len(self.said)):
            if i == 1 and self.asked is not None:
                await self._interrupt(self.asked)
                continue
            while not (await self.progress()).settled(i):
                await anyio.sleep(0.05)
            if self.cell.point in HELD and self.cell.fault is not None and self.hold is None:
                delivered = self.cell.point == "telegram.delivered"
                self.hold = self.server.hold("sendMessage", delivered=delivered)
                self.hold_set.set()
            self._push(self.said[i])

    async def _interrupt(self, asked: ModelHold) -> None:
        with anyio.fail_after(30):
            await asked.arrived.wait()
        self._push(self.said[1])
        with anyio.fail_after(30):
            while not await self._forwarded():
                await anyio.sleep(0.05)
        asked.release()

    async def _forwarded(self) -> bool:
        """Whether message 2 was sent to the run (the update that carries it handled)."""
        n = await self.client.pool.fetchval(
            "SELECT count(*) FROM toren.journal WHERE actor_id = $1 AND type = 'update.handled' "
            "AND data->>'outcome' = 'forwarded'",
            self.channel,
        )
        return bool(n)

    async def progress(self) -> Progress:
        rows = await self.client.pool.fetch(
            "SELECT type, data FROM toren.journal WHERE actor_id = $1 "
            "AND type IN ('outbox.queued', 'outbox.sent', 'outbox.failed')",
            self.channel,
        )
        queued = {r["data"]["n"] for r in rows if r["type"] == "outbox.queued"}
        done = {r["data"]["n"] for r in rows if r["type"] != "outbox.queued"}
        answers = {
            r["data"]["source"]
            for r in rows
            if r["type"] == "outbox.queued" and r["data"].get("source")
        }
        return Progress(answers=len(answers), pending=len(queued - done))

    async def conversation(self) -> str:
        """The conversation run ("" before the chat's first message is handled)."""
        run = await self.client.pool.fetchval(
            "SELECT data->>'run' FROM toren.journal WHERE actor_id = $1 "
            "AND type = 'conversation.started' ORDER BY seq LIMIT 1",
            self.channel,
        )
        return str(run or "")

    # -- reaching the point -----------------------------------------------------------------

    async def _held(self) -> Hold | None:
        if self.cell.point not in HELD:
            return None
        with anyio.move_on_after(30):
            await self.hold_set.wait()
        if self.hold is None:
            raise CellFailed("the first answer never reached the chat: no send was held")
        return self.hold

    async def _reach(self, victim: Worker, hold: Any) -> None:
        def reached() -> bool:
            return hold.arrived.is_set() if hold else (self.points / "hit").exists()

        deadline = time.monotonic() + 30
        while not await _poll(reached, 0.25):
            over = (await self.progress()).settled(len(self.said))
            if (over or victim.exited) and not await _poll(reached, 1.0):
                raise CellFailed("the point was never reached (the chat's answers all settled)")
            if time.monotonic() > deadline:
                raise CellFailed("the point was not reached within 30s")
        if hold is None:
            hit = orjson.loads((self.points / "hit").read_bytes())
            if hit["pid"] != victim.pid:
                raise CellFailed(f"the point was reached by pid {hit['pid']}, not the victim")

    async def _landed(self) -> str:
        """At ``telegram.polled``, the victim holds the updates of its first poll (pending since
        before it started, so that poll returned them at once), none of them recorded."""
        if self.cell.point != "telegram.polled":
            return ""
        polls = self.server.calls("getUpdates")
        handled = await self.client.pool.fetchval(
            "SELECT count(*) FROM toren.journal WHERE actor_id = $1 AND type = 'update.handled'",
            self.channel,
        )
        if not polls or polls[0].status != 200 or polls[0].params.get("offset") or handled:
            raise CellFailed(
                f"at telegram.polled#1: {len(polls)} getUpdates ({[p.status for p in polls]}), "
                f"{handled} updates recorded: expected its first poll answered, none recorded"
            )
        return f"its first getUpdates answered with the {len(self.pushed)} updates, none recorded; "

    async def _count_in_flight(self) -> None:
        """A model request the server saw and the journal has not recorded may be paid again."""
        run = await self.conversation()
        seen = {position(r) for _, r in self.recorder.arrivals}
        recorded = await self.client.pool.fetchval(
            "SELECT count(*) FROM toren.journal WHERE actor_id = $1 AND type = 'model.called'",
            run,
        )
        self.allowed_repeats = max(0, len(seen) - recorded)
        if self.cell.fault != "sigkill":
            self.allowed_repeats = max(self.allowed_repeats, 1)

    # -- faults ------------------------------------------------------------------------------

    async def _sigkill(self, victim: Worker, hold: Any) -> str:
        gone = victim.kill()
        if not gone:
            raise CellFailed("the victim did not die of SIGKILL")
        if isinstance(hold, Hold) and not hold.delivered:
            # Released only once the server saw its client go: the send is then dropped, never
            # made (a held send takes effect on release).
            with anyio.move_on_after(30):
                while not hold.calls[0].gone:
                    await anyio.sleep(0.02)  # a poll, under the deadline above
            if not hold.calls[0].gone:
                raise CellFailed("the server did not see the killed worker's connection close")
            self._go(hold)
            if hold.calls[0].status is not None:
                raise CellFailed("the held send was made after its worker died")
            return f"pid {victim.pid} SIGKILLed while Telegram held its send; the send dropped"
        self._go(hold)
        if isinstance(hold, Hold):
            return (
                f"pid {victim.pid} SIGKILLed after Telegram delivered its send, before the answer"
            )
        return f"pid {victim.pid} held at the point, then SIGKILLed"

    async def _finish(self) -> None:
        deadline = time.monotonic() + self.h.bound
        while True:
            progress = await self.progress()
            if progress.settled(len(self.said)):
                return
            if not any(w.running for w in self.workers):
                self.start(self.env, "replacement")
            if time.monotonic() > deadline:
                raise CellFailed(
                    f"stuck: {progress.answers} answers queued, {progress.pending} pieces "
                    f"pending {self.h.bound:g}s on"
                )
            await anyio.sleep(0.1)


# -- a cell --------------------------------------------------------------------------------------


async def journal(client: Client, actor_id: str) -> tuple[Row, ...]:
    rows = await client.pool.fetch(
        "SELECT seq, epoch, type, data, extract(epoch FROM created_at)::float8 AS at "
        "FROM toren.journal WHERE actor_id = $1 ORDER BY seq",
        actor_id,
    )
    return tuple(Row(r["seq"], r["epoch"], r["type"], r["data"], r["at"]) for r in rows)


async def token_leaks(client: Client, token: str, logs: Mapping[str, str]) -> tuple[str, ...]:
    """Where the bot token's secret part shows: journal rows, mailboxes, actors' rows, dead
    letters, workers' logs."""
    secret = token.partition(":")[2]
    found = [
        f"journal {r['actor_id']}#{r['seq']} ({r['type']})"
        for r in await client.pool.fetch(
            "SELECT actor_id, seq, type FROM toren.journal WHERE strpos(data::text, $1) > 0",
            secret,
        )
    ]
    for table in ("mailbox", "actors", "deadletters"):
        rows = await client.pool.fetchval(
            f"SELECT count(*) FROM toren.{table} t WHERE strpos(t::text, $1) > 0", secret
        )
        if rows:
            found.append(f"{rows} rows of toren.{table}")
    found.extend(f"the log of worker {name}" for name, log in logs.items() if secret in log)
    return tuple(found)


def crashes(cell: Cell, workers: Iterable[Worker]) -> int:
    """The cell's fault, and each worker that gave its actors up by itself (a faulted victim's
    own giving up aside): the crashes a duplicate or a loss may be charged to."""
    planned = 1 if cell.fault is not None else 0
    unplanned = sum(
        1
        for w in workers
        if gave_up([w.log()]) and not (w.role == "victim" and cell.fault == "pg_terminate")
    )
    return planned + unplanned


async def observe_telegram(execution: TelegramExecution) -> TelegramObserved:
    client = execution.client
    run = await execution.conversation()
    state = await read_run(client, run) if run else RunState()
    logs = {f"{i}-{w.role}": w.log() for i, w in enumerate(execution.workers)}
    return TelegramObserved(
        delivery=delivery(execution.cell.shape),
        state=state,
        journal=await journal(client, run) if run else (),
        channel_journal=await journal(client, execution.channel),
        arrivals=tuple((t, position(r)) for t, r in execution.recorder.arrivals),
        allowed_repeats=execution.allowed_repeats,
        pushed=dict(execution.pushed),
        said=execution.said,
        delivered=tuple(m.text or "" for m in execution.server.sent(CHAT)),
        deadletters=await client.pool.fetchval("SELECT count(*) FROM toren.deadletters"),
        crashes=crashes(execution.cell, execution.workers),
        leaks=await token_leaks(client, execution.token, logs),
    )


async def run_telegram_cell(
    harness: Harness, cell: Cell, expected: TelegramExpected | None
) -> tuple[CellResult, TelegramObserved]:
    """Run a Telegram cell (``expected`` None: the clean run, its points traced)."""
    prefix = f"{harness.mutation}/" if harness.mutation else ""
    folder = harness.workdir / f"{prefix}{cell.slug}"
    folder.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    recorder = _Recorder()
    token = f"{secrets.randbelow(9_000_000) + 1_000_000}:{secrets.token_urlsafe(24)}"
    async with (
        harness.database() as url,
        AnthropicServer(recorder) as model,
        EffectServer() as effects,
        TelegramServer(token, username=f"{bot_settings(cell.shape).bot}_bot") as server,
    ):
        client = await Client.connect(url)
        execution = TelegramExecution(
            harness, cell, folder, client, model, effects, url, recorder, server, token
        )
        try:
            with anyio.fail_after(harness.bound + 90):
                evidence = await execution.run()
            observed = await observe_telegram(execution)
        finally:
            for w in execution.workers:
                w.close()
            await client.close()
    problems = list(execution.problems)
    verdict = judge_telegram(observed, expected) if expected is not None else None
    if verdict is not None:
        problems.extend(verdict.problems)
    result = CellResult(
        cell,
        tuple(problems),
        verdict.duplicate_calls if verdict else 0,
        verdict.duplicate_usd if verdict else Decimal(0),
        time.monotonic() - started,
        evidence,
        note(observed),
    )
    return result, observed
