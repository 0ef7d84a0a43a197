"""The old name of :mod:`toren.sandboxes`, kept so that code written against it runs unchanged.

``toren.sandbox`` is the same module object as ``toren.sandboxes``, and ``toren.sandbox.files``
(or any module under it) the same module as ``toren.sandboxes.files``: a class imported by either
name is one class.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from types import ModuleType
from typing import TYPE_CHECKING, Any

import toren.sandboxes

if TYPE_CHECKING:
    from toren.sandboxes import *  # noqa: F403

_OLD, _NEW = __name__, "toren.sandboxes"


class _SameModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds ``toren.sandbox.<name>`` as the module ``toren.sandboxes.<name>`` already is.

    The module keeps its own spec (the import system gives it the alias's while loading it
    under the old name; :meth:`exec_module` puts its own back), so that ``importlib.reload``
    and ``find_spec`` of the new name behave as for any module."""

    def find_spec(
        self, fullname: str, path: Any = None, target: Any = None
    ) -> importlib.machinery.ModuleSpec | None:
        if not fullname.startswith(_OLD + "."):
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        module = importlib.import_module(_NEW + spec.name[len(_OLD) :])
        spec.loader_state = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        """Nothing to run (the module ran under its new name): its own spec goes back."""
        own = module.__spec__.loader_state if module.__spec__ is not None else None
        if own is not None:
            module.__spec__ = own


if not any(isinstance(finder, _SameModules) for finder in sys.meta_path):
    sys.meta_path.insert(0, _SameModules())
sys.modules[_OLD] = toren.sandboxes
