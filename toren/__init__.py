"""Toren: a durable runtime for LLM agents on asyncio and Postgres.

The public API: :class:`Actor` and :class:`Context` to write actors, :func:`message` to register
payload types, :class:`Client` to spawn, send and ask, :class:`Settings`, and the errors.
"""

from toren._agent.agents import Agent, Tool, ToolContext, durable_sleep, tool
from toren._agent.principal import Principal
from toren._cli.dev_state import recorded_dev_url
from toren._core.actor import (
    Actor,
    ActorFailed,
    AskFailed,
    ChildFailed,
    Context,
    Envelope,
    PoisonMessage,
)
from toren._core.client import AskError, Client, DeadLetter
from toren._core.codec import event, message
from toren._core.errors import (
    ActorAlreadyExists,
    ActorNotLive,
    AskTimeout,
    ConfigError,
    DatabaseUnavailable,
    EffectOutsideHandler,
    FencedOut,
    InternalError,
    LeaseExpired,
    MailboxFull,
    MigrationError,
    SupervisorEscalation,
    TorenError,
    UnknownActor,
    UnknownActorKind,
    UnknownMessageType,
)
from toren._core.history import History, Ledger
from toren._core.journal import JournalEntry
from toren._core.restarts import MemoryRestartStore, PostgresRestartStore, RestartStore
from toren._settings import Settings
from toren._version import __version__

__all__ = [
    "Actor",
    "ActorAlreadyExists",
    "ActorFailed",
    "ActorNotLive",
    "Agent",
    "AskError",
    "AskFailed",
    "AskTimeout",
    "ChildFailed",
    "Client",
    "ConfigError",
    "Context",
    "DatabaseUnavailable",
    "DeadLetter",
    "EffectOutsideHandler",
    "Envelope",
    "FencedOut",
    "History",
    "InternalError",
    "JournalEntry",
    "LeaseExpired",
    "Ledger",
    "MailboxFull",
    "MemoryRestartStore",
    "MigrationError",
    "PoisonMessage",
    "PostgresRestartStore",
    "Principal",
    "RestartStore",
    "Settings",
    "SupervisorEscalation",
    "Tool",
    "ToolContext",
    "TorenError",
    "UnknownActor",
    "UnknownActorKind",
    "UnknownMessageType",
    "__version__",
    "durable_sleep",
    "event",
    "message",
    "recorded_dev_url",
    "tool",
]
