"""Two-tier recorded compaction, against a local model server that counts input tokens with the
documented estimator and refuses a request over its window with the provider's real error."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

import toren.providers.anthropic  # noqa: F401  (an SDK import takes seconds: paid here)
from tests import compaction_app
from tests.compaction_app import WINDOW, pages
from tests.conftest import WorkerFactory, person, running_worker, wait_for
from toren import Client
from toren._agent.app import load_app
from toren._core.codec import decode
from toren.actors.runs import build_request
from toren.actors.runs.compaction import ELIDED
from toren.actors.runs.request import recomputed
from toren.actors.runs.summarising import SUMMARISER, SUMMARY_MARK
from toren.providers.anthropic import to_wire
from toren.runs import (
    ENDED,
    ContextCompacted,
    RunState,
    context_messages,
    fold,
    read_run,
    receipt,
    say,
    start_run,
)
from toren.testing import AnthropicServer

pytestmark = pytest.mark.anyio

TASK = "Read every page of the archive and tell me what it holds."
HUMAN = "Keep a note of anything about the lighthouse keeper, please."


@contextlib.asynccontextmanager
async def server(
    script: Any, monkeypatch: pytest.MonkeyPatch, window: int = WINDOW
) -> AsyncIterator[AnthropicServer]:
    async with AnthropicServer(script, window=window) as s:
        for name, value in s.env().items():
            monkeypatch.setenv(name, value)
        yield s


async def _ended(client: Client, run_id: str) -> RunState | None:
    state = await read_run(client, run_id)
    return state if state.status in ENDED else None


def _summary_requests(s: AnthropicServer) -> list[dict[str, Any]]:
    return [r for r in s.requests if r.get("system") == SUMMARISER]


def _agent_requests(s: AnthropicServer) -> list[dict[str, Any]]:
    return [r.body for r in s.served if r.body.get("system") != SUMMARISER]


def _compactions(journal: list[Any]) -> list[ContextCompacted]:
    return [decode(e.type, e.data) for e in journal if e.type == "context.compacted"]


def _sent(state: RunState) -> list[dict[str, Any]]:
    """The messages of the last request, as the state says it was made (wire form)."""
    agent = compaction_app.reader
    request = build_request(agent, list(context_messages(state))[:-1])  # less the final answer
    return json.loads(json.dumps(to_wire(request)["messages"]))


async def test_a_long_run_on_a_small_window_compacts_in_both_tiers_and_stays_under_it(
    client: Client, db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    load_app("tests.compaction_app")
    async with server(pages(200), monkeypatch) as s, running_worker(db_url):
        run_id = await start_run(client, "reader", TASK)

        async def read_some() -> bool:
            return len((await read_run(client, run_id)).calls) >= 20

        await wait_for(read_some, timeout=60, what="twenty pages read")
        await say(client, run_id, HUMAN, by=person("ada"))
        state = await wait_for(lambda: _ended(client, run_id), timeout=240, what="the run's end")
        received = list(s.received)
    assert state.status == "completed", state.error
    assert state.output == "All pages read."
    # Every request the server received was under the window: none was refused.
    assert received
    over = [(r.n, r.input_tokens) for r in received if r.refused or r.input_tokens > WINDOW]
    assert over == []
    r = receipt(state)
    assert r.compactions_soft >= 1
    assert r.compactions_hard >= 1
    assert r.tokens_saved > 0
    summaries = [r for r in received if r.body.get("system") == SUMMARISER]
    assert len(summaries) == r.compactions_hard  # each hard compaction: one summary call
    # Summary calls are model calls: counted, their tokens in the totals.
    assert r.calls_made == len(received) == 201 + len(summaries)
    assert r.input_tokens == sum(x.input_tokens for x in received)
    # The pinned texts are in the last request verbatim; the system prompt in every one.
    last = received[-1].body
    texts = [
        b["text"]
        for m in last["messages"]
        if m["role"] == "user"
        for b in _blocks(m)
        if "text" in b
    ]
    assert TASK in texts
    assert HUMAN in texts
    assert any(t.startswith(SUMMARY_MARK) for t in texts)
    assert all(
        x.body["system"] == compaction_app.reader.system for x in received if x not in summaries
    )
    # Old results were elided to stubs that say what was there.
    stubs = [
        b for x in received for m in x.body["messages"] for b in _blocks(m) if ELIDED in str(b)
    ]
    assert stubs
    # The run's conversation is kept whole; the requests carried far less.
    assert len(state.messages) == 1 + 2 * 200 + 1
    # The state's context is what the last request carried.
    assert _sent(state) == last["messages"]


async def test_replaying_a_compacted_run_applies_recorded_compactions_and_calls_nothing(
    client: Client, db_url: str, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> None:
    """Pages of 3 KB, the seventh of 12 KB: soft compactions, then a hard one."""
    load_app("tests.compaction_app")
    script = pages(10, lambda n: 12000 if n == 7 else 3000)
    async with server(script, monkeypatch) as s:
        async with running_worker(db_url):
            run_id = await start_run(client, "reader", TASK)
            await wait_for(lambda: _ended(client, run_id), timeout=120, what="the run's end")
        count = len(s.received)
        state = await read_run(client, run_id)
        journal = await client.journal(run_id)
        assert len(s.received) == count  # reading it made no model call
    folded = RunState()
    for entry in journal:
        folded = fold(folded, decode(entry.type, entry.data))
    assert folded == state
    assert (folded.compactions_soft, folded.compactions_hard) >= (1, 1)
    # The context the fold gives is the one the last request carried.
    assert _sent(folded) == _agent_requests(s)[-1]["messages"]
    # Every recorded call's digest is what this code computes for it, the chain restarting at
    # each compaction (the check an activation makes).
    agent = compaction_app.reader
    checked = list(recomputed(folded, agent, build_request))
    assert len(checked) == len(folded.calls) == 11
    assert all(call.digest == digest for call, digest in checked)
    if request.config.getoption("--record-journals", default=False):
        _record(journal, state)


async def test_a_refused_request_compacts_once_and_is_tried_again(
    client: Client, db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Three pages fit; the fourth, large, takes the request over the window: the server
    refuses it (its real error), the run compacts (reason refused) and the retry fits."""
    load_app("tests.compaction_app")
    sizes = {1: 6000, 2: 6000, 3: 6000, 4: 16000}
    async with server(pages(4, sizes.__getitem__), monkeypatch) as s, running_worker(db_url):
        run_id = await start_run(client, "unaware", TASK)
        state = await wait_for(lambda: _ended(client, run_id), timeout=60, what="the run's end")
        refused = s.refused
        served = s.served
    assert state.status == "completed", state.error
    assert len(refused) == 1
    assert refused[0].input_tokens > WINDOW
    [compacted] = state.compactions
    assert (compacted.reason, compacted.tier) == ("refused", "hard")
    assert all(r.input_tokens <= WINDOW for r in served)
    assert receipt(state).compactions_hard == 1


async def test_a_request_refused_again_after_compaction_fails_the_run_with_class_provider(
    client: Client, db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    load_app("tests.compaction_app")
    sizes = {1: 6000, 2: 6000, 3: 40000}  # the last page alone is over the window
    async with server(pages(3, sizes.__getitem__), monkeypatch) as s, running_worker(db_url):
        run_id = await start_run(client, "unaware", TASK)
        state = await wait_for(lambda: _ended(client, run_id), timeout=60, what="the run's end")
        refused = s.refused
    assert state.status == "failed"
    assert state.error_class == "provider"
    assert "stays over the model's context window after compaction" in (state.error or "")
    assert "prompt is too long" in (state.error or "")  # the provider's own words
    assert len(refused) == 2
    assert [c.reason for c in state.compactions] == ["refused"]


def _shout_page(page: int) -> Any:
    """A build_request whose rendering of page ``page``'s result changed (a code change that
    alters the requests that carry it, and only those)."""
    from toren.runs import Message, ToolResult

    marker = f"page {page}: "

    def build(agent: Any, messages: Any, callees: Any = None) -> Any:
        changed = []
        for m in messages:
            blocks = tuple(
                ToolResult(tool_call_id=b.tool_call_id, content=b.content.upper())
                if isinstance(b, ToolResult) and marker in b.content[:120]
                else b
                for b in m.content
            )
            changed.append(Message(role=m.role, content=blocks))
        return build_request(agent, changed, callees)

    return build


@pytest.mark.parametrize("page", [1, 5], ids=["before-the-first-compaction", "after-it"])
async def test_a_code_change_invalidates_from_the_step_it_changes_around_compactions(
    client: Client, db_url: str, monkeypatch: pytest.MonkeyPatch, page: int
) -> None:
    """Pages of 12 KB on an 8k window: a hard compaction every second call. A changed
    rendering of page ``page``'s result changes the requests from step ``page + 1`` on (until
    it is summarised): that step is invalidated, not an earlier one, and the compactions made
    after it go; the run goes on and every recorded digest then checks under the new code."""
    import toren.actors.runs.request

    load_app("tests.compaction_app")
    script = pages(8, 12000)
    async with server(script, monkeypatch) as s:
        async with running_worker(db_url):
            run_id = await start_run(client, "reader", TASK)
            await wait_for(lambda: _ended(client, run_id), timeout=60, what="the run's end")
        before = await read_run(client, run_id)
        assert before.status == "completed", before.error
        made = [c.after_calls for c in before.compactions]
        assert made
        assert made[0] < 6  # the first compaction comes before page 5's result
        shout = _shout_page(page)
        monkeypatch.setattr(toren.actors.runs.request, "build_request", shout)
        async with running_worker(db_url):
            await say(client, run_id, "And once more, please.", by=person("ada"))

            async def redone() -> RunState | None:
                state = await read_run(client, run_id)
                return state if state.voided and state.status == "completed" else None

            after = await wait_for(redone, timeout=60, what="invalidated and done again")
        journal = await client.journal(run_id)
        served = len(s.served)
    [invalidated] = [e.data["from_step"] for e in journal if e.type == "steps.invalidated"]
    assert invalidated == page + 1
    # The compactions made once the kept calls were made stay; the later ones were made again.
    kept = [c for c in before.compactions if c.after_calls <= page]
    assert list(after.compactions)[: len(kept)] == kept
    assert all(c.after_calls > page for c in list(after.compactions)[len(kept) :])
    # Exact under the new code: every call, before and after each compaction, checks.
    agent = compaction_app.reader
    checked = list(recomputed(after, agent, shout))
    assert all(call.digest == digest for call, digest in checked)
    r = receipt(after)
    assert r.calls_made == served  # nothing paid that the receipt does not show


@pytest.mark.processes
async def test_a_kill_right_after_a_compaction_replays_it_without_a_new_summary_call(
    client: Client, workers: WorkerFactory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The worker is SIGKILLed as the first (hard) compaction commits: the next worker goes on
    from it; the summary is not asked again, and no call is paid twice."""
    async with server(pages(8, 12000), monkeypatch) as s:
        first = workers(
            app="tests.compaction_app",
            kill_point="committed:context.compacted#1",
            kill_point_dir=str(tmp_path),
        )
        run_id = await start_run(client, "reader", TASK)

        async def hit() -> bool:
            return (tmp_path / "hit").exists()

        await wait_for(hit, timeout=60, what="the first compaction committed")
        summaries_then = len(_summary_requests(s))
        first.kill()
        workers(app="tests.compaction_app")
        state = await wait_for(lambda: _ended(client, run_id), timeout=60, what="the run's end")
        journal = await client.journal(run_id)
        served = list(s.served)
    assert summaries_then == 1
    assert state.status == "completed", state.error
    compactions = _compactions(journal)
    assert compactions[0].tier == "hard", [(c.tier, c.after_calls) for c in compactions]
    summaries = [r for r in served if r.body.get("system") == SUMMARISER]
    assert len(summaries) == len(compactions) == state.compactions_hard  # none asked twice
    # The request after the compaction carried its recorded prefix.
    after = [r.body for r in served if r.body.get("system") != SUMMARISER][
        compactions[0].after_calls
    ]
    assert _blocks(after["messages"][0])[-1]["text"] == SUMMARY_MARK + (
        compactions[0].summary.content[0].text  # type: ignore[union-attr]
    )
    r = receipt(state)
    assert r.calls_made == len(served)
    assert r.usd_not_repaid > 0


def _blocks(message: dict[str, Any]) -> list[dict[str, Any]]:
    content = message["content"]
    return [{"type": "text", "text": content}] if isinstance(content, str) else content


FIXTURES = Path(__file__).parent / "fixtures" / "journals"


def _record(journal: list[Any], state: RunState) -> None:
    """Record a compacted run's journal as a fixture (``--record-journals``)."""
    entries = [{"seq": e.seq, "type": e.type, "data": e.data} for e in journal]
    (FIXTURES / "run_v1_compacted.json").write_text(
        json.dumps(entries, indent=1, sort_keys=True) + "\n"
    )
    r = receipt(state)
    expected = {
        "status": state.status,
        "output": state.output,
        "steps": [c.step for c in state.calls],
        "tools": sorted([k, v.content] for k, v in state.results.items()),
        "approvals": [],
        "calls_made": r.calls_made,
        "usd_paid": str(r.usd_paid),
    }
    (FIXTURES / "run_v1_compacted.expected").write_text(
        json.dumps(expected, indent=1, sort_keys=True) + "\n"
    )


async def test_a_task_past_the_soft_threshold_does_not_pay_a_summary_at_every_step(
    client: Client, db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What cannot be compacted (here the task, pinned, about 0.6 of the window) is past the
    soft threshold: compacting saves next to nothing, and the run must not pay a summary call
    (or record a compaction) at each step for it."""
    load_app("tests.compaction_app")
    task = "Read every page. " + ("context " * 2450)
    async with server(pages(20, size=200), monkeypatch) as s, running_worker(db_url):
        run_id = await start_run(client, "reader", task)
        state = await wait_for(lambda: _ended(client, run_id), timeout=240, what="the run's end")
        summaries = len(_summary_requests(s))
    assert state.status == "completed"
    assert summaries == 0
    assert len(state.compactions) <= 3  # not one per step
    assert all(r.input_tokens <= WINDOW for r in s.served)
