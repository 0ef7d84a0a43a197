"""What a kind adds to an agent: the seam between the agent layer and the kinds above it.

A kind may give ``Agent`` a field (``sandbox=Sandbox()``, ``telegram=Telegram(...)``) whose value
is an object of the kind's, or a tuple of them (``schedules=[Schedule(...), ...]``), and an
``[agents.NAME.<field>]`` table in the settings file. The
agent layer knows neither kind: the value says which field it belongs to and which tools it
gives the model (:class:`PartValue`), and the settings composed above the kinds
(``toren.Settings``) hand the table reader each kind's :class:`AgentPart`, which checks and
merges its table. A table read that way keeps its part beside its values (:class:`PartTable`),
so merging it into an agent needs nothing more.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import attrs

if TYPE_CHECKING:
    from toren._agent.agents import Agent, Tool


class PartValue(Protocol):
    """An ``Agent`` field's value given by a kind (a ``Sandbox``, a ``Telegram``), or one item
    of a field holding a tuple of them (a ``Schedule``)."""

    agent_field: ClassVar[str]
    """The ``Agent`` field this value belongs in."""

    def agent_tools(self, agent: Agent) -> tuple[Tool, ...]:
        """The tools this part gives ``agent``'s model (after its own)."""
        ...


@attrs.frozen(kw_only=True)
class AgentPart:
    """How the settings file changes a kind's ``Agent`` field.

    Attributes:
        field: The ``Agent`` field, and the name of its ``[agents.NAME.<field>]`` table.
        settable: The keys its table may hold, checked when the file is read; ``None`` to
            check them when the table is merged into the agent.
        configured: ``(value in code or None, table, where) -> value``: the field's value with
            the table's keys applied; raises ``ConfigError`` naming ``where``.
        needs_code: Why a table cannot give an agent this part when its code does not (the
            hint of the error), or ``None`` if it can.
        read: ``(table, where) -> table``: checks and freezes the table when the file is
            read, for a table ``settable`` cannot describe (one sub-table per item:
            ``[agents.NAME.schedules.SLOT]``); raises ``ConfigError`` naming ``where``.
    """

    field: str
    settable: tuple[str, ...] | None
    configured: Callable[[Any, Mapping[str, Any], str], Any]
    needs_code: str | None = None
    read: Callable[[Mapping[str, Any], str], Mapping[str, Any]] | None = None


@attrs.frozen(eq=False)  # equal to any mapping of the same items, as the table it was read as
class PartTable(Mapping[str, Any]):
    """An ``[agents.NAME.<field>]`` table as read, with the part that merges it."""

    part: AgentPart
    table: Mapping[str, Any]

    def __getitem__(self, key: str) -> Any:
        return self.table[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.table)

    def __len__(self) -> int:
        return len(self.table)
