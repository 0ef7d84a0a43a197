"""Request digests: what a recorded model call was asked, in a form that can be compared.

Each recorded model call carries the digest of its canonical request (model, system, messages,
tools, parameters), chained from the previous call's digest: ``d_k = sha256(d_{k-1} + c_k)``.
Checking a journal is then linear, and a change anywhere in the history shows at the first step
that differs. The canonical form is JSON with sorted keys and no insignificant whitespace, built
from the neutral request (never a provider's wire format), so the digest does not move when an
SDK changes how it serialises.
"""

from __future__ import annotations

import hashlib

import orjson

from toren._codec import converter
from toren._model import ModelRequest

GENESIS = "0" * 64


def canonical(request: ModelRequest) -> bytes:
    """The request as canonical JSON bytes."""
    return orjson.dumps(converter.unstructure(request), option=orjson.OPT_SORT_KEYS)


def chain(previous: str, request: ModelRequest) -> str:
    """The digest of ``request`` chained after ``previous`` (``GENESIS`` for the first call)."""
    h = hashlib.sha256()
    h.update(previous.encode())
    h.update(canonical(request))
    return h.hexdigest()
