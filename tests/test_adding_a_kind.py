"""docs/architecture.md's walkthrough, done: a kind added in this one file (its messages and
events, its actor, the runtime its actors share on a worker, a service beside them, a CLI
command and an HTTP route, and its ``Kind``), run on a real worker composed from Toren's kinds
and this one, its command and route served by the CLI and the API composed the same way,
touching no other file.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import aiohttp
import anyio
import attrs
import click
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from click.testing import CliRunner

from tests.conftest import wait_for
from toren import Actor, Client, Context, Settings, message
from toren._core.surfaces import resolved
from toren._surfaces import kinds as surfaces_of_torens_kinds
from toren._surfaces.http.app import create_app
from toren._surfaces.http.common import CLIENT
from toren._surfaces.http.openapi import API_PARTS, ApiPart
from toren._surfaces.tokens import create_token
from toren.cli import main as toren_main
from toren.kernel import Kind, Service, Surfaces, WorkerEnv
from toren.supervisors.worker import KINDS, Worker

pytestmark = pytest.mark.anyio


# -- the kind's vocabulary: what its actors are sent and what they record ----------------------


@message("tally.count")
@attrs.frozen
class Count:
    word: str


@message("tally.counted")
@attrs.frozen
class Counted:
    word: str
    seen_by_worker: int  # how many words the worker's runtime had seen, this one included


# -- the runtime its actors share on one worker, and a service beside them ---------------------


class Tallies:
    """What a worker's tally actors share: a count of the words they saw, on this worker."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.words = 0
        self.ticks = 0
        self.closed = False

    async def close(self) -> None:
        self.closed = True


async def _open(env: WorkerEnv) -> Tallies:
    return Tallies(env.settings.worker_name)


def _services(env: WorkerEnv, tallies: Tallies) -> Sequence[Service]:
    async def tick(started: Callable[[], None]) -> None:
        started()
        while True:
            tallies.ticks += 1
            await anyio.sleep(0.05)

    return (Service(id="tally-ticker", run=tick),)


# -- the kind's behaviour ----------------------------------------------------------------------


class Tally(Actor[tuple[str, ...]]):
    kind = "test.tally"

    def initial_state(self) -> tuple[str, ...]:
        return ()

    def apply(self, state: tuple[str, ...], event: Any) -> tuple[str, ...]:
        return (*state, event.word) if isinstance(event, Counted) else state

    async def handle(self, ctx: Context[tuple[str, ...]], msg: Any) -> None:
        if isinstance(msg, Count):
            tallies = ctx.resources.get(Tallies)
            tallies.words += 1
            ctx.emit(Counted(word=msg.word, seen_by_worker=tallies.words))


# -- its surfaces: a command (`toren tally count ACTOR WORD`) and a route (GET /tallies/{name}),
# named in its Kind by import string and resolved by the CLI and the API --------------------------


def register_commands(main: click.Group) -> None:
    @main.group()
    def tally() -> None:
        """Count words."""

    @tally.command("count")
    @click.argument("actor")
    @click.argument("word")
    @click.option("--database-url", required=True)
    def count(actor: str, word: str, database_url: str) -> None:
        """Send ACTOR a WORD to count."""

        async def send() -> None:
            async with await Client.connect(database_url, pool_size=1) as client:
                await client.send(actor, Count(word=word), dedupe_key=word)

        anyio.run(send)
        click.echo(f"sent {word!r} to {actor}")


def install_routes(app: web.Application) -> None:
    async def words(request: web.Request) -> web.Response:
        journal = await request.app[CLIENT].journal(f"tally/{request.match_info['name']}")
        return web.json_response({"words": [e.data["word"] for e in journal]})

    app.router.add_get("/tallies/{name}", words)
    summary = "The words a tally counted"  # in the API's OpenAPI document, with Toren's routes
    app[API_PARTS].append(
        ApiPart(paths={"/tallies/{name}": {"get": {"summary": summary}}}, models=())
    )


TALLY = Kind(
    name="tally",
    actors=(Tally,),
    open=_open,
    services=_services,
    surfaces=Surfaces(cli=(f"{__name__}:register_commands",), http=(f"{__name__}:install_routes",)),
)


# -- run it --------------------------------------------------------------------------------------


async def test_a_kind_added_in_one_file_runs_on_a_worker_composed_with_it(
    client: Client, db_url: str
) -> None:
    settings = Settings(
        database_url=db_url,
        lease_seconds=3.0,
        renew_seconds=1.0,
        poll_seconds=0.2,
        grace_seconds=5.0,
        sandboxes=False,
        worker_name="tallier",
    )
    worker = Worker(settings, db_url, kinds=(*KINDS, TALLY))
    await client.spawn(Tally, "tally/1")
    async with anyio.create_task_group() as tg:
        await tg.start(worker.run)
        tallies = worker.resources.get(Tallies)
        assert tallies.name == "tallier"
        for word in ("one", "two", "three"):
            await client.send("tally/1", Count(word=word), dedupe_key=word)

        async def counted() -> bool:
            return len(await client.journal("tally/1")) == 3

        await wait_for(counted, timeout=20, what="three words counted")
        await wait_for(lambda: _true(tallies.ticks > 1), timeout=10, what="the service ticking")
        with anyio.fail_after(15, shield=True):
            await worker.stop()
    events = [(e.type, e.data) for e in await client.journal("tally/1")]
    assert events == [
        ("tally.counted", {"word": w, "seen_by_worker": n})
        for w, n in (("one", 1), ("two", 2), ("three", 3))
    ]
    assert tallies.closed  # the worker closed the kind's runtime at its stop


def _toren(kinds: Sequence[Kind]) -> click.Group:
    """A ``toren`` group with the commands of ``kinds``, composed as toren.cli composes its own."""
    group = click.Group("toren")
    for register in resolved((k.surfaces for k in kinds), "cli"):
        register(group)
    return group


async def test_the_kinds_command_and_route_come_through_its_kind(
    client: Client, db_url: str
) -> None:
    settings = Settings(
        database_url=db_url, lease_seconds=3.0, renew_seconds=1.0, poll_seconds=0.2,
        grace_seconds=5.0, sandboxes=False,
    )  # fmt: skip
    worker = Worker(settings, db_url, kinds=(*KINDS, TALLY))
    await client.spawn(Tally, "tally/cli")
    toren = _toren((*KINDS, TALLY))
    assert {"jobs", "run", "sandboxes", "channels", "tally"} <= set(toren.commands)
    app = create_app(client, kinds=[k.surfaces for k in (*KINDS, TALLY)])
    _, token = await create_token(client.pool, "tally-reader")
    async with anyio.create_task_group() as tg, TestServer(app, host="127.0.0.1") as server:
        await tg.start(worker.run)
        args = ["tally", "count", "tally/cli", "four", "--database-url", db_url]
        done = await anyio.to_thread.run_sync(CliRunner().invoke, toren, args)
        assert (done.exit_code, done.output) == (0, "sent 'four' to tally/cli\n"), done.output

        async def counted() -> bool:
            return len(await client.journal("tally/cli")) == 1

        await wait_for(counted, timeout=20, what="the word the command sent counted")
        url = str(server.make_url("/tallies/cli"))
        async with aiohttp.ClientSession() as http:
            async with http.get(url) as anonymous:
                assert anonymous.status == 401  # the kind's route is behind the API's tokens
            headers = {"Authorization": f"Bearer {token}"}
            async with http.get(url, headers=headers) as answer:
                assert (answer.status, await answer.json()) == (200, {"words": ["four"]})
            async with http.get(str(server.make_url("/openapi.json")), headers=headers) as doc:
                paths = (await doc.json())["paths"]
                assert {"/runs", "/channels", "/tallies/{name}"} <= set(paths)
        with anyio.fail_after(15, shield=True):
            await worker.stop()


def test_torens_kinds_name_the_surfaces_the_cli_api_and_mcp_serve() -> None:
    # The surfaces read Toren's kinds' surfaces from a light list (they may not import the
    # kinds' actors, and the CLI should not pay for them): it is the same as the kinds'.
    assert tuple(k.surfaces for k in KINDS) == surfaces_of_torens_kinds.SURFACES
    commands = set(_toren(KINDS).commands)
    assert commands == {"run", "jobs", "sandboxes", "channels", "schedules", "costs"}
    assert commands <= set(toren_main.commands)


async def _true(value: bool) -> bool:
    return value


def test_a_kinds_surfaces_are_named_clearly_when_wrong() -> None:
    from toren._core.errors import ConfigError
    from toren._core.surfaces import resolved
    from toren._surfaces.http.common import RouteAccess
    from toren.kernel import Surfaces
    from toren.supervisors.worker import KINDS

    with pytest.raises(TypeError, match="needs its comma"):
        Surfaces(cli=("myapp.cli:register"))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="is not MODULE:NAME"):
        Surfaces(http=("myapp.routes",))
    with pytest.raises(ConfigError, match=r"surface 'no_such_module_here:x' names nothing"):
        resolved([Surfaces(cli=("no_such_module_here:x",))], "cli")
    with pytest.raises(ConfigError, match=r"'os:nope' names nothing: module 'os' has no"):
        resolved([Surfaces(cli=("os:nope",))], "cli")
    with pytest.raises(TypeError, match=r"a Kind is not a Surfaces \(for a Kind, pass"):
        resolved(KINDS, "cli")  # type: ignore[arg-type]
    # A kind's routes cannot loosen another's.
    access = RouteAccess()
    access.ask({("POST", "/runs/{run}/approvals"): "approve"})
    access.ask({("POST", "/runs/{run}/approvals"): "approve"})  # the same again is no change
    with pytest.raises(ValueError, match="already asks for 'approve', not 'read'"):
        access.ask({("POST", "/runs/{run}/approvals"): "read"})
    assert access.scopes == {("POST", "/runs/{run}/approvals"): "approve"}
