"""``python -m toren`` is the ``toren`` command."""

from toren.cli import main

main()
