"""Per-agent settings from the TOML file (``[agents.NAME]``), and the consent check over an app.

What operators change without a deploy lives in the settings file, one table per agent::

    [agents.support]
    calls = ["billing"]
    budget_usd = 2.5
    wall_clock = "45m"

**Precedence.** ``Agent(...)`` in code gives the defaults; a key in ``[agents.NAME]`` replaces the
code's value for that key, and a key the table leaves out keeps it. There are no environment
variables per agent. The merge happens when a process registers its app's agents (the worker,
``toren dev``, ``toren agents check``): the registered agent is ``attrs.evolve(agent, **table)``,
so ``Agent``'s own validation runs on the merged values.

A table for an agent this process does not load is not an error (workers sharing one file may
load different apps); :func:`unloaded_tables` names them for the boot log and the check.

**Consent.** Agent A may call agent B only if A's ``calls`` names B and B's ``accepts`` names A.
:func:`consent_findings` lists the declarations that cannot both hold among the agents loaded
here; they are warnings at boot (a self-call is logged as an error), and ``toren agents check``
lists them.
"""

from __future__ import annotations

import functools
import logging
import types
import typing
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Literal

import attrs

from toren._agent.agents import Agent, parse_duration
from toren._agent.parts import AgentPart, PartTable
from toren._core.errors import ConfigError

SETTABLE = (
    "calls",
    "accepts",
    "description",
    "budget_usd",
    "max_attempts",
    "wall_clock",
    "max_tokens",
    "max_tool_result_bytes",
    "max_response_bytes",
    "max_call_depth",
    "context_window",
    "compact_soft",
    "compact_hard",
    "max_runs",
    "max_runs_per_key",
    "sandbox",
    "telegram",
    "schedules",
    "version_policy",
    "retention",
)
"""The ``Agent`` fields an ``[agents.NAME]`` table may set. The model, the system prompt and
the tools are code: changing them changes what the model is sent. ``sandbox`` is a sub-table
(``[agents.NAME.sandbox]``) whose keys replace those of the code's ``Sandbox(...)``; so is
``telegram`` (``[agents.NAME.telegram]``), which may also give an agent a bot its code has not;
``schedules`` holds one sub-table per schedule (``[agents.NAME.schedules.SLOT]``), which replaces
the keys of the code's schedule of that name, adds one, or removes it (``enabled = false``)."""

_CODE_ONLY = ("name", "model", "system", "tools")
# Agent fields whose values are a kind's (or, retention, the agent layer's own table)
_PART_FIELDS = ("sandbox", "telegram", "schedules", "retention")

Tables = Mapping[str, Mapping[str, Any]]


def read_agent_tables(
    raw: Any, source: str, parts: Mapping[str, AgentPart] = types.MappingProxyType({})
) -> Tables:
    """The ``[agents.NAME]`` tables of a settings file, each value checked against the type of
    the ``Agent`` field it sets (``wall_clock`` also as ``"30m"``), frozen. A kind's table
    (``[agents.NAME.sandbox]``) is checked by its part in ``parts`` (by field), and kept with it.

    Raises:
        ConfigError: ``[agents]`` holds something other than tables, a key is unknown (or is
            code: ``model``, ``system``, ``tools``), or a value has the wrong type; the message
            names the table, the key and ``source``.
    """
    if not isinstance(raw, dict):
        raise ConfigError(
            f"agents in {source} must be tables",
            hint="Write one table per agent: [agents.NAME].",
        )
    tables: dict[str, Mapping[str, Any]] = {}
    for name, table in raw.items():
        where = f"[agents.{name}] in {source}"
        if not isinstance(table, dict):
            raise ConfigError(
                f"agents.{name} in {source} must be a table",
                hint=f"Write [agents.{name}] with keys such as {', '.join(SETTABLE[:3])}.",
            )
        unknown = sorted(set(table) - set(SETTABLE))
        if unknown:
            hint = f"Known keys: {', '.join(SETTABLE)}."
            if set(unknown) & set(_CODE_ONLY):
                hint = f"The name, model, system prompt and tools are code, in Agent(...). {hint}"
            raise ConfigError(f"unknown key(s) in {where}: {', '.join(unknown)}", hint=hint)
        tables[name] = types.MappingProxyType(
            {
                key: _checked(key, value, where, parts, f"[agents.{name}.{key}] in {source}")
                for key, value in table.items()
            }
        )
    return types.MappingProxyType(tables)


def _checked(
    key: str, value: Any, where: str, parts: Mapping[str, AgentPart], part_where: str
) -> Any:
    """``value`` for the ``Agent`` field ``key``, by that field's declared type (a kind's field:
    by its part; ``part_where`` names its table)."""
    if key in _PART_FIELDS:
        part = parts.get(key)
        if part is None:  # settings read without the kinds (only toren.Settings has them)
            raise ConfigError(f"{key} in {where}: this process reads no {key} tables")
        if not isinstance(value, dict):
            raise ConfigError(f"{key} in {where} must be a table ([agents.NAME.{key}])")
        unknown = sorted(set(value) - set(part.settable or value))
        if unknown:
            raise ConfigError(
                f"unknown key(s) in the {key} table of {where}: {', '.join(unknown)}",
                hint=f"Known keys: {', '.join(part.settable or ())}.",
            )
        read = part.read(value, part_where) if part.read is not None else dict(value)
        return PartTable(part, types.MappingProxyType(dict(read)))
    converter: object = attrs.fields_dict(Agent)[key].converter
    if converter is parse_duration:
        try:
            return parse_duration(value)
        except ConfigError as exc:
            raise ConfigError(f"{key} in {where}: {exc.what}", hint=exc.hint) from None
    hint = _field_types()[key]
    # An optional field still needs a value here: TOML has no null (leave the key out instead).
    unions = (typing.Union, types.UnionType)
    wanted = [t for t in typing.get_args(hint) if t is not type(None)]
    if typing.get_origin(hint) not in unions:
        wanted = [hint]
    for typ in wanted:
        if typing.get_origin(typ) is Literal:
            if isinstance(value, str) and value in typing.get_args(typ):
                return value
        elif typing.get_origin(typ) is tuple:
            if isinstance(value, list) and all(isinstance(v, str) for v in value):
                return tuple(value)
        elif typ is float:
            if isinstance(value, int | float) and not isinstance(value, bool):
                return float(value)
        elif isinstance(value, typ) and not isinstance(value, bool):
            return value
    raise ConfigError(
        f"{key} in {where} must be {_describe(wanted[0])} (the value given is not shown)",
        hint="Leave the key out to keep the value given in Agent(...).",
    )


@functools.cache
def _field_types() -> dict[str, Any]:
    # The kinds' fields are checked by their parts: their types are not needed (nor imported).
    kinds = {"Sandbox": object, "Telegram": object, "Schedule": object, "Retention": object}
    return typing.get_type_hints(Agent, localns=kinds)


def _describe(typ: Any) -> str:
    if typing.get_origin(typ) is tuple:
        return "a list of agent names"
    if typing.get_origin(typ) is Literal:
        return "one of " + ", ".join(map(str, typing.get_args(typ)))
    return {str: "a string", int: "an integer", float: "a number"}.get(typ, str(typ))


def configured(agent: Agent, table: Mapping[str, Any] | None, source: str) -> Agent:
    """``agent`` with the keys of its ``[agents.NAME]`` table replacing the code's values.

    Raises:
        ConfigError: the merged values are not a valid agent (for example ``compact_soft``
            above ``compact_hard``); the message says the values came from ``source``.
    """
    if not table:
        return agent
    for key in _PART_FIELDS:  # a kind's table: its part merges it (in a fixed order)
        value = table.get(key)
        if isinstance(value, PartTable):
            where = f"[agents.{agent.name}.{key}] in {source}"
            current = getattr(agent, key)
            if current is None and value.part.needs_code is not None:
                raise ConfigError(
                    f"{where}: agent {agent.name!r} has no {key} in its code",
                    hint=value.part.needs_code,
                )
            table = {**table, key: value.part.configured(current, value, where)}
    try:
        return attrs.evolve(agent, **table)
    except ConfigError as exc:
        raise ConfigError(
            f"{exc.what} (with {', '.join(sorted(table))} from [agents.{agent.name}] in {source})",
            hint=exc.hint or "The table replaces the values in Agent(...) key by key: fix it.",
        ) from None


def unloaded_tables(tables: Tables, loaded: Iterable[str]) -> list[str]:
    """Names of the ``[agents.NAME]`` tables for which no agent is loaded here."""
    return sorted(set(tables) - set(loaded))


ConsentKind = Literal["not_accepted", "not_called", "unknown_callee", "self_call"]


@attrs.frozen(kw_only=True)
class ConsentFinding:
    """A cross-agent call declared on one side only, among the agents loaded here.

    Attributes:
        kind: ``not_accepted`` (the caller lists the callee, which does not accept it),
            ``not_called`` (the callee accepts a loaded caller that does not list it),
            ``unknown_callee`` (the callee is not loaded here), ``self_call``.
        caller: The agent that would call.
        callee: The agent it would call.
    """

    kind: ConsentKind
    caller: str
    callee: str

    @property
    def error(self) -> bool:
        """A self-call can never succeed (it is a cycle); the other kinds may be meant."""
        return self.kind == "self_call"

    @property
    def message(self) -> str:
        """What an operator reads, at boot and in ``toren agents check``."""
        a, b = self.caller, self.callee
        return {
            "not_accepted": f"{a} calls {b} but {b} does not accept {a}: the call is refused",
            "not_called": f"{b} accepts {a} but {a} does not call {b}",
            "unknown_callee": f"{a} calls {b}, unknown here: checked at call time against "
            "the definitions live workers publish",
            "self_call": f"{a} calls itself: a cycle, refused at every call",
        }[self.kind]


def consent_findings(agents: Iterable[Agent]) -> list[ConsentFinding]:
    """The one-sided, unknown and self-calling declarations among ``agents`` (merged with their
    settings), in the order of ``agents`` and of their lists."""
    loaded = {agent.name: agent for agent in agents}
    found: list[ConsentFinding] = []
    for a in loaded.values():
        for b in dict.fromkeys(a.calls):
            if b == a.name:
                found.append(ConsentFinding(kind="self_call", caller=a.name, callee=b))
            elif b not in loaded:
                found.append(ConsentFinding(kind="unknown_callee", caller=a.name, callee=b))
            elif a.name not in loaded[b].accepts:
                found.append(ConsentFinding(kind="not_accepted", caller=a.name, callee=b))
    found.extend(
        ConsentFinding(kind="not_called", caller=a, callee=b.name)
        for b in loaded.values()
        for a in dict.fromkeys(b.accepts)
        if a in loaded and b.name not in loaded[a].calls
    )
    return found


def log_agent_findings(
    agents: Sequence[Agent], tables: Tables, source: str, logger: logging.Logger
) -> None:
    """At boot: each consent finding as a warning (a self-call as an error), and each table for
    an agent not loaded here once at INFO."""
    for finding in consent_findings(agents):
        level = logging.ERROR if finding.error else logging.WARNING
        logger.log(level, "cross-agent consent: %s", finding.message)
    for name in unloaded_tables(tables, (a.name for a in agents)):
        logger.info(
            "[agents.%s] in %s names no agent this worker loads: ignored here (a worker "
            "loading another app may use it)",
            name,
            source,
        )
