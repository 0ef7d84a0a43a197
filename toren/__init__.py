"""Toren: a durable runtime for LLM agents on asyncio and Postgres.

The public API: :class:`Actor` and :class:`Context` to write actors, :func:`message` to register
payload types, :class:`Client` to spawn, send and ask, :class:`Settings`, and the errors.

Each name is imported from its module when first used (PEP 562): ``import toren.cli`` or
``import toren.runs`` does not pay for the agent layer, the kernel's client and their libraries.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from toren._core.exports import lazy_exports
from toren._version import __version__

if TYPE_CHECKING:  # what the names below are, for type checkers (imported lazily at run time)
    from toren._agent.agents import Agent, Tool, ToolContext, durable_sleep, tool
    from toren._agent.principal import Principal
    from toren._agent.retention import Retention
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
    from toren._core.rates import RateLimit
    from toren._core.restarts import MemoryRestartStore, PostgresRestartStore, RestartStore
    from toren._settings import Settings

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
    "RateLimit",
    "RestartStore",
    "Retention",
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

# Each public name's module, imported on first use by ``__getattr__``.
_HOMES: dict[str, tuple[str, ...]] = {
    "toren._agent.agents": (
        "Agent",
        "Tool",
        "ToolContext",
        "durable_sleep",
        "tool",
    ),
    "toren._agent.principal": ("Principal",),
    "toren._agent.retention": ("Retention",),
    "toren._cli.dev_state": ("recorded_dev_url",),
    "toren._core.actor": (
        "Actor",
        "ActorFailed",
        "AskFailed",
        "ChildFailed",
        "Context",
        "Envelope",
        "PoisonMessage",
    ),
    "toren._core.client": (
        "AskError",
        "Client",
        "DeadLetter",
    ),
    "toren._core.codec": (
        "event",
        "message",
    ),
    "toren._settings": ("Settings",),
    "toren._core.rates": ("RateLimit",),
    "toren._core.errors": (
        "ActorAlreadyExists",
        "ActorNotLive",
        "AskTimeout",
        "ConfigError",
        "DatabaseUnavailable",
        "EffectOutsideHandler",
        "FencedOut",
        "InternalError",
        "LeaseExpired",
        "MailboxFull",
        "MigrationError",
        "SupervisorEscalation",
        "TorenError",
        "UnknownActor",
        "UnknownActorKind",
        "UnknownMessageType",
    ),
    "toren._core.history": (
        "History",
        "Ledger",
    ),
    "toren._core.journal": ("JournalEntry",),
    "toren._core.restarts": (
        "MemoryRestartStore",
        "PostgresRestartStore",
        "RestartStore",
    ),
}


__getattr__, __dir__ = lazy_exports(__name__, _HOMES)
