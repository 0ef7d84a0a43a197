"""What an agent's sandbox may do: ``Sandbox(...)`` on an ``Agent``, or ``[agents.NAME.sandbox]``.

Every limit has a hardened default; an operator changes them per agent in the settings file.
``network`` is the dangerous switch: anything but ``"none"`` lets commands reach networks.

Allow rules say which ``bash`` commands run without a human decision. A rule is a command as a
shell would split it (``shlex``): ``"git status"`` allows exactly ``git status``; a rule whose
last word is ``*`` allows any command that starts with the words before it (``"git log *"``
allows ``git log``, ``git log --oneline -3``). A command holding shell control syntax (``;``,
``&``, ``|``, a newline, a backtick, ``$``, a redirection ``<``/``>``, parentheses) is never
allowed by a rule, whatever the rule says: it is asked about like any other.
"""

from __future__ import annotations

import shlex
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any, ClassVar

import attrs
import pydantic

from toren._agent.agents import parse_duration
from toren._agent.parts import AgentPart
from toren._core.errors import ConfigError

if TYPE_CHECKING:
    from toren._agent.agents import Agent, Tool

DEFAULT_IMAGE = "toren/sandbox:latest"
"""The image built locally by ``scripts/sandbox-image`` (bash, coreutils, python3, git)."""

_CONTROL = (";", "&", "|", "\n", "\r", "`", "$", "<", ">", "(", ")", "\0")

_BYTES = pydantic.TypeAdapter(pydantic.ByteSize)
# Errors never show a value that does not fit: a misplaced secret must not reach a log.
_NOT_SHOWN = "(the value given is not shown)"


def parse_size(value: Any, what: str) -> int:
    """Bytes in ``"512MiB"``, ``"1GiB"``, ``"64KiB"`` or a number of bytes.

    Raises:
        ConfigError: it is not a size, or not a positive one.
    """
    if isinstance(value, bool):
        raise ConfigError(f"{what} must be a size like '512MiB' {_NOT_SHOWN}")
    try:
        size = int(_BYTES.validate_python(value))
    except pydantic.ValidationError:
        raise ConfigError(
            f"{what} must be a size like '512MiB' or a number of bytes {_NOT_SHOWN}"
        ) from None
    if size <= 0:
        raise ConfigError(f"{what} must be positive, got {size}")
    return size


def _rules(value: Iterable[str]) -> tuple[str, ...]:
    if isinstance(value, str):
        raise ConfigError(f"allow must be a list of commands, not a string {_NOT_SHOWN}")
    rules = tuple(value)
    for n, rule in enumerate(rules, start=1):
        which = f"allow rule {n} of {len(rules)}"
        if not isinstance(rule, str) or not _words(rule):
            raise ConfigError(f"{which} is not a command {_NOT_SHOWN}")
        if any(c in rule for c in _CONTROL):
            raise ConfigError(
                f"{which} holds shell control syntax {_NOT_SHOWN}",
                hint="A rule is one plain command; a trailing * allows what follows it.",
            )
        if "*" in _words(rule)[:-1]:
            raise ConfigError(f"{which}: * may only be the last word {_NOT_SHOWN}")
    return rules


def _words(command: str) -> list[str]:
    try:
        return shlex.split(command)
    except ValueError:
        return []


def _memory(value: Any) -> int:
    return parse_size(value, "sandbox memory")


def _workspace_size(value: Any) -> int:
    return parse_size(value, "sandbox workspace_size")


def _tmp_size(value: Any) -> int:
    return parse_size(value, "sandbox tmp_size")


def _output_cap(value: Any) -> int:
    return parse_size(value, "sandbox output_cap")


def _at_least(minimum: float) -> Any:
    def check(inst: Any, attribute: attrs.Attribute[Any], value: float) -> None:
        if not value >= minimum:
            raise ConfigError(f"sandbox {attribute.name} must be at least {minimum:g}")

    return check


@attrs.frozen(kw_only=True)
class Sandbox:
    """A run's container: its image, limits, network and allow rules.

    Attributes:
        image: A local image (nothing is pulled); its user must not be root.
        memory: Memory limit, swap none (``"512MiB"``); the workspace's files count in it.
        cpus: CPU quota in cores.
        pids: Processes and threads at once (a fork bomb stops here).
        workspace_size: The workspace's size (a tmpfs, made durable by checkpoints).
        tmp_size: ``/tmp``'s size (a tmpfs, ``noexec``, not checkpointed).
        command_timeout: A command still running after this is killed.
        output_cap: Output (stdout and stderr) kept per command; the rest is counted and dropped.
        network: Docker's network mode: ``"none"`` (no network, only loopback inside). Anything
            else (``"bridge"``, ``"host"``, a network's name) lets commands reach that network:
            the sandbox's commands, written by a model, can then send what they read anywhere.
        allow: ``bash`` commands that need no approval (see the module's docs).
        rerunnable: ``bash`` commands may run again after a crash (at-least-once). Off: a
            command in flight at a crash is not run again; the model is told it was
            interrupted (at-most-once).
        idle_stop: A sandbox without a command for this long is stopped (its workspace is in
            the last checkpoint) and started again on demand.
    """

    image: str = DEFAULT_IMAGE
    memory: int = attrs.field(default=512 * 1024**2, converter=_memory)
    cpus: float = attrs.field(default=1.0, converter=float, validator=_at_least(0.01))
    pids: int = attrs.field(default=256, validator=_at_least(16))
    workspace_size: int = attrs.field(default=256 * 1024**2, converter=_workspace_size)
    tmp_size: int = attrs.field(default=64 * 1024**2, converter=_tmp_size)
    command_timeout: float = attrs.field(default=300.0, converter=parse_duration)
    output_cap: int = attrs.field(default=64 * 1024, converter=_output_cap)
    network: str = "none"
    allow: tuple[str, ...] = attrs.field(default=(), converter=_rules)
    rerunnable: bool = False
    idle_stop: float = attrs.field(default=300.0, converter=parse_duration)

    def __attrs_post_init__(self) -> None:
        if not self.image or any(c.isspace() for c in self.image):
            raise ConfigError(f"sandbox image is not an image name {_NOT_SHOWN}")
        if not self.network or any(c.isspace() for c in self.network):
            raise ConfigError(f"sandbox network is not a network mode {_NOT_SHOWN}")
        if self.memory < 16 * 1024**2:
            raise ConfigError("sandbox memory must be at least 16MiB")
        if self.output_cap < 1024:
            raise ConfigError("sandbox output_cap must be at least 1KiB")

    def allows(self, command: str) -> bool:
        """Whether ``command`` runs without asking: it matches an allow rule and holds no
        shell control syntax."""
        return bool(self.allow) and allowed(command, self.allow)

    def as_args(self) -> dict[str, Any]:
        """The settings a sandbox actor is spawned with (JSON)."""
        return attrs.asdict(self, recurse=False) | {"allow": list(self.allow)}

    agent_field: ClassVar[str] = "sandbox"  # toren._agent.parts: Agent(sandbox=...)

    def agent_tools(self, agent: Agent) -> tuple[Tool, ...]:
        """The sandbox's tools, declared for these settings (and the agent's chat, if any)."""
        from toren.sandboxes._tools import sandbox_tools  # it builds on this module

        return sandbox_tools(self, chat=agent.telegram is not None)

    @classmethod
    def from_args(cls, args: Mapping[str, Any]) -> Sandbox:
        """The settings from :meth:`as_args` (unknown keys ignored: a newer version's)."""
        names = {f.name for f in attrs.fields(cls)}
        return cls(**{k: v for k, v in args.items() if k in names})


SETTABLE = tuple(f.name for f in attrs.fields(Sandbox))
"""The keys of an ``[agents.NAME.sandbox]`` table."""


def allowed(command: str, rules: Iterable[str]) -> bool:
    """Whether ``command`` matches one of ``rules`` (exactly, or by a rule's prefix before a
    trailing ``*``), holding no shell control syntax."""
    if any(c in command for c in _CONTROL):
        return False
    argv = _words(command)
    if not argv:
        return False
    for rule in rules:
        words = _words(rule)
        if words and words[-1] == "*":
            prefix = words[:-1]
            if argv[: len(prefix)] == prefix:
                return True
        elif argv == words:
            return True
    return False


def configured(sandbox: Sandbox, table: Mapping[str, Any], where: str) -> Sandbox:
    """``sandbox`` with the keys of its ``[agents.NAME.sandbox]`` table replacing its values.

    Raises:
        ConfigError: a key is unknown or a value is invalid; the message names ``where``.
    """
    unknown = sorted(set(table) - set(SETTABLE))
    if unknown:
        raise ConfigError(
            f"unknown key(s) in {where}: {', '.join(unknown)}",
            hint=f"Known keys: {', '.join(SETTABLE)}.",
        )
    for key, value in table.items():
        if key == "rerunnable" and not isinstance(value, bool):
            raise ConfigError(f"{key} in {where} must be true or false {_NOT_SHOWN}")
        if key in ("image", "network") and not isinstance(value, str):
            raise ConfigError(f"{key} in {where} must be a string {_NOT_SHOWN}")
        if key == "pids" and (not isinstance(value, int) or isinstance(value, bool)):
            raise ConfigError(f"{key} in {where} must be an integer {_NOT_SHOWN}")
        if key == "allow" and not isinstance(value, list):
            raise ConfigError(f"{key} in {where} must be a list of commands {_NOT_SHOWN}")
    try:
        return attrs.evolve(sandbox, **table)
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc.what}", hint=exc.hint) from None
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{where}: {exc}") from None


SANDBOX_PART = AgentPart(
    field="sandbox",
    settable=SETTABLE,
    configured=configured,
    needs_code="Giving an agent a sandbox gives its model tools: that is code, "
    "Agent(..., sandbox=Sandbox()). The table only changes its settings.",
)
"""How ``[agents.NAME.sandbox]`` changes an agent's sandbox (never gives it one)."""
