"""A multi-host database URL (``postgresql://u:p@h1:5432,h2:5432/db?target_session_attrs=...``)
through Toren's URL handling, and the route a worker keeps over its servers
(:mod:`toren._core.primary`). Failover itself, on a real Patroni cluster, is in
``chaos/test_failover.py``."""

from __future__ import annotations

import socket

import anyio
import anyio.abc
import pytest

from toren import Settings
from toren._core.db import redact, with_database
from toren._core.primary import Route, hosts, probe, with_hosts

MULTI = "postgresql://toren:s3cret@10.0.0.1:5432,10.0.0.2:5433/app?target_session_attrs=read-write"


def test_a_multi_host_url_is_a_setting_like_any_other() -> None:
    assert Settings.load(env={"TOREN_DATABASE_URL": MULTI}).database_url == MULTI


def test_a_multi_host_url_is_redacted_and_moved_to_another_database_whole() -> None:
    assert redact(MULTI) == (
        "postgresql://toren:***@10.0.0.1:5432,10.0.0.2:5433/app?target_session_attrs=read-write"
    )
    assert with_database(MULTI, "other") == MULTI.replace("/app?", "/other?")


def test_the_servers_of_a_url_are_listed_and_reordered_with_the_rest_kept() -> None:
    assert hosts(MULTI) == ["10.0.0.1:5432", "10.0.0.2:5433"]
    assert with_hosts(MULTI, ["10.0.0.2:5433", "10.0.0.1:5432"]) == (
        "postgresql://toren:s3cret@10.0.0.2:5433,10.0.0.1:5432/app?target_session_attrs=read-write"
    )
    assert hosts("postgresql://u@db.example:5432/x") == ["db.example:5432"]


@pytest.mark.anyio
async def test_a_single_server_url_has_no_route_to_choose() -> None:
    route = Route("postgresql://u:p@127.0.0.1:5432/x")
    assert not route.several
    assert await route.check(within=0.5) is False
    assert route.url == "postgresql://u:p@127.0.0.1:5432/x"


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.anyio
async def test_servers_that_refuse_connections_are_unreachable_and_move_nothing() -> None:
    a, b = _closed_port(), _closed_port()
    url = f"postgresql://u:p@127.0.0.1:{a},127.0.0.1:{b}/x?target_session_attrs=read-write"
    assert await probe(url, f"127.0.0.1:{a}", within=2) == "unreachable"
    route = Route(url)
    assert await route.check(within=2) is False
    assert route.order == [f"127.0.0.1:{a}", f"127.0.0.1:{b}"]


@pytest.mark.anyio
async def test_a_new_incarnations_check_does_not_probe_a_server_left_out_again() -> None:
    # A server left out as stale is probed again only when asked (a renewal that timed out):
    # each probe of a stale primary leaves a backend waiting there.
    knocks: list[object] = []

    async def knocked(stream: anyio.abc.SocketStream) -> None:
        async with stream:
            knocks.append(stream)
            await anyio.sleep_forever()  # never answers (cancelled with the task group)

    listener = await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=0)
    stale = f"127.0.0.1:{listener.extra(anyio.abc.SocketAttribute.local_port)}"
    other = f"127.0.0.1:{_closed_port()}"
    async with listener, anyio.create_task_group() as tg:
        tg.start_soon(listener.serve, knocked)
        route = Route(f"postgresql://u:p@{other},{stale}/x?target_session_attrs=read-write")
        route.avoided = frozenset({stale})
        assert await route.check(within=0.5, avoided_too=False) is False
        assert knocks == []
        await route.check(within=0.5)
        assert len(knocks) == 1
        tg.cancel_scope.cancel()
