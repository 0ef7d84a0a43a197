# The old name of toren.sandboxes.store, for type checkers
# (toren/sandbox/__init__.py makes it the same module at run time).
from toren.sandboxes.store import *  # noqa: F403
