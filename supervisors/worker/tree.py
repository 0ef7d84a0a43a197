"""The worker's supervision tree and ``toren worker``.

::

    worker (one_for_one, persisted-free; gives up after 10 incarnations in 60 s)
    └── incarnation (one_for_all, intensity 0: any failure ends the incarnation)
        ├── session        advisory lock + registry row + LISTEN, on a dedicated connection
        ├── lease_keeper   renews all leases in one statement; stops actors it lost
        ├── actors         simple_one_for_one: one child per claimed actor (ActorHost)
        ├── dispatcher     claims runnable actors (notifications + polling) up to the cap
        ├── death_watch    waits on a peer's lock: a SIGKILLed peer is noticed at once
        ├── housekeeper    archives and deletes old dead letters (one worker at a time)
        ├── reaper         (with Docker) removes sandbox containers whose run has ended
        ├── checkpoint_sweep (with Docker) deletes checkpoints no kept actor names
        └── stranded_runs  moves next_turn runs left on a version no live worker serves

An incarnation is one worker identity: a session, a worker id, the leases taken under it. When
its lock connection drops, or renewals keep failing until its leases could have expired, or a
renewal times out and another server of a multi-host URL now commits (its server is a stale
primary, :mod:`toren._core.primary`), every actor it hosts is cancelled at once (it may
already be owned elsewhere), the incarnation ends, and the worker starts a new one with a new
id. The dispatcher and the death watch retry their own failures; they never end an incarnation.
On SIGTERM the tree stops in reverse order: the dispatcher stops claiming, each actor finishes
the message in hand (within the grace period) and releases its lease, the session deregisters.
"""

from __future__ import annotations

import logging
import signal
import uuid
from collections.abc import Awaitable, Callable, Sequence
from typing import Literal

import anyio
import asyncpg
from anyio.abc import TaskStatus

from toren import ConfigError, PostgresRestartStore, Settings, TorenError
from toren.directory import Directory
from toren.kernel import (
    Archives,
    Claim,
    Clock,
    Kind,
    Resources,
    Route,
    Runtime,
    WorkerEnv,
    WorkerSession,
    connect,
    create_pool,
    kill_point,
    release,
    schema_status,
)
from toren.kernel import migrate as _migrate
from toren.runs import PROCESS_AGENTS, Agents
from toren.supervisors._backoff import Backoff
from toren.supervisors._dynamic import ChildAlreadyRunning, DynamicSupervisor
from toren.supervisors._supervisor import (
    ChildContext,
    ChildSpec,
    Ready,
    Restart,
    Strategy,
    Supervisor,
)
from toren.supervisors.worker.death_watch import DeathWatch
from toren.supervisors.worker.dispatcher import Dispatcher
from toren.supervisors.worker.hosts import HostRegistry
from toren.supervisors.worker.housekeeper import run_housekeeper
from toren.supervisors.worker.kinds import KINDS
from toren.supervisors.worker.lease_keeper import LeaseKeeper

log = logging.getLogger("toren.worker")

WorkerState = Literal["starting", "running", "reconnecting", "draining"]


class Worker:
    """One worker process's tree. ``run`` until ``stop`` (graceful) or cancellation."""

    def __init__(
        self,
        settings: Settings,
        url: str,
        *,
        sandboxes: bool = True,
        agents: Agents | None = None,
        kinds: Sequence[Kind] = KINDS,
        clock: Clock | None = None,
    ) -> None:
        self.settings = settings
        self.kinds = tuple(kinds)
        """The kinds this worker runs (Toren's own, unless given others)."""
        self.agents = agents if agents is not None else PROCESS_AGENTS
        """The agents this worker runs (the process's, unless given its own)."""
        self.route = Route(url)
        """The order its connections try the URL's servers in (a multi-host URL's)."""
        self._with_sandboxes = sandboxes  # False: Docker is not even asked (see run_worker)
        self.hosts: HostRegistry | None = None
        self.session: WorkerSession | None = None
        self._tree: Supervisor | None = None
        self._pool: asyncpg.Pool | None = None
        self._lease_pool: asyncpg.Pool | None = None
        self._runtimes: list[tuple[Kind, Runtime]] = []  # opened, in order
        self._archives: Archives | None = None  # opened from the settings
        self._draining = False
        self.resources = Resources()
        """What this worker lends its actors (``ctx.resources``): opened in :meth:`run`."""
        self.clock = clock if clock is not None else Clock()
        """The wall clock its schedules read (a test's :class:`~toren.kernel.ShiftedClock`)."""

    @property
    def url(self) -> str:
        """The database URL, its servers (if several) in the order the route tries them."""
        return self.route.url

    async def check_route(self, *, avoided_too: bool = True) -> bool:
        """Probe the URL's servers (if several) and point the pools at the one that commits
        (the ones left out at the last check too, unless not ``avoided_too``).

        Returns:
            Whether the server the connections reach moved. Once the order changed, the pools'
            connections are dropped as they come back (those in use are the stopped actors')
            and new ones follow the new order.
        """
        if not self.route.several:
            return False
        before = self.route.url
        within = max(0.5, self.settings.renew_seconds / 2)
        moved = await self.route.check(within, avoided_too=avoided_too)
        if self.route.url != before:
            for pool in (self._pool, self._lease_pool):
                if pool is not None:
                    pool.set_connect_args(dsn=self.route.url)
                    await pool.expire_connections()
        return moved

    def state(self) -> tuple[uuid.UUID | None, WorkerState]:
        """The registered incarnation's id (``None`` while there is none) and what the worker
        is doing: ``starting``, ``running``, ``reconnecting`` (its lock connection dropped; a
        new incarnation is being opened) or ``draining`` (stopping)."""
        session = self.session
        if self._draining:
            return None, "draining"
        if session is None:
            return None, "starting"
        if session.lost.is_set():
            return None, "reconnecting"
        return session.worker_id, "running"

    def _open_archives(self) -> None:
        """The archive store the hosts read truncated journals from and archive them to: the
        ``archive_store`` setting's, if set, unless one was lent already (a test's)."""
        if Archives not in self.resources:
            self._archives = Archives.from_settings(self.settings)
            if self._archives is not None:
                self.resources.put(self._archives)

    async def run(self, *, task_status: TaskStatus[Worker] = anyio.TASK_STATUS_IGNORED) -> None:
        """Run the tree until :meth:`stop`.

        Raises:
            ConfigError: the database schema is older than this code (run ``toren migrate``).
            SupervisorEscalation: incarnations kept failing (Postgres unreachable for long).
        """
        pool = await create_pool(self.url, size=self.settings.pool_size, name="toren-worker")
        self._pool = pool
        # The policy of agents that name none: the settings' (toren dev's is "upgrade").
        self.agents.default_version_policy = self.settings.default_version_policy
        self.resources.put(self.agents, as_type=Agents)
        self.resources.put(Directory(self.agents, pool))
        self.resources.put(self.clock, as_type=Clock)
        try:
            # Lease renewals have connections of their own: a burst of activations (each folding
            # a journal) or slow steps holding the main pool can never delay a renewal past the
            # lease's deadline.
            self._lease_pool = await create_pool(self.url, size=2, name="toren-leases")
            await _check_schema(pool)
            self._open_archives()
            for kind in self.kinds:  # each kind's runtime, lent to the actors, in order
                if kind.open is not None:
                    opened = await kind.open(self._env(kind))
                    self.resources.put(opened)
                    self._runtimes.append((kind, opened))
            self._tree = Supervisor(
                "worker",
                [
                    ChildSpec(
                        id="incarnation",
                        run=self._incarnation,
                        graceful=True,
                        shutdown_timeout=self.settings.grace_seconds + 5,
                    )
                ],
                strategy=Strategy.ONE_FOR_ONE,
                intensity=10,
                period=60.0,
                backoff=Backoff(base=0.1, cap=5.0),
            )
            async with anyio.create_task_group() as tg:
                await tg.start(self._tree.run)
                task_status.started(self)
        finally:
            with anyio.CancelScope(shield=True):
                for kind, opened in reversed(self._runtimes):
                    self.resources.remove(type(opened))
                    try:
                        await opened.close()
                    except Exception:  # one runtime's failure leaves the others to close
                        log.exception("closing the %s kind's runtime failed", kind.name)
                self._runtimes.clear()
                if self._archives is not None:
                    self.resources.remove(Archives)
                    await self._archives.store.close()
                    self._archives = None
                if self._lease_pool is not None:
                    await self._lease_pool.close()
                await pool.close()

    def _env(self, kind: Kind) -> WorkerEnv:
        if self._pool is None:
            raise ConfigError("worker pool is not open")
        on = self._with_sandboxes or kind.name != "sandbox"
        return WorkerEnv(settings=self.settings, pool=self._pool, resources=self.resources, on=on)

    async def stop(self) -> None:
        """Graceful stop: stop claiming, finish messages in hand, release leases, deregister."""
        self._draining = True
        if self._tree is not None:
            await self._tree.stop()

    async def _incarnation(self, ctx: ChildContext) -> None:
        pool, lease_pool = self._pool, self._lease_pool
        if pool is None or lease_pool is None:
            raise ConfigError("worker pool is not open")
        settings = self.settings
        cards = self.resources.get(Directory).local_cards()
        versions = {name: str(card["version"]) for name, card in cards.items() if card["version"]}
        # A server left stale by a failover is left out, and not probed again at each start (a
        # probe of it leaves a backend waiting there); a renewal that times out probes them all.
        await self.check_route(avoided_too=False)
        session = await WorkerSession.open(self.url, settings, versions)
        hosts = HostRegistry(pool, session.worker_id, settings, self.resources)
        session.on_lost = hosts.cancel_all
        self.session, self.hosts = session, hosts
        actors = DynamicSupervisor(
            "actors",
            intensity=settings.actor_restart_intensity,
            period=settings.actor_restart_period,
            # Restarts of an actor rebuild its state from the journal; give a failing start
            # room to recover (a dependency coming back) before the intensity is spent.
            backoff=Backoff(base=0.5, cap=30.0),
            store=PostgresRestartStore(pool),
            on_give_up=hosts.give_up,
        )

        async def start_host(claim: Claim) -> None:
            run = hosts.adopt(claim)

            async def child(c: ChildContext) -> None:
                await run(lambda: None, c.stopping)

            spec = ChildSpec(
                id=claim.actor_id,
                run=child,
                restart=Restart.TRANSIENT,
                # Ready at once: the dispatcher must not wait on a rebuild (or on a start that
                # fails and is retried with backoff).
                ready=Ready.IMMEDIATE,
                graceful=True,
                shutdown_timeout=settings.grace_seconds,
            )
            for _ in range(200):
                try:
                    await actors.start_child(spec)
                    return
                except ChildAlreadyRunning:
                    # A host that just passivated is still leaving its supervisor.
                    await anyio.sleep(0.005)
            await hosts.abandon(claim)
            log.warning("%s: previous host did not leave in time; claim given back", claim.actor_id)

        async def on_stuck() -> bool:
            # A renewal timed out: if another server now commits, this session's lock guards
            # nothing any more. Its actors stop at once; a new incarnation opens there.
            moved = await self.check_route()
            if moved:
                session.abandon()
            return moved

        keeper = LeaseKeeper(lease_pool, session.worker_id, hosts, settings, on_stuck=on_stuck)

        async def run_keeper(c: ChildContext) -> None:
            try:
                await keeper.run(c.started)
            except TimeoutError:
                # Its renewals hung to the end: the session's server may not commit either, and
                # a polite deregistration would hang there too. Drop the session instead.
                session.abandon()
                raise

        dispatcher = Dispatcher(pool, session.worker_id, hosts, settings, start_host)
        watch = DeathWatch(
            self.url, session.worker_id, session.lock_key, settings, dispatcher.sweep_now
        )
        hosts.on_exit = dispatcher.want
        await session.listen(dispatcher.on_mail, watch.joined)

        async def run_session(c: ChildContext) -> None:
            c.started()
            await session.keepalive(settings.renew_seconds)
            raise SessionLost(str(session.worker_id))

        async def run_actors(c: ChildContext) -> None:
            async with anyio.create_task_group() as tg:
                await tg.start(actors.run)
                c.started()
                await c.stopping.wait()
                hosts.request_stop_all()
                await actors.stop()
                tg.cancel_scope.cancel()

        extra = [  # each kind's services, beside the actors
            ChildSpec(id=service.id, run=_service(service.run))
            for kind, opened in self._runtimes
            if kind.services is not None
            for service in kind.services(self._env(kind), opened)
        ]
        incarnation = Supervisor(
            f"incarnation/{session.worker_id}",
            [
                ChildSpec(id="session", run=_fatal(run_session, hosts)),
                ChildSpec(id="lease_keeper", run=_fatal(run_keeper, hosts)),
                ChildSpec(
                    id="actors",
                    run=run_actors,
                    graceful=True,
                    shutdown_timeout=settings.grace_seconds + 1,
                ),
                ChildSpec(id="dispatcher", run=lambda c: dispatcher.run(c.started)),
                ChildSpec(id="death_watch", run=lambda c: watch.run(c.started)),
                ChildSpec(
                    id="housekeeper", run=lambda c: run_housekeeper(pool, settings, c.started)
                ),
                *extra,
            ],
            strategy=Strategy.ONE_FOR_ALL,
            intensity=0,
        )
        log.info(
            "worker %s up: lease %.1fs, renew %.1fs, poll %.1fs, cap %d actors",
            session.worker_id,
            settings.lease_seconds,
            settings.renew_seconds,
            settings.poll_seconds,
            settings.max_actors,
        )
        try:
            async with anyio.create_task_group() as tg:
                await tg.start(incarnation.run)
                ctx.started()
                await ctx.stopping.wait()
                await incarnation.stop()
        finally:
            with anyio.CancelScope(shield=True):
                hosts.cancel_all()
                try:
                    released = await release(pool, session.worker_id)
                    if released:
                        log.info("released %d leases", released)
                except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError):
                    log.warning(
                        "could not release leases; they expire in %gs", settings.lease_seconds
                    )
                await session.close()
                log.info(
                    "worker %s down (group commit: %d batches, %d steps in them)",
                    session.worker_id,
                    hosts.commits.batches,
                    hosts.commits.batched,
                )


def _service(
    run: Callable[[Callable[[], None]], Awaitable[None]],
) -> Callable[[ChildContext], Awaitable[None]]:
    async def child(c: ChildContext) -> None:
        await run(c.started)

    return child


class SessionLost(TorenError):
    """The worker's lock connection dropped: its incarnation ends."""

    def __init__(self, worker_id: str) -> None:
        super().__init__(f"worker {worker_id} lost its lock connection")


def _fatal(
    run: Callable[[ChildContext], Awaitable[None]], hosts: HostRegistry
) -> Callable[[ChildContext], Awaitable[None]]:
    """Wrap a child whose failure means the incarnation's claims are in doubt: stop all actors
    at once, before the supervisor's orderly shutdown, then let the failure escalate."""

    async def wrapped(ctx: ChildContext) -> None:
        try:
            await run(ctx)
        except Exception:
            hosts.cancel_all()
            raise

    return wrapped


async def _check_schema(pool: asyncpg.Pool) -> None:
    current, latest = await schema_status(pool)
    if current < latest:
        raise ConfigError(
            f"the database schema is at version {current}, this worker needs {latest}",
            hint="Run `toren migrate` (toren dev does it for you).",
        )


async def run_worker(
    settings: Settings,
    url: str,
    *,
    migrate: bool = False,
    sandboxes: bool = True,
    on_started: Callable[[Worker], object] = lambda _worker: None,
    task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Run a worker until SIGTERM or SIGINT; a second signal exits at once. ``on_started``
    receives the worker once its tree runs (``toren up`` asks it for ``/readyz``).
    ``sandboxes=False`` serves no sandboxes without asking Docker (``toren dev`` passes it when
    none of its agents has one); otherwise the ``sandboxes`` setting and Docker decide.

    Started with ``await tg.start(run_worker, ...)``, it reports ready once the worker is up
    (registered, claiming) and listening for the signals that drain it.
    """
    if migrate:
        conn = await connect(url)
        try:
            await _migrate(conn)
        finally:
            await conn.close()
    worker = Worker(settings, url, sandboxes=sandboxes)
    async with anyio.create_task_group() as tg:
        await tg.start(worker.run)
        on_started(worker)

        async def on_signals(*, task_status: TaskStatus[None]) -> None:
            with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                task_status.started()
                async for signum in signals:
                    log.info(
                        "%s: draining (grace %gs)",
                        signal.Signals(signum).name,
                        settings.grace_seconds,
                    )
                    kill_point("shutdown.draining")
                    tg.start_soon(_stop_then_exit, worker, tg)
                    break
                async for _ in signals:
                    log.warning("second signal: exiting now")
                    tg.cancel_scope.cancel()
                    return

        await tg.start(on_signals)
        task_status.started()


async def _stop_then_exit(worker: Worker, tg: anyio.abc.TaskGroup) -> None:
    await worker.stop()
    kill_point("shutdown.released")
    tg.cancel_scope.cancel()
