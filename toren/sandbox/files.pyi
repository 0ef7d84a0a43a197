# The old name of toren.sandboxes.files, for type checkers
# (toren/sandbox/__init__.py makes it the same module at run time).
from toren.sandboxes.files import *  # noqa: F403
