# The old name of toren.sandboxes.checkpoints, for type checkers
# (toren/sandbox/__init__.py makes it the same module at run time).
from toren.sandboxes.checkpoints import *  # noqa: F403
