# The old name of toren.sandboxes.listing, for type checkers
# (toren/sandbox/__init__.py makes it the same module at run time).
from toren.sandboxes.listing import *  # noqa: F403
