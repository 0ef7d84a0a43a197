"""Toren's error hierarchy.

Every error Toren raises on purpose derives from :class:`TorenError`. Errors carry structured
fields and build their message in ``__init__``; whether an operation may be retried travels on
the error (``retryable``)::

    TorenError
    ├── ConfigError               bad settings or environment; fix the config and restart
    ├── DatabaseUnavailable       Postgres could not be reached (retryable)
    ├── MigrationError            the schema could not be brought up to date
    ├── UnknownActor              no actor with that id was spawned
    ├── UnknownActorKind          a worker has no class registered for an actor's kind
    ├── UnknownMessageType        a stored payload names a type nobody registered
    ├── ActorAlreadyExists        spawn() with an id that is taken by an actor of another kind
    ├── ActorNotLive              a send to an actor that was marked failed
    ├── MailboxFull               the recipient's mailbox is at its depth limit (retryable)
    ├── AskTimeout                ask() got no reply in time (retryable)
    ├── FencedOut                 this worker no longer owns the actor; its write was refused
    ├── OverLimit                 the actor waits in a concurrency limit's queue (not an error
    │                             anyone sees: its host lets it go)
    ├── SupervisorEscalation      a supervisor exceeded its restart intensity and gave up
    ├── EffectOutsideHandler      on_start() tried to emit or send
    └── InternalError             an invariant of Toren itself broke: a bug, please report it
        └── MissingResource       a worker lacks what an actor asked of it (toren._core.resources)

Actors are stopped by cancelling their scope (anyio), which derives from ``BaseException``, so an
actor's ``except Exception`` cannot swallow a stop. :class:`LeaseExpired` is such a stop too: it
derives from ``BaseException``, not from :class:`TorenError`.
"""

from __future__ import annotations


class TorenError(Exception):
    """Base class of every error Toren raises on purpose."""

    retryable: bool = False


class ConfigError(TorenError):
    """Settings, environment or command-line input are invalid."""

    def __init__(self, what: str, *, hint: str = "") -> None:
        self.what = what
        self.hint = hint
        # A message of several lines (a syntax error and its source line) gets its hint below.
        joined = f"{what}\n{hint}" if "\n" in what else f"{what}. {hint}"
        super().__init__(joined.strip() if hint else what)


class DatabaseUnavailable(TorenError):
    """Postgres could not be reached."""

    retryable = True

    def __init__(self, url: str, cause: BaseException) -> None:
        self.url = url
        self.cause = cause
        super().__init__(
            f"cannot reach Postgres at {url}: {cause}. "
            "Check TOREN_DATABASE_URL, or unset it to use the embedded server."
        )


class MigrationError(TorenError):
    """A schema migration failed; the schema is left at the last version that applied."""

    def __init__(self, version: int, name: str, cause: BaseException) -> None:
        self.version = version
        self.name = name
        self.cause = cause
        super().__init__(f"migration {version:04d}_{name} failed: {cause}")


class UnknownActor(TorenError):
    """No actor with this id exists."""

    def __init__(self, actor_id: str) -> None:
        self.actor_id = actor_id
        super().__init__(f"no actor {actor_id!r}; spawn it first (toren.Client.spawn)")


class UnknownActorKind(TorenError):
    """A worker was asked to run an actor whose kind no loaded module registered."""

    def __init__(self, kind: str, known: list[str]) -> None:
        self.kind = kind
        self.known = known
        super().__init__(
            f"no actor class registered for kind {kind!r} (known: {', '.join(known) or 'none'}); "
            "start the worker with --app naming the module that defines it"
        )


class UnknownMessageType(TorenError):
    """A stored message or event names a type that no loaded module registered."""

    def __init__(self, type_name: str) -> None:
        self.type_name = type_name
        super().__init__(
            f"no payload type registered as {type_name!r}; "
            "load the module that defines it (worker --app) or register it with @toren.message"
        )


class ActorAlreadyExists(TorenError):
    """spawn() named an id that belongs to an actor of another kind."""

    def __init__(self, actor_id: str, kind: str, existing_kind: str) -> None:
        self.actor_id = actor_id
        self.kind = kind
        self.existing_kind = existing_kind
        super().__init__(
            f"actor {actor_id!r} already exists with kind {existing_kind!r}, not {kind!r}"
        )


class ActorNotLive(TorenError):
    """The recipient was marked failed (or stopped): no worker will handle its mail."""

    def __init__(self, actor_id: str, status: str) -> None:
        self.actor_id = actor_id
        self.status = status
        super().__init__(
            f"actor {actor_id!r} is {status} and handles no mail (why is recorded in the failure "
            "column of toren.actors); spawn a new actor to go on"
        )


class MailboxFull(TorenError):
    """The recipient's mailbox holds its maximum number of pending user messages."""

    retryable = True

    def __init__(self, actor_id: str, depth: int) -> None:
        self.actor_id = actor_id
        self.depth = depth
        super().__init__(
            f"mailbox of {actor_id!r} is full ({depth} pending messages); retry later "
            "or raise the actor's max_depth"
        )


class AskTimeout(TorenError):
    """ask() waited its whole timeout for a reply."""

    retryable = True

    def __init__(self, actor_id: str, timeout: float) -> None:
        self.actor_id = actor_id
        self.timeout = timeout
        super().__init__(f"no reply from {actor_id!r} within {timeout:g}s")


class FencedOut(TorenError):
    """This worker's claim on the actor is stale: another claim raised the epoch."""

    def __init__(self, actor_id: str, epoch: int) -> None:
        self.actor_id = actor_id
        self.epoch = epoch
        super().__init__(
            f"write to {actor_id!r} refused: epoch {epoch} is no longer the owner's; "
            "the actor runs elsewhere now"
        )


class OverLimit(TorenError):
    """The actor's next message needs a permit of a limit that is full: it waits in that
    limit's queue, holding no worker, until a permit is handed to it (toren._core.limits)."""

    def __init__(self, actor_id: str) -> None:
        self.actor_id = actor_id
        super().__init__(f"{actor_id!r} waits for a permit of a concurrency limit")


class SupervisorEscalation(TorenError):
    """A supervisor saw more restarts than its intensity allows within its period."""

    def __init__(self, supervisor: str, child: str, restarts: int, period: float) -> None:
        self.supervisor = supervisor
        self.child = child
        self.restarts = restarts
        self.period = period
        super().__init__(
            f"supervisor {supervisor!r} gave up: child {child!r} restarted {restarts} times "
            f"within {period:g}s"
        )


class EffectOutsideHandler(TorenError):
    """An actor tried to emit, send or set a timer outside :meth:`Actor.handle`."""

    def __init__(self, actor_id: str) -> None:
        self.actor_id = actor_id
        super().__init__(
            f"{actor_id}: on_start() cannot emit, send or set timers; do it in handle(), where it "
            "commits with the message"
        )


class InternalError(TorenError):
    """An invariant of Toren itself was broken. This is a bug; please report it."""

    def __init__(self, what: str) -> None:
        self.what = what
        super().__init__(f"internal error: {what} (this is a bug in Toren)")


class LeaseExpired(BaseException):
    """This worker's lease on an actor may have lapsed: stop before any effect.

    Raised by :meth:`toren.Context.ensure_lease` and :meth:`toren.ToolContext.ensure_lease` when,
    by the worker's own monotonic clock, the lease does not hold with a margin (the process was
    paused, renewals failed, or another worker took the actor over). Like a cancellation it
    derives from ``BaseException``, so that ``except Exception`` in user code does not swallow
    it; the worker gives the actor up without recording anything, and the actor goes on at a
    worker that holds its lease.
    """

    def __init__(self, actor_id: str, over_by: float) -> None:
        self.actor_id = actor_id
        self.over_by = over_by
        super().__init__(
            f"{actor_id}: the lease may have lapsed ({over_by:.2f}s past the safe margin); "
            "stopping before the effect"
        )
