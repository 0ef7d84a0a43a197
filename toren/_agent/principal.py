"""Who caused something: one shape for every surface, recorded on the events it causes.

A :class:`Principal` is ``{kind, id, name, via}``. ``kind`` is how it was authenticated:

- ``token``: an API token (HTTP, the console, MCP over HTTP); ``id`` is the token's id.
- ``os_user``: the operating-system user of a process with database access (the CLI, MCP over
  stdio, the Python API); ``id`` is the uid, ``name`` comes from the password database for that
  uid, never from ``LOGNAME`` or ``USER``. Anyone who can reach the database is trusted: the
  database is the boundary, not this record.
- ``channel``: a user of a messaging channel (Telegram, later); ``schedule``: a schedule;
  ``run``: another run (a cross-agent call).

``via`` is the surface it came through (``http``, ``console``, ``mcp``, ``cli``, ``python``...).
``name`` is for people to read; ``id`` is what identifies (token names are unique among live
tokens, but a revoked token's name can be reused; ids never are).
"""

from __future__ import annotations

import os
import pwd
from typing import Any, Literal

import attrs

Kind = Literal["token", "os_user", "channel", "schedule", "run"]
KINDS: frozenset[str] = frozenset(("token", "os_user", "channel", "schedule", "run"))
FIELD_CAP = 200
"""Characters each of a principal's fields may hold."""


def _kind(inst: Principal, attribute: attrs.Attribute[Any], value: str) -> None:
    if value not in KINDS:
        raise ValueError(f"principal kind must be one of {', '.join(sorted(KINDS))}: {value!r}")


def _short(inst: Principal, attribute: attrs.Attribute[Any], value: str) -> None:
    if not isinstance(value, str) or not value or len(value) > FIELD_CAP:
        raise ValueError(f"principal {attribute.name} must be 1 to {FIELD_CAP} characters")


@attrs.frozen(kw_only=True)
class Principal:
    """Who caused an event: how authenticated (``kind``), its stable ``id``, a ``name`` for
    people, and the surface it came ``via``."""

    kind: Kind = attrs.field(validator=_kind)
    id: str = attrs.field(validator=_short)
    name: str = attrs.field(validator=_short)
    via: str = attrs.field(validator=_short)

    @classmethod
    def os_user(cls, via: str) -> Principal:
        """This process's operating-system user, from its uid (not from the environment)."""
        uid = os.getuid()
        try:
            name = pwd.getpwuid(uid).pw_name
        except KeyError:  # a uid with no entry (containers): the uid is all there is
            name = f"uid {uid}"
        return cls(kind="os_user", id=str(uid), name=name, via=via)

    def __str__(self) -> str:
        ident = self.id if self.kind != "os_user" else f"uid {self.id}"
        return f"{self.name} ({self.kind} {ident}, via {self.via})"
