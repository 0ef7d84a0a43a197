"""Agents and tools as users declare them: ``Agent(...)`` and the ``@tool`` decorator.

A tool declares what it does to the world, so the runtime can treat it accordingly:

- ``effects``: ``"read"`` (looks only), ``"write"`` (changes state Toren owns or can undo) or
  ``"external"`` (changes the outside world: a ticket, an email, a payment);
- ``idempotency``: ``"keyed"`` (the tool passes ``ctx.idempotency_key`` to the system it calls,
  which deduplicates, so a re-run after a crash has no second effect), ``"unkeyed"``
  (at-least-once: a crash between the effect and its record repeats it) or ``"at_most_once"``
  (a call that may have started before a crash is never run again: the model is told it was
  interrupted and that its effect is unknown);
- ``approval``: ``"never"``, ``"always"``, or a predicate on the call's arguments.

An external, unkeyed tool that needs no approval can repeat a real-world effect with nobody
asked: :func:`check` flags it, and the worker logs the same flag at boot.

Arguments are described by the function's type hints; pydantic derives the JSON schema the model
sees and validates what the model sends back (malformed arguments go back to the model as an
error result, never into the function). Validated arguments are recorded in their JSON form and
validated again from it before every call, so a tool gets the same values (``Decimal``,
``datetime``, enums, tuples, models) live and after a replay.
"""

from __future__ import annotations

import functools
import inspect
import re
from collections.abc import Awaitable, Callable, Iterable, Mapping
from types import ModuleType
from typing import TYPE_CHECKING, Annotated, Any, Literal, cast, get_type_hints, overload

import attrs
import pydantic

from toren._core.durations import parse_duration as parse_duration  # its old home
from toren._core.errors import ConfigError

if TYPE_CHECKING:
    from toren._agent.retention import Retention
    from toren.channels import Telegram
    from toren.sandboxes import Sandbox
    from toren.schedules import Schedule

Effects = Literal["read", "write", "external"]
Idempotency = Literal["keyed", "unkeyed", "at_most_once"]
ApprovalRule = Literal["never", "always"] | Callable[[Mapping[str, Any]], bool]
VersionPolicy = Literal["pin", "upgrade", "next_turn"]
VERSION_POLICIES: tuple[VersionPolicy, ...] = ("pin", "upgrade", "next_turn")

TOOL_RESULT_CAP = 256 * 1024
"""Bytes (UTF-8) a tool result may hold by default (``Agent.max_tool_result_bytes``)."""

SLEEP_MAX = 30 * 86400.0
"""The longest durable sleep a model may ask for: 30 days."""


def _lease_unchecked() -> None:
    """A context built outside a worker (a test calling a tool directly) has no lease."""


@attrs.frozen(kw_only=True)
class ToolContext:
    """What a tool function receives first: who calls, the key that makes retries safe, and
    the fencing token of the worker running it.

    Attributes:
        run_id: The run that calls the tool.
        tool_call_id: The model's id of this call.
        idempotency_key: The same on every re-run of this call; pass it to the system you call
            so that it applies the effect once.
        fencing_token: The run's epoch at this worker: it rises with every takeover, so a
            system that remembers the highest token it saw can refuse a late write from a
            worker that lost the run (pass it along with the key).
    """

    run_id: str
    tool_call_id: str
    idempotency_key: str
    fencing_token: int = 0
    _ensure_lease: Callable[[], None] = attrs.field(
        default=_lease_unchecked, alias="ensure_lease", repr=False, eq=False
    )

    def ensure_lease(self) -> None:
        """Check, right before an effect, that this worker still holds the run's lease with a
        margin (by its own monotonic clock). A tool that waited long (a slow upstream, a paused
        process) calls it just before it acts.

        Raises:
            toren.LeaseExpired: the lease may be gone; the tool must stop without the effect.
                It derives from ``BaseException``: ``except Exception`` does not catch it, and
                the run goes on at a worker that holds the lease, with the same key.
        """
        self._ensure_lease()


@functools.cache
def _input_schema(arguments: type[pydantic.BaseModel]) -> dict[str, Any]:
    schema = arguments.model_json_schema()  # slow, and asked for at every model call
    schema.pop("title", None)
    return schema


@attrs.frozen(kw_only=True)
class Tool:
    """A tool an agent may call. Build it with :func:`tool`."""

    name: str
    description: str
    fn: Callable[..., Awaitable[Any]]
    effects: Effects
    idempotency: Idempotency
    approval: ApprovalRule
    timeout: float
    arguments: type[pydantic.BaseModel]

    @property
    def input_schema(self) -> dict[str, Any]:
        """The JSON schema of the arguments, as the model sees it (shared: do not modify)."""
        return _input_schema(self.arguments)

    @property
    def dangerous(self) -> bool:
        """External, unkeyed and asking nobody: a crash can repeat a real-world effect."""
        return (
            self.effects == "external"
            and self.idempotency == "unkeyed"
            and self.approval == "never"
        )

    def needs_approval(self, arguments: Mapping[str, Any]) -> bool:
        """Whether this call must wait for a human decision; a predicate gets the arguments
        as the tool would (:meth:`bind`)."""
        if self.approval == "never":
            return False
        if self.approval == "always":
            return True
        return bool(self.approval(arguments))

    def validate(self, arguments: Mapping[str, Any] | None) -> dict[str, Any]:
        """The arguments checked against the signature, in their JSON form (what is recorded).

        Raises:
            pydantic.ValidationError: they do not match (sent back to the model as an error).
        """
        return self.arguments.model_validate(arguments or {}).model_dump(mode="json")

    def bind(self, recorded: Mapping[str, Any]) -> dict[str, Any]:
        """The keyword arguments the function gets for ``recorded`` (a JSON form from
        :meth:`validate`): validated again, so live calls and replays see the same values.

        Raises:
            pydantic.ValidationError: they do not match the signature any more (the code
                changed since they were recorded).
        """
        model = self.arguments.model_validate(recorded)
        return {name: getattr(model, name) for name in type(model).model_fields}


ToolFn = Callable[..., Awaitable[Any]]


@overload
def tool(fn: ToolFn, /) -> Tool: ...


@overload
def tool(
    *,
    effects: Effects = "read",
    idempotency: Idempotency = "unkeyed",
    approval: ApprovalRule = "never",
    timeout: float | str = 60.0,
    name: str | None = None,
    description: str | None = None,
) -> Callable[[ToolFn], Tool]: ...


def tool(
    fn: ToolFn | None = None,
    /,
    *,
    effects: Effects = "read",
    idempotency: Idempotency = "unkeyed",
    approval: ApprovalRule = "never",
    timeout: float | str = 60.0,
    name: str | None = None,
    description: str | None = None,
) -> Tool | Callable[[ToolFn], Tool]:
    """Declare an async function ``fn(ctx, **arguments)`` as a tool.

    Usable bare (``@tool``) or with declarations (``@tool(effects="external", ...)``).

    Raises:
        ConfigError: the function is not async, has no ``ctx`` first parameter, a parameter
            has no type hint, or a declaration has an unknown value.
    """

    def build(f: Callable[..., Awaitable[Any]]) -> Tool:
        if not inspect.iscoroutinefunction(f):
            raise ConfigError(f"tool {f.__qualname__} must be an async function")
        if effects not in ("read", "write", "external"):
            raise ConfigError(f"tool {f.__qualname__}: effects must be read, write or external")
        if idempotency not in ("keyed", "unkeyed", "at_most_once"):
            raise ConfigError(
                f"tool {f.__qualname__}: idempotency must be keyed, unkeyed or at_most_once"
            )
        if not (approval in ("never", "always") or callable(approval)):
            raise ConfigError(
                f"tool {f.__qualname__}: approval must be 'never', 'always' or a predicate"
            )
        return Tool(
            name=name or f.__name__,
            description=description or inspect.getdoc(f) or f.__name__,
            fn=f,
            effects=effects,
            idempotency=idempotency,
            approval=approval,
            timeout=parse_duration(timeout),
            arguments=_arguments_model(f),
        )

    return build(fn) if fn is not None else build


def _arguments_model(fn: Callable[..., Any]) -> type[pydantic.BaseModel]:
    params = list(inspect.signature(fn).parameters.values())
    if not params or params[0].name != "ctx":
        raise ConfigError(f"tool {fn.__qualname__} must take `ctx` as its first parameter")
    hints = get_type_hints(fn, include_extras=True)  # keeps Annotated[..., Field(...)]
    fields: dict[str, Any] = {}
    for p in params[1:]:
        if p.name not in hints:
            raise ConfigError(f"tool {fn.__qualname__}: parameter {p.name!r} needs a type hint")
        default = ... if p.default is inspect.Parameter.empty else p.default
        fields[p.name] = (hints[p.name], default)
    model: type[pydantic.BaseModel] = pydantic.create_model(
        f"{fn.__name__}_arguments",
        # NaN and infinities have no JSON form: refused, so that a recorded call means the same.
        __config__=pydantic.ConfigDict(extra="forbid", allow_inf_nan=False),
        **fields,
    )
    return model


def _tools(value: Iterable[Tool]) -> tuple[Tool, ...]:
    return tuple(value)


def _names(value: Iterable[str]) -> tuple[str, ...]:
    return tuple(value)


def _schedules(value: Iterable[Schedule]) -> tuple[Schedule, ...]:
    """A list of schedules as a tuple (anything else is left for the check to name)."""
    if isinstance(value, list | tuple):
        return tuple(value)
    return cast("tuple[Schedule, ...]", value)


# The kinds' values an Agent takes, as errors name them (their classes are not imported here).
_PART_TYPES = {
    "sandbox": "toren.sandboxes.Sandbox",
    "telegram": "toren.channels.Telegram",
    "schedules": "toren.schedules.Schedule",  # a tuple of them
    "retention": "toren.Retention",  # the agent layer's own, in a module importing this one
}
_PART_CLASSES = {  # where each is defined: an instance of it (or of a subclass) is one
    "toren.sandboxes.Sandbox": "toren.sandboxes._settings.Sandbox",
    "toren.channels.Telegram": "toren.channels._settings.Telegram",
    "toren.schedules.Schedule": "toren.schedules._declaration.Schedule",
    "toren.Retention": "toren._agent.retention.Retention",
}


def _is_a(value: object, public: str) -> bool:
    """``isinstance(value, <the class named public>)``, without importing the kind."""
    wanted = _PART_CLASSES[public]
    return any(f"{k.__module__}.{k.__qualname__}" == wanted for k in type(value).__mro__)


@attrs.frozen(kw_only=True)
class Agent:
    """An LLM agent: a model, a system prompt, tools, and the limits a run of it keeps.

    Attributes:
        name: Unique; runs are started by it (``toren run NAME INPUT``).
        model: ``"anthropic/<model>"``, ``"openai/<model>"`` or ``"bedrock/<model>"``.
        system: The system prompt.
        tools: Tools it may call.
        max_attempts: Consecutive failed attempts at one step before the run fails (class
            ``attempts``).
        wall_clock: Time budget (``"30m"``), excluding time parked on a human or a timer.
        budget_usd: Dollar budget of a run (``None``: unlimited).
        max_tokens: Output tokens per model call.
        max_tool_result_bytes: A tool result longer than this (UTF-8) is cut, with a marker the
            model sees, before it is recorded and sent (default 256 KiB).
        max_response_bytes: A model response longer than this is cut likewise (default 4 MiB).
        calls: Agents this one may call (they must accept it too). The model sees one tool
            per callee, ``call_<name>(input)``, described by the callee's ``description``.
        accepts: Agents allowed to call this one.
        description: What this agent does, as callers' models see it (required when
            ``accepts`` names anyone). The system prompt is never shown to a caller.
        max_call_depth: How deep a chain of cross-agent calls below a run of this agent may
            go (a child of a child ...); a call past it is refused with an error result.
        context_window: The model's context window in tokens; unset, it comes from the price
            library's model data. Unknown either way: only a provider's "request too large"
            answer makes the run compact.
        compact_soft: Past this fraction of the context window (the input tokens the provider
            reported, plus what was added since), old tool results are elided (no model call).
        compact_hard: Past this fraction, older turns are summarised by a recorded model call.
        sandbox: A container per run (:class:`toren.sandboxes.Sandbox`): the model gets
            ``bash``, ``read_file``, ``write_file`` and ``list_files`` run in it.
        max_runs: At most this many runs of the agent in flight (working: parked and ended
            runs do not count) across every worker; the others wait in order of arrival, with
            the status ``queued`` (``None``: no cap).
        max_runs_per_key: At most this many runs in flight per ``concurrency_key`` a run was
            started with (default 1: a key's runs go one at a time, in order).
        telegram: A Telegram bot people reach the agent through
            (:class:`toren.channels.Telegram`; also ``[agents.NAME.telegram]``). With a sandbox
            too, the model gets ``send_file`` (a workspace file sent to the chat).
        schedules: When runs of it start on a clock (:class:`toren.schedules.Schedule`, each
            named; also ``[agents.NAME.schedules.SLOT]``). Not part of a model request.
        version_policy: What a run does when a deploy changes the agent's version
            (:func:`toren.runs.agent_version`): ``"pin"`` (only workers serving the version it
            started on run it), ``"upgrade"`` (it moves to whatever version claims it,
            re-paying from the first step whose request differs) or ``"next_turn"`` (it keeps
            its version for the turn in progress and moves to the newest when it next waits
            for a human or a timer, its history taken as it is). ``None``: the worker's
            ``default_version_policy`` (``pin``; ``upgrade`` under ``toren dev``).
        retention: How long its ended runs are kept (:class:`toren.Retention`; also
            ``[agents.NAME.retention]``). ``None``: every run is kept. Not in its version.
    """

    name: str
    model: str
    system: str = ""
    tools: tuple[Tool, ...] = attrs.field(default=(), converter=_tools)
    max_attempts: int = 5
    wall_clock: float = attrs.field(default=1800.0, converter=parse_duration)
    budget_usd: float | None = None
    max_tokens: int = 4096
    max_tool_result_bytes: int = TOOL_RESULT_CAP
    max_response_bytes: int = 4 * 1024 * 1024
    calls: tuple[str, ...] = attrs.field(default=(), converter=_names)
    accepts: tuple[str, ...] = attrs.field(default=(), converter=_names)
    description: str = ""
    max_call_depth: int = 4
    context_window: int | None = None
    compact_soft: float = 0.5
    compact_hard: float = 0.75
    max_runs: int | None = None
    max_runs_per_key: int = 1
    sandbox: Sandbox | None = None
    telegram: Telegram | None = None
    schedules: tuple[Schedule, ...] = attrs.field(default=(), converter=_schedules)
    version_policy: VersionPolicy | None = None
    retention: Retention | None = None
    _sandbox_tools: tuple[Tool, ...] = attrs.field(init=False, default=(), eq=False, repr=False)

    def __attrs_post_init__(self) -> None:
        if "@" in self.name:  # the separator of a pinned route, agent:NAME@VERSION
            raise ConfigError(
                f"agent {self.name!r}: an agent's name holds no '@'",
                hint="Name it with letters, digits, _ . - (as `toren run` takes it).",
            )
        parts = (("sandbox", self.sandbox), ("telegram", self.telegram))
        for field, value in (*parts, ("retention", self.retention)):
            # A kind's value says which field it belongs in (toren._agent.parts): the agent
            # layer imports no kind.
            if value is not None and not _is_a(value, _PART_TYPES[field]):
                raise ConfigError(f"agent {self.name!r}: {field} must be a {_PART_TYPES[field]}")
        wanted = _PART_TYPES["schedules"]
        if not isinstance(self.schedules, tuple) or not all(
            _is_a(s, wanted) for s in self.schedules
        ):
            raise ConfigError(f"agent {self.name!r}: schedules must be a list of {wanted}")
        slots = [s.name for s in self.schedules]
        twice = sorted({n for n in slots if slots.count(n) > 1})
        if twice:
            raise ConfigError(
                f"agent {self.name!r}: two schedules are named {', '.join(map(repr, twice))}",
                hint="A schedule's name is its slot: give each its own.",
            )
        if self.sandbox is not None:
            object.__setattr__(self, "_sandbox_tools", self.sandbox.agent_tools(self))
        if self.version_policy is not None and self.version_policy not in VERSION_POLICIES:
            raise ConfigError(
                f"agent {self.name!r}: version_policy must be pin, upgrade or next_turn",
                hint="Leave it out for the default (pin; upgrade under toren dev).",
            )
        if "/" not in self.model:
            raise ConfigError(
                f"agent {self.name!r}: model {self.model!r} needs a provider prefix",
                hint="Use anthropic/<model>, openai/<model> or bedrock/<model>.",
            )
        names = [t.name for t in self.all_tools]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ConfigError(f"agent {self.name!r}: duplicate tool names {duplicates}")
        if self.max_attempts < 1:
            raise ConfigError(f"agent {self.name!r}: max_attempts must be at least 1")
        if self.budget_usd is not None and self.budget_usd <= 0:
            raise ConfigError(f"agent {self.name!r}: budget_usd must be positive")
        for cap in ("max_tool_result_bytes", "max_response_bytes"):
            if getattr(self, cap) < 1024:
                raise ConfigError(f"agent {self.name!r}: {cap} must be at least 1024")
        if self.accepts and not self.description.strip():
            raise ConfigError(
                f"agent {self.name!r} accepts callers and has no description",
                hint="Callers' models see the description (never the system prompt): "
                "say what the agent does and what input it wants.",
            )
        if self.max_call_depth < 1:
            raise ConfigError(f"agent {self.name!r}: max_call_depth must be at least 1")
        for cap in ("max_runs", "max_runs_per_key"):
            given: object = getattr(self, cap)
            if given is not None and (isinstance(given, bool) or not isinstance(given, int)):
                raise ConfigError(f"agent {self.name!r}: {cap} must be a whole number")
            if isinstance(given, int) and given < 1:
                raise ConfigError(
                    f"agent {self.name!r}: {cap} must be at least 1, not {given}",
                    hint=f"Leave {cap} out for no cap."
                    if cap == "max_runs"
                    else "1 runs a key's runs one at a time.",
                )
        if self.context_window is not None and self.context_window < 1024:
            raise ConfigError(f"agent {self.name!r}: context_window must be at least 1024")
        if not 0 < self.compact_soft < self.compact_hard < 1:
            raise ConfigError(
                f"agent {self.name!r}: compaction thresholds must satisfy "
                f"0 < compact_soft < compact_hard < 1, got {self.compact_soft:g} and "
                f"{self.compact_hard:g}"
            )
        callees = [call_tool_name(n) for n in self.calls]
        clash = sorted({n for n in callees if callees.count(n) > 1} | (set(callees) & set(names)))
        if clash:
            raise ConfigError(
                f"agent {self.name!r}: the tool name(s) {clash} stand for two callees, or for "
                "a callee and a tool"
            )

    @property
    def all_tools(self) -> tuple[Tool, ...]:
        """Its tools, then its sandbox's (what the model sees)."""
        return self.tools + self._sandbox_tools

    def tool_named(self, name: str) -> Tool | None:
        """The agent's tool called ``name``, if any (a sandbox tool included)."""
        return next((t for t in self.all_tools if t.name == name), None)


def call_tool_name(agent: str) -> str:
    """The tool a caller's model sees for calling ``agent``: ``call_<agent>``, with characters
    tool names may not hold (``.``) made ``_``, at most 64 characters."""
    return ("call_" + re.sub(r"[^A-Za-z0-9_-]", "_", agent))[:64]


def agents_in(module: ModuleType) -> dict[str, Agent]:
    """Every :class:`Agent` defined at the top level of ``module``, by name.

    Raises:
        ConfigError: two agents share a name.
    """
    found: dict[str, Agent] = {}
    for value in vars(module).values():
        if isinstance(value, Agent):
            if value.name in found and found[value.name] is not value:
                raise ConfigError(f"two agents are named {value.name!r} in {module.__name__}")
            found[value.name] = value
    return found


@attrs.frozen(kw_only=True)
class ToolFinding:
    """One tool of one agent as ``toren agents check`` reports it."""

    agent: str
    tool: str
    effects: str
    idempotency: str
    approval: str
    flagged: bool


def check(agents: Iterable[Agent]) -> list[ToolFinding]:
    """Every tool with its declarations; ``flagged`` marks external + unkeyed + no approval."""
    findings = []
    for agent in agents:
        for t in agent.all_tools:
            approval = t.approval if isinstance(t.approval, str) else "per call"
            findings.append(
                ToolFinding(
                    agent=agent.name,
                    tool=t.name,
                    effects=t.effects,
                    idempotency=t.idempotency,
                    approval=approval,
                    flagged=t.dangerous,
                )
            )
    return findings


@tool(effects="read", idempotency="keyed", timeout="1h")
async def durable_sleep(
    ctx: ToolContext, seconds: Annotated[float, pydantic.Field(gt=0, le=SLEEP_MAX)]
) -> str:
    """Wait for `seconds` (more than 0, at most 30 days) before going on. The wait is durable:
    it survives restarts and holds no worker while it lasts."""
    # The run actor never calls this: it parks the run on a durable timer instead.
    raise ConfigError("durable_sleep runs only inside a Toren run")


durable_sleep = attrs.evolve(durable_sleep, name="sleep")
