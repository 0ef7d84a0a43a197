"""Loading the user's application: the module that defines their actors and agents."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType

from toren._agents import Agent, agent_named, agents_in, register_agents
from toren._config import Settings
from toren._errors import ConfigError


def load_app(spec: str, settings: Settings | None = None) -> ModuleType:
    """Import ``MODULE[:ATTR]`` so that its actor classes and payload types register, and
    register its agents, each merged with its ``[agents.NAME]`` table in ``settings``.

    The current directory is put on ``sys.path`` first, as ``python -m`` would.

    Raises:
        ConfigError: the module cannot be imported, ``ATTR`` is missing, or an agent merged
            with its table in the settings file is invalid (the message names the file).
    """
    module_name, _, attr = spec.partition(":")
    if str(Path.cwd()) not in sys.path:
        sys.path.insert(0, str(Path.cwd()))
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(
            f"cannot import app module {module_name!r}: {exc}",
            hint="Pass --app (or TOREN_APP) as an importable module path, e.g. myproject.agents.",
        ) from exc
    if attr and not hasattr(module, attr):
        raise ConfigError(f"app module {module_name!r} has no attribute {attr!r}")
    if settings is None:
        register_agents(agents_in(module).values())
    else:
        source = str(settings.config_file or "the settings file")
        register_agents(agents_in(module).values(), settings.agents, source=source)
    return module


def loaded_agents(module: ModuleType) -> list[Agent]:
    """The agents ``module`` defines, as :func:`load_app` registered them (with their
    settings)."""
    return [agent_named(name) or agent for name, agent in agents_in(module).items()]
