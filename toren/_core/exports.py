"""A package's public names, each imported from its module on first use (PEP 562).

A package that lists where its names live (``_HOMES``: module -> names) gets its module-level
``__getattr__`` and ``__dir__`` here::

    __getattr__, __dir__ = lazy_exports(__name__, _HOMES)

so importing the package costs nothing of what its names need until one is used: ``toren
--help`` does not pay for the agent layer, the kernel's client and their libraries.
``tests/test_floors.py`` reads each ``_HOMES`` as the package's imports, made late.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping


def lazy_exports(
    package: str, homes: Mapping[str, tuple[str, ...]]
) -> tuple[Callable[[str], object], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for ``package``, whose public names live in ``homes``.

    ``__getattr__(name)`` imports ``name``'s module (the first listing it) and returns the name
    from it; ``__dir__()`` lists the package's globals and its ``__all__``, sorted.
    """
    home_of: dict[str, str] = {}
    for home, exported in homes.items():
        for name in exported:
            home_of.setdefault(name, home)

    def public_name(name: str) -> object:
        """A public name, imported from its module on first use.

        Raises:
            AttributeError: no such name.
        """
        home = home_of.get(name)
        if home is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(home), name)

    def listing() -> list[str]:
        module = sys.modules[package]
        return sorted({*vars(module), *getattr(module, "__all__", ())})

    return public_name, listing
