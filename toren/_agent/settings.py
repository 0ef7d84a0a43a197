"""The agent layer's settings: the ``[agents.NAME]`` and ``[rate_limits.NAME]`` tables and the
cap on a message's size."""

from __future__ import annotations

import types
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, ClassVar

import attrs

from toren._core.config import Env, WorkerSettings, positive
from toren._core.errors import ConfigError
from toren._core.rates import RateLimit

if TYPE_CHECKING:
    from toren._agent.agents import VersionPolicy
    from toren._agent.parts import AgentPart
    from toren._agent.tables import Tables


def _frozen_tables(value: Mapping[str, Mapping[str, Any]]) -> Tables:
    return types.MappingProxyType(
        {name: types.MappingProxyType(dict(table)) for name, table in value.items()}
    )


def _policy(inst: Any, attribute: attrs.Attribute[Any], value: object) -> None:
    if value not in ("pin", "upgrade", "next_turn"):
        raise ConfigError(
            "default_version_policy must be pin, upgrade or next_turn (the value is not shown)"
        )


def _distinct(inst: Any, attribute: attrs.Attribute[Any], value: tuple[Any, ...]) -> None:
    names = [limit.name for limit in value if isinstance(limit, RateLimit)]
    if len(names) != len(value) or len(set(names)) != len(names):
        raise ConfigError("rate_limits must be RateLimit values, one per name")


def _retention() -> AgentPart:
    """``[agents.NAME.retention]``'s part: the agent layer's own (:class:`toren.Retention`)."""
    from toren._agent.retention import retention_part

    part: AgentPart = retention_part()
    return part


@attrs.frozen(kw_only=True)
class AgentSettings(WorkerSettings):
    """The kernel's settings and the agent layer's.

    Attributes:
        max_message_bytes: The largest human message or run input (UTF-8 bytes) the API, the
            CLI, the MCP server and chat channels accept (64 KiB by default); a longer one is
            refused, never truncated.
        agents: The ``[agents.NAME]`` tables of the file, by agent name: values that replace
            those given in ``Agent(...)`` when the app's agents are registered (read-only).
            They come from the file only, never from variables (:mod:`toren._agent.tables`).
        rate_limits: Provider rate limits shared by every worker (``[rate_limits.NAME]``
            tables, :mod:`toren._agent.rate_tables`): a call takes from its model's and its
            provider's. None by default: then a call takes nothing and writes nothing.
        default_version_policy: The version policy of an agent that names none
            (``Agent.version_policy``): ``"pin"`` by default; ``toren dev`` sets ``"upgrade"``,
            so that editing a prompt and restarting does not park every run.
    """

    ENV: ClassVar[Env] = {
        "max_message_bytes": ("TOREN_MAX_MESSAGE_BYTES", int),
        "default_version_policy": ("TOREN_DEFAULT_VERSION_POLICY", str),
    }
    TABLES: ClassVar[Mapping[str, str]] = {
        "agents": "[agents.NAME] (one per agent)",
        "rate_limits": "[rate_limits.NAME] (a model or a provider)",
    }
    # The kinds' parts of an agent, by field: each kind's settings name theirs (loaded when a
    # file has agent tables), and toren.Settings, composed from them, reads them all.
    AGENT_PARTS: ClassVar[Mapping[str, Callable[[], AgentPart]]] = {"retention": _retention}

    max_message_bytes: int = attrs.field(default=64 * 1024, validator=positive)
    agents: Tables = attrs.field(
        factory=lambda: types.MappingProxyType({}), converter=_frozen_tables, hash=False
    )
    rate_limits: tuple[RateLimit, ...] = attrs.field(
        default=(), converter=tuple, validator=_distinct
    )
    default_version_policy: VersionPolicy = attrs.field(default="pin", validator=_policy)

    @classmethod
    def agent_parts(cls) -> dict[str, Callable[[], AgentPart]]:
        """Every kind's part of an agent this class composes, by field."""
        found: dict[str, Callable[[], AgentPart]] = {}
        for klass in reversed(cls.__mro__):
            found.update(vars(klass).get("AGENT_PARTS", {}))
        return found

    @classmethod
    def parse_tables(cls, data: dict[str, Any], source: str) -> dict[str, Any]:
        values = super().parse_tables(data, source)
        if "agents" in data:
            # Here, not at the top: checking the tables needs Agent (and pydantic), which a
            # settings file without them (and every CLI command reading one) does without.
            from toren._agent.tables import read_agent_tables

            parts = {field: load() for field, load in cls.agent_parts().items()}
            values["agents"] = read_agent_tables(data.pop("agents"), source, parts)
        if "rate_limits" in data:
            from toren._agent.rate_tables import read_rate_tables

            values["rate_limits"] = read_rate_tables(data.pop("rate_limits"), source)
        return values
