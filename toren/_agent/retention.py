"""How long an agent's ended runs are kept: ``Agent(retention=Retention(...))`` or an
``[agents.NAME.retention]`` table.

A run is a candidate for pruning once it and every run below it (the child runs of its
cross-agent calls, theirs...) have ended (completed, failed or cancelled) and no message waits
for any of them; it is pruned when every rule given lets it go:

- ``keep_for``: it ended more than this long ago (``keep_failed_for`` for a failed run, when
  given);
- ``keep_last``: it is not among the newest ``keep_last`` ended runs of its agent (started by a
  person, a schedule or a channel: child runs go with their parent and are not counted).

An agent without a retention policy keeps every run (as before retention existed). A policy
that gives no rule is refused. Pruning keeps an audit record of each run (who started it, each
decision, its receipt, how it ended; ``toren.runs.audit``) and, with ``archive``, its journal
in the archive store first. Retention is not part of the agent's version.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import attrs

from toren._core.durations import kept_for, parse_duration
from toren._core.errors import ConfigError

KEEP_LAST_MAX = 1_000_000
"""The largest ``keep_last`` taken."""


def _duration(value: object) -> float | None:
    if value is None:
        return None
    return parse_duration(value)  # type: ignore[arg-type]


@attrs.frozen(kw_only=True)
class Retention:
    """An agent's retention policy (see the module).

    Attributes:
        keep_for: Seconds (or ``"30d"``) an ended run is kept after its end.
        keep_failed_for: The same for a failed run (``None``: as ``keep_for``); longer, so
            that failures stay to be looked at.
        keep_last: The newest this many ended runs of the agent are kept whatever their age.
        archive: Write each run's journal to the archive store (``archive_store``) and read it
            back before deleting its rows.
        conversation_keep_for: For a run that never ends (a chat): events older than this,
            behind its snapshot, are archived and deleted (needs ``archive``).
    """

    agent_field: ClassVar[str] = "retention"

    keep_for: float | None = attrs.field(default=None, converter=_duration)
    keep_failed_for: float | None = attrs.field(default=None, converter=_duration)
    keep_last: int | None = None
    archive: bool = False
    conversation_keep_for: float | None = attrs.field(default=None, converter=_duration)

    def __attrs_post_init__(self) -> None:
        for name in ("keep_for", "keep_failed_for", "conversation_keep_for"):
            if (period := getattr(self, name)) is not None:
                kept_for(f"retention {name}", period)
        keep_last: object = self.keep_last
        if keep_last is not None and (
            isinstance(keep_last, bool)
            or not isinstance(keep_last, int)
            or not 0 <= keep_last <= KEEP_LAST_MAX
        ):
            raise ConfigError(
                f"retention keep_last must be a whole number from 0 to {KEEP_LAST_MAX}",
                hint="Leave it out to keep runs by age only.",
            )
        if not isinstance(self.archive, bool):
            raise ConfigError("retention archive must be true or false")
        if self.conversation_keep_for is not None and not self.archive:
            raise ConfigError(
                "retention conversation_keep_for needs archive = true",
                hint="A conversation's old events are deleted only once archived.",
            )
        if (self.keep_for, self.keep_failed_for, self.keep_last, self.conversation_keep_for) == (
            None,
            None,
            None,
            None,
        ):
            raise ConfigError(
                "a retention policy needs keep_for, keep_failed_for, keep_last or "
                "conversation_keep_for",
                hint="For example Retention(keep_for='30d', keep_last=100); leave retention "
                "out to keep every run.",
            )

    def age_limit(self, status: str) -> float | None:
        """Seconds a run that ended with ``status`` is kept after its end (``None``: no age
        rule for it)."""
        if status == "failed" and self.keep_failed_for is not None:
            return self.keep_failed_for
        return self.keep_for

    @property
    def prunes_runs(self) -> bool:
        """Whether ended runs are ever pruned (a policy with only ``conversation_keep_for``
        prunes none)."""
        return (self.keep_for, self.keep_failed_for, self.keep_last) != (None, None, None)

    def to_json(self) -> dict[str, Any]:
        """As workers publish it on the agent's card."""
        return attrs.asdict(self)

    @classmethod
    def from_json(cls, value: Mapping[str, Any]) -> Retention:
        """A policy as published (``ConfigError`` if it is not one)."""
        known = {f.name for f in attrs.fields(cls)}
        return cls(**{k: v for k, v in value.items() if k in known})


SETTABLE = ("keep_for", "keep_failed_for", "keep_last", "archive", "conversation_keep_for")
"""The keys of an ``[agents.NAME.retention]`` table."""


def _read(table: Mapping[str, Any], where: str) -> Mapping[str, Any]:
    """The table checked (as a whole policy would be) when the file is read."""
    try:
        Retention(**{"keep_last": 0, "archive": True, **table})
    except (ConfigError, TypeError) as exc:
        if isinstance(exc, ConfigError):
            raise ConfigError(f"{where}: {exc.what}", hint=exc.hint) from None
        raise ConfigError(f"{where}: {exc}") from None
    return dict(table)


def _configured(current: Retention | None, table: Mapping[str, Any], where: str) -> Retention:
    """The code's policy with the table's keys replacing its own (the table alone without)."""
    try:
        if current is None:
            return Retention(**table)
        return attrs.evolve(current, **table)
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc.what}", hint=exc.hint) from None


def retention_part() -> Any:
    """The ``[agents.NAME.retention]`` table's part (``toren._agent.parts.AgentPart``)."""
    from toren._agent.parts import AgentPart

    return AgentPart(field="retention", settable=SETTABLE, configured=_configured, read=_read)
