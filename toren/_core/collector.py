"""Pausing Python's cycle collector while a long state is built.

Building a long run's state (folding its journal, reading its snapshot) makes hundreds of
thousands of objects, none of them garbage. Meanwhile the collector would run over and over, and
each young collection walks every persistent vector made since the last one in full
(``pyrsistent``'s C vector reports all its items to the collector), so the build would cost time
that grows faster than the journal. Reference counting still frees what is dropped meanwhile; only
cycles wait for the collector's return.

Pauses nest, also across tasks: the collector is off while any pause is open and back on once the
last one closes (unless it was off before the first).
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


class _Pauses:
    """The pauses open in this process (the collector is process-wide, so they are too), and
    whether the collector was on before the first of them."""

    __slots__ = ("open", "restore")

    def __init__(self) -> None:
        self.open = 0
        self.restore = False


_PAUSES = _Pauses()


@contextlib.contextmanager
def paused() -> Iterator[None]:
    """The cycle collector off for the ``with`` block (see the module's docstring)."""
    if _PAUSES.open == 0:
        _PAUSES.restore = gc.isenabled()
        gc.disable()
    _PAUSES.open += 1
    try:
        yield
    finally:
        _PAUSES.open -= 1
        if _PAUSES.open == 0 and _PAUSES.restore:
            gc.enable()
