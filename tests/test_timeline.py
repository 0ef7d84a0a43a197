"""The timeline ``toren jobs show`` prints: a line drawn from each event's class, the same bytes
for every recorded journal as when the lines were drawn from raw JSON keys (the files under
``fixtures/timelines`` were written by that earlier code), and a row the codec cannot read shown
by its type name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from toren._cli.timeline import describe

FIXTURES = Path(__file__).parent / "fixtures"
JOURNALS = sorted((FIXTURES / "journals").glob("*.json"))


@pytest.mark.parametrize("journal", JOURNALS, ids=[j.stem for j in JOURNALS])
def test_a_recorded_journal_draws_the_timeline_it_always_drew(journal: Path) -> None:
    events = json.loads(journal.read_text())
    lines = "".join(f"{e['seq']:>4}  {describe(e['type'], e['data'])}\n" for e in events)
    expected = (FIXTURES / "timelines" / f"{journal.stem}.txt").read_text(encoding="utf-8")
    assert lines == expected


def test_the_sandbox_events_have_lines_of_their_own() -> None:
    noted = {"text": "sandbox container started anew\nfrom its checkpoint", "at": 1.0}
    assert describe("sandbox.noted", noted) == (
        "sandbox: sandbox container started anew\\nfrom its checkpoint"
    )
    assert describe("sandbox.failed", {"error": "kept crashing"}) == "sandbox failed: kept crashing"


def test_a_type_the_codec_does_not_know_is_shown_by_its_name() -> None:
    assert describe("no.such.event", {"text": "hello"}) == "no.such.event"
    assert describe("json", {"text": "hello"}) == "json"


def test_a_payload_that_does_not_decode_is_shown_by_its_type() -> None:
    assert describe("run.started", {"agent": "support"}) == "run.started"  # no input
    assert describe("tool.intent", "not an object") == "tool.intent"


def test_a_known_event_with_no_line_of_its_own_is_shown_by_its_type() -> None:
    assert describe("callees.described", {"descriptions": {}}) == "callees.described"
