"""Loading the user's application: the module that defines their actors (and, later, agents)."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType

from toren._errors import ConfigError


def load_app(spec: str) -> ModuleType:
    """Import ``MODULE[:ATTR]`` so that its actor classes and payload types register.

    The current directory is put on ``sys.path`` first, as ``python -m`` would.

    Raises:
        ConfigError: the module cannot be imported, or ``ATTR`` is missing.
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
    from toren._agents import agents_in, register_agents

    register_agents(agents_in(module).values())
    return module
