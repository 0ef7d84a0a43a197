"""Log setup for the command line: one line per record on stderr, UTC timestamps."""

from __future__ import annotations

import logging
import sys
import time


def configure(level: str = "INFO") -> None:
    """Send Toren's logs (and the root logger's) to stderr."""
    handler = logging.StreamHandler(sys.stderr)
    formatter = logging.Formatter("%(asctime)s.%(msecs)03dZ %(levelname)s %(name)s: %(message)s")
    formatter.datefmt = "%Y-%m-%dT%H:%M:%S"
    formatter.converter = time.gmtime
    handler.setFormatter(formatter)
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
