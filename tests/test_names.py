"""The process's names (actor kinds, payload types) and its collector pauses: the kernel's
process state, each in one object (``tests/test_floors.py`` lists them)."""

from __future__ import annotations

import gc
import re
from collections.abc import Iterator
from typing import Any

import attrs
import pytest

from toren._core.actor import Actor, actor_class, actor_kinds
from toren._core.codec import decode, encode, message, registered
from toren._core.collector import paused
from toren._core.errors import InternalError, UnknownMessageType
from toren._core.names import NAMES


@message("test_names.ping")
@attrs.frozen(kw_only=True)
class Ping:
    n: int


class Pinger(Actor[None]):
    kind = "test_names.pinger"


def test_a_payload_is_found_by_its_name_and_its_type() -> None:
    assert encode(Ping(n=1)) == ("test_names.ping", {"n": 1})
    assert decode("test_names.ping", {"n": 1}) == Ping(n=1)
    assert registered()["test_names.ping"] is Ping
    assert NAMES.payload_names[Ping] == "test_names.ping"


def test_a_payload_name_taken_by_another_class_is_refused() -> None:
    @attrs.frozen
    class Other:
        n: int

    with pytest.raises(
        InternalError, match=re.escape("payload name 'test_names.ping' is taken by Ping")
    ):
        message("test_names.ping")(Other)
    assert registered()["test_names.ping"] is Ping


def test_an_unknown_payload_name_is_an_unknown_message_type() -> None:
    with pytest.raises(UnknownMessageType):
        decode("test_names.nothing", {})


def test_an_actor_kind_is_found_by_its_name() -> None:
    assert actor_class("test_names.pinger") is Pinger
    assert "test_names.pinger" in actor_kinds()
    assert actor_class("test_names.nothing") is None


def test_an_actor_kind_taken_by_another_class_is_refused() -> None:
    with pytest.raises(
        InternalError, match=re.escape("actor kind 'test_names.pinger' is taken by Pinger")
    ):

        class Other(Actor[Any]):
            kind = "test_names.pinger"

    assert actor_class("test_names.pinger") is Pinger


@pytest.fixture
def collector_on() -> Iterator[None]:
    was = gc.isenabled()
    gc.enable()
    yield
    if was:
        gc.enable()
    else:
        gc.disable()


@pytest.mark.usefixtures("collector_on")
def test_the_collector_is_off_while_any_pause_is_open() -> None:
    first, second = paused(), paused()
    first.__enter__()
    second.__enter__()
    assert not gc.isenabled()
    first.__exit__(None, None, None)  # pauses close in any order (across tasks)
    assert not gc.isenabled()
    second.__exit__(None, None, None)
    assert gc.isenabled()


@pytest.mark.usefixtures("collector_on")
def test_a_collector_off_before_the_first_pause_stays_off() -> None:
    gc.disable()
    with paused():
        pass
    assert not gc.isenabled()
