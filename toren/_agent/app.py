"""Loading the user's application: the module that defines their actors and agents."""

from __future__ import annotations

import importlib
import sys
import traceback
from pathlib import Path
from types import ModuleType

from toren._agent.agents import Agent, agents_in
from toren._agent.registry import Agents, agent_named, register_agents
from toren._agent.settings import AgentSettings
from toren._core.errors import ConfigError


def load_app(
    spec: str, settings: AgentSettings | None = None, *, into: Agents | None = None
) -> ModuleType:
    """Import ``MODULE[:ATTR]`` so that its actor classes and payload types register, and
    register its agents into ``into`` (the process's agents by default), each merged with its
    ``[agents.NAME]`` table in ``settings``.

    The current directory is put on ``sys.path`` first, as ``python -m`` would.

    Raises:
        ConfigError: ``spec`` is not a module path (the message does not show it); the module
            cannot be found; it raises while it is imported (the message names the real cause
            and where in the user's code it happened: a module it imports that is missing, a
            syntax error with its line, any exception, without the import machinery's frames;
            a ``sys.exit()`` at import too); ``ATTR`` is missing; or an agent merged with its
            table in the settings file is invalid (the message names the file).
    """
    module_name, colon, attr = spec.partition(":")
    if not _dotted(module_name) or (colon and not attr.isidentifier()):
        # Not shown: a value that is no module path may be a secret set in the wrong variable.
        raise ConfigError(
            "--app (or TOREN_APP) must be MODULE[:ATTR], a Python module path such as "
            "myproject.agents (the value given is not shown)",
            hint="Pass the module that defines your agents.",
        )
    if str(Path.cwd()) not in sys.path:
        sys.path.insert(0, str(Path.cwd()))
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name is None or not _names_app(exc.name, module_name):
            raise _failed(module_name, exc) from None
        raise ConfigError(
            f"cannot import app module {module_name!r}: {exc}",
            hint="Pass --app (or TOREN_APP) as an importable module path, e.g. myproject.agents.",
        ) from None
    except SyntaxError as exc:
        raise ConfigError(
            f"app module {module_name!r} has a syntax error: {_syntax(exc)}",
            hint="Fix it.",
        ) from None
    except SystemExit as exc:  # a script's main() run at import: never a silent exit 0
        raise ConfigError(
            f"app module {module_name!r} called sys.exit({exc.code!r}) while it was imported"
            f"{_where(exc)}",
            hint='Run the program only under `if __name__ == "__main__":`.',
        ) from None
    except KeyboardInterrupt:
        raise  # Ctrl-C while importing: stop as at any other moment
    except BaseException as exc:  # noqa: BLE001  (whatever the user's module raises, said plainly)
        raise _failed(module_name, exc) from None
    if attr and not hasattr(module, attr):
        raise ConfigError(f"app module {module_name!r} has no attribute {attr!r}")
    if settings is None:
        register_agents(agents_in(module).values(), into=into)
    else:
        source = str(settings.config_file or "the settings file")
        register_agents(agents_in(module).values(), settings.agents, source=source, into=into)
    return module


_IMPORTLIB = Path(importlib.__file__).parent


def _dotted(name: str) -> bool:
    return all(part.isidentifier() for part in name.split("."))


def _names_app(missing: str, module_name: str) -> bool:
    """Whether the module found missing is the app module itself or a package above it."""
    return module_name == missing or module_name.startswith(missing + ".")


def _failed(module_name: str, exc: BaseException) -> ConfigError:
    what = str(exc) if isinstance(exc, ImportError) else f"{type(exc).__name__}: {exc}"
    if isinstance(exc, ModuleNotFoundError):
        hint = "Install the missing package in this environment (the one running toren)."
    elif isinstance(exc, ImportError):
        hint = "Fix the import."
    else:
        hint = "Fix the module so that importing it succeeds."
    return ConfigError(
        f"app module {module_name!r} failed to import: {what}{_where(exc)}", hint=hint
    )


def _where(exc: BaseException, most: int = 5) -> str:
    """A line ``  at FILE:LINE: SOURCE`` for each frame of the user's code in ``exc``'s
    traceback (the last ``most``; not the import machinery's, not Toren's), outermost first."""
    frames = [
        frame
        for frame in traceback.extract_tb(exc.__traceback__)
        if not frame.filename.startswith("<")
        and frame.filename != __file__
        and Path(frame.filename).parent != _IMPORTLIB
    ]
    return "".join(
        f"\n  at {_shown(frame.filename)}:{frame.lineno}"
        + (f": {frame.line.strip()}" if frame.line else "")
        for frame in frames[-most:]
    )


def _syntax(exc: SyntaxError) -> str:
    """``FILE, line N: MESSAGE`` and the offending line with a caret under the place."""
    where = f"{_shown(exc.filename)}, line {exc.lineno}" if exc.filename else "?"
    text = f"{where}: {exc.msg}"
    if exc.text:
        line = exc.text.rstrip("\n")
        stripped = line.lstrip()
        text += f"\n    {stripped}"
        if exc.offset:
            column = max(exc.offset - 1 - (len(line) - len(stripped)), 0)
            text += "\n    " + " " * column + "^"
    return text


def _shown(filename: str) -> str:
    """A path relative to the current directory when it is below it."""
    path = Path(filename)
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return filename


def loaded_agents(module: ModuleType) -> list[Agent]:
    """The agents ``module`` defines, as :func:`load_app` registered them (with their
    settings)."""
    return [agent_named(name) or agent for name, agent in agents_in(module).items()]
