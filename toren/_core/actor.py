"""Actors: the base class users subclass, the context a handler works through, kernel messages.

An actor's state is a pure fold of its journal: ``apply(state, event)`` for each event, from
``initial_state()``. A handler never writes state directly; it emits events through the
:class:`Context`, which applies them to a working copy at once (so the handler sees its own
effects) and commits them, together with the consumption of the message and every message the
handler sent, in one transaction. If the handler raises, nothing it did is kept.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any, ClassVar, Generic, TypeVar

import attrs

from toren._core.codec import decode, encode, message
from toren._core.errors import EffectOutsideHandler
from toren._core.json_text import dumps, loads
from toren._core.names import NAMES
from toren._core.resources import Resources

if TYPE_CHECKING:
    from toren._core.leases import LeaseClock

S = TypeVar("S")

SYSTEM_LANE = 0
USER_LANE = 1

# The process's actor kinds (toren._core.names), read for every actor a worker hosts.
_class_of_kind = NAMES.kinds.get


class Actor(Generic[S]):
    """Base class of every actor.

    Subclasses set ``kind`` (a stable name stored with each actor) and override
    :meth:`initial_state`, :meth:`apply` and :meth:`handle`. Class attributes tune delivery:

    Attributes:
        kind: The stable name this class is registered under.
        idle_seconds: How long an actor with an empty mailbox stays in memory before it
            passivates (releases its lease and leaves the worker).
        max_attempts: Times a message may make :meth:`handle` raise before it is dead-lettered.
        max_deliveries: Times a message may be claimed at all (crashes included) before it is
            dead-lettered without being handled again. Worker deaths count here, so this is set
            well above what unrelated crashes produce.
        retry_base_seconds: First retry delay after a handler failure; doubles, capped at 30 s.
        snapshot_every: Write a snapshot of the state every N events (``None``: never). Needs
            ``state_type`` so the snapshot can be read back.
        state_type: The class of the state, for snapshots.
        snapshot_version: Bump when the state's shape changes; older snapshots are then ignored.

    How many restarts (failed starts, dead letters) an actor may have before it is marked failed
    is a worker setting (``actor_restart_intensity`` within ``actor_restart_period``).
    """

    kind: ClassVar[str]
    idle_seconds: ClassVar[float] = 5.0
    max_attempts: ClassVar[int] = 5
    max_deliveries: ClassVar[int] = 25
    retry_base_seconds: ClassVar[float] = 0.1
    snapshot_every: ClassVar[int | None] = None
    state_type: ClassVar[type | None] = None
    snapshot_version: ClassVar[int] = 1

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        kind = cls.__dict__.get("kind")
        if kind is None:
            return
        NAMES.add_kind(kind, cls)

    def __init__(self, actor_id: str, args: Mapping[str, Any]) -> None:
        self.actor_id = actor_id
        self.args = args

    def initial_state(self) -> S:
        """The state before the first event."""
        raise NotImplementedError

    def apply(self, state: S, event: Any) -> S:
        """The state after ``event``. Must be pure: replay calls it for every journaled event."""
        raise NotImplementedError

    async def on_start(self, ctx: Context[S]) -> None:
        """Called after the state is rebuilt, before the first message.

        ``ctx`` is read-only here (emitting or sending raises): effects belong to a handled
        message, where they commit with its consumption. Raising counts one restart.
        """

    async def handle(self, ctx: Context[S], msg: Any) -> None:
        """Handle one message: emit events, send messages, set timers, reply.

        An exception is charged to the message: it is retried with backoff and dead-lettered
        past ``max_attempts``; nothing the failed attempt emitted or sent is kept.
        """
        raise NotImplementedError

    def summarize(self, state: S) -> Mapping[str, Any] | None:
        """A small JSON summary of ``state`` kept on the actor's row (``toren.actors.summary``),
        so that lists and dashboards need not fold journals. Written by every step that emits
        an event, in the same statement; ``None`` (the default) keeps none. When the kernel
        gives up on the actor (:class:`ActorFailed`), it sets the summary's ``status`` to
        ``"failed"`` and its ``error_class`` to the failure's class."""
        return None

    def runs(self, state: S) -> bool:
        """Whether the actor, in ``state`` after a step, goes on working by itself. An actor
        under concurrency limits (spawned with ``limits``) holds their permits while it does and
        gives them back in the step after which it does not (it waits on something, or ended);
        mail that makes it work again takes them again, or waits its turn. The default: it
        always works (its permits go only when it passivates or fails)."""
        return True

    def journal_keep_for(self, state: S, resources: Resources) -> float | None:
        """How long the events of this actor stay in its journal once a snapshot covers them, in
        seconds; ``None`` (the default): for ever. For actors that never end (a conversation
        that goes on for months): after each snapshot the host archives the events before it
        older than this to the worker's archive store and deletes them
        (:mod:`toren._core.truncation`); without an archive store it keeps them and says so."""
        return None

    def on_dead_letter(self, ctx: Context[S], msg: Any, error: str) -> None:
        """A message is being dead-lettered: record what that means for the actor.

        ``ctx`` is writable: the events it emits, the messages it sends, the timers it sets
        and the actors it spawns commit in the transaction that moves the message to the dead
        letters, so an actor whose progress depended on the message can end visibly instead of
        waiting forever, and tell those who wait on it. ``msg`` is the
        decoded message, or ``None`` if it could not be decoded. Raising here is logged and
        the message is dead-lettered without these events. The default records nothing.
        """


def actor_class(kind: str) -> type[Actor[Any]] | None:
    """The class registered for ``kind``, if a loaded module defines one."""
    return _class_of_kind(kind)


def actor_kinds() -> list[str]:
    """Every registered actor kind, sorted."""
    return sorted(NAMES.kinds)


@attrs.frozen(kw_only=True)
class Outgoing:
    """A message a handler sends; inserted in the same transaction as the step's events."""

    to: str
    kind: str
    body: str  # JSON text
    lane: int = USER_LANE
    dedupe_key: str | None = None
    timer_key: str | None = None
    delay: float = 0.0
    reply_to: uuid.UUID | None = None


@attrs.frozen(kw_only=True)
class SpawnRequest:
    """An actor a handler spawns; created in the same transaction as the step's events."""

    actor_id: str
    kind: str
    args: Mapping[str, Any]
    parent: str | None
    route: str | None = None
    limits: tuple[str, ...] = ()  # the concurrency limits it must hold to run, in that order


@attrs.frozen(kw_only=True)
class Envelope:
    """A claimed message with its delivery metadata."""

    id: int
    lane: int
    sender: str | None
    kind: str
    body: Any
    payload: Any
    reply_to: uuid.UUID | None
    deliveries: int
    attempts: int
    is_timer: bool


class Context(Generic[S]):
    """What a handler may do. Everything it records is committed atomically after it returns.

    Everything a handler emits, sends or replies is written as JSON at once, so a payload that
    cannot be recorded raises in the handler (charged to the message), never at the commit.
    """

    def __init__(
        self,
        actor: Actor[S],
        state: S,
        seq: int,
        epoch: int,
        envelope: Envelope | None,
        *,
        read_only: bool = False,
        lease: LeaseClock | None = None,
        resources: Resources | None = None,
    ) -> None:
        self.actor_id = actor.actor_id
        self.resources = resources if resources is not None else Resources()
        """What the hosting worker lends its actors (its runtimes, providers, agents), by type:
        ``ctx.resources.get(Channels)``. Empty outside a worker."""
        self._lease = lease
        self._read_only = read_only
        self.epoch = epoch
        self.envelope = envelope
        self._actor = actor
        self._state = state
        self._seq = seq
        self.events: list[tuple[int, str, str, Any]] = []  # (seq, type, JSON text, payload)
        self.outgoing: list[Outgoing] = []
        self.cancelled_timers: list[str] = []
        self.spawns: list[SpawnRequest] = []
        self.reply_body: tuple[str, str] | None = None  # (type, JSON text)
        self.route: str | None = None  # the actor's new route, set by reroute()
        self.leaving = False  # the worker lets the actor go after this step (reroute())

    @property
    def state(self) -> S:
        """The state including events emitted so far in this handler."""
        return self._state

    @property
    def seq(self) -> int:
        """The sequence number of the last event, emitted ones included."""
        return self._seq

    def ensure_lease(self) -> None:
        """Check, right before an effect outside Toren (a model call, a tool run, a network
        send), that this worker's lease on the actor holds with a margin, by its own monotonic
        clock. Fencing refuses a stale owner's writes; this keeps a paused or cut-off owner
        from acting in the world meanwhile. A no-op outside a worker (no lease is tracked).

        Raises:
            LeaseExpired: the lease may have lapsed; the step stops without the effect and the
                message is handled again where a lease holds.
        """
        if self._lease is not None:
            self._lease.ensure()

    @property
    def sender(self) -> str | None:
        """The actor that sent the message being handled, if an actor sent it."""
        return self.envelope.sender if self.envelope else None

    def emit(self, event: Any) -> None:
        """Append ``event`` (committed with the step) and apply it to :attr:`state` now.

        The state is folded from the event as it was written (decoded again from its JSON),
        so that the state a handler sees is the state a replay rebuilds, value for value.

        Raises:
            TypeError: the event holds a value JSON cannot represent.
        """
        self._writable()
        name, body = encode(event)
        text = dumps(body)
        recorded = decode(name, loads(text))
        self._state = self._actor.apply(self._state, recorded)
        self._seq += 1
        self.events.append((self._seq, name, text, recorded))

    def send(
        self,
        to: str,
        msg: Any,
        *,
        system: bool = False,
        dedupe_key: str | None = None,
        delay: timedelta | float = 0.0,
    ) -> None:
        """Send ``msg`` to actor ``to`` when this step commits (transactional outbox).

        A ``dedupe_key`` used before for ``to`` (also earlier in this step) makes it a no-op.
        """
        self._writable()
        if dedupe_key is not None and any(
            o.to == to and o.dedupe_key == dedupe_key for o in self.outgoing
        ):
            return
        name, body = encode(msg)
        self.outgoing.append(
            Outgoing(
                to=to,
                kind=name,
                body=dumps(body),
                lane=SYSTEM_LANE if system else USER_LANE,
                dedupe_key=dedupe_key,
                delay=_seconds(delay),
            )
        )

    def set_timer(self, key: str, delay: timedelta | float, msg: Any) -> None:
        """Deliver ``msg`` to this actor after ``delay``; durable, fired exactly once.

        A pending timer with the same key is replaced.
        """
        self._writable()
        name, body = encode(msg)
        seconds = _seconds(delay)
        # Within one step the last word on a key wins: one statement cannot both delete and
        # upsert the same timer row.
        self._drop_timer(key)
        self.outgoing.append(
            Outgoing(
                to=self.actor_id,
                kind=name,
                body=dumps(body),
                lane=SYSTEM_LANE,
                timer_key=key,
                delay=seconds,
            )
        )

    def cancel_timer(self, key: str) -> None:
        """Cancel the pending timer ``key`` when this step commits (no-op if none)."""
        self._writable()
        self._drop_timer(key)
        self.cancelled_timers.append(key)

    def _writable(self) -> None:
        if self._read_only:
            raise EffectOutsideHandler(self.actor_id)

    def _drop_timer(self, key: str) -> None:
        self.outgoing = [o for o in self.outgoing if o.timer_key != key]
        self.cancelled_timers = [k for k in self.cancelled_timers if k != key]

    def spawn(
        self,
        kind: str | type[Actor[Any]],
        actor_id: str,
        args: Mapping[str, Any] | None = None,
        *,
        route: str | None = None,
        parent: str | None = None,
        limits: Sequence[str] = (),
    ) -> None:
        """Create a child actor when this step commits; this actor becomes its parent (or
        ``parent``, an actor that will outlive it: told if the kernel gives up on it).

        With a ``route``, only workers serving that route claim the child. With ``limits``
        (names of :mod:`toren._core.limits`), it runs only while it holds a permit of each.
        If ``actor_id`` exists with the same kind this is a no-op; with another kind the step
        fails with :class:`~toren.ActorAlreadyExists` (charged to the message).
        """
        self._writable()
        kind_name = kind if isinstance(kind, str) else kind.kind
        self.spawns.append(
            SpawnRequest(
                actor_id=actor_id,
                kind=kind_name,
                args=args or {},
                parent=parent or self.actor_id,
                route=route,
                limits=tuple(limits),
            )
        )

    def reroute(self, route: str, *, leave: bool = False) -> None:
        """Give the actor ``route`` when this step commits: from then on only workers serving
        it claim the actor. The last call in a step wins.

        With ``leave`` (this worker does not serve ``route``), the worker lets the actor go
        right after the step: it claims no further message of it, releases its claim, and a
        worker serving the route takes it from there. Without, this worker keeps it until it
        passivates.

        Raises:
            ValueError: ``route`` is empty or holds a NUL.
        """
        self._writable()
        if not route or "\x00" in route:
            raise ValueError("a route is a non-empty text without NUL")
        self.route = route
        self.leaving = leave

    def reply(self, msg: Any) -> None:
        """Answer the ask() that sent the message being handled (ignored if it was a send)."""
        self._writable()
        name, body = encode(msg)
        self.reply_body = (name, dumps(body))


MAX_DELAY = 10 * 365 * 86400.0  # ten years: far below what Postgres' timestamps can add


def _seconds(delay: timedelta | float) -> float:
    """``delay`` in seconds (a negative one is due now).

    Raises:
        ValueError: it is not finite, or longer than :data:`MAX_DELAY`.
    """
    seconds = delay.total_seconds() if isinstance(delay, timedelta) else float(delay)
    if not seconds <= MAX_DELAY:  # also true for NaN
        raise ValueError(f"a delay must be at most {MAX_DELAY:g} seconds, not {seconds!r}")
    return max(0.0, seconds)


@message("toren.poison")
@attrs.frozen(kw_only=True)
class PoisonMessage:
    """Told to a sender when its message was dead-lettered by the recipient."""

    actor_id: str
    message_id: int
    kind: str
    error: str
    attempts: int
    deliveries: int


@message("toren.failed")
@attrs.frozen(kw_only=True)
class ActorFailed:
    """Appended to an actor's journal when the kernel gives up on it (its restart intensity
    was exceeded): the actor is marked failed and handles no more mail."""

    error: str
    error_class: str = "crashloop"


@message("toren.child_failed")
@attrs.frozen(kw_only=True)
class ChildFailed:
    """Told to a parent when its child exceeded its restart intensity and was marked failed."""

    actor_id: str
    kind: str
    error: str


@message("toren.ask_failed")
@attrs.frozen(kw_only=True)
class AskFailed:
    """The reply an asker gets when its message was dead-lettered."""

    actor_id: str
    error: str
