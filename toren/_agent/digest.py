"""Request digests: what a recorded model call was asked, in a form that can be compared.

Each recorded model call carries the digest of its canonical request (model, system, messages,
tools, parameters), chained from the previous call's digest: ``d_k = sha256(d_{k-1} + c_k)``,
where ``c_k`` holds the parameters and only the messages added since call ``k-1`` (a run's
conversation only grows, so the chain still covers every message). Checking a journal is then
linear in its size, and a change anywhere in the history shows at the first step that differs.
The canonical form is JSON with sorted keys and no insignificant whitespace (strings Postgres
cannot hold written as :mod:`toren._core.json_text` tags them), built from the neutral request
(never a provider's wire format), so the digest does not move when an SDK changes how it serialises.
"""

from __future__ import annotations

import hashlib

import attrs

from toren._agent.model import ModelRequest
from toren._core.codec import converter
from toren._core.json_text import dumps

GENESIS = "0" * 64


def canonical(request: ModelRequest, *, since: int = 0) -> bytes:
    """The request as canonical JSON bytes, with only its messages from index ``since`` on."""
    if since:
        request = attrs.evolve(request, messages=request.messages[since:])
    return dumps(converter.unstructure(request), sort_keys=True).encode()


def chain(previous: str, request: ModelRequest, *, since: int = 0) -> str:
    """The digest of ``request`` chained after ``previous`` (``GENESIS`` for the first call);
    ``since`` is how many messages the previous call already covered."""
    h = hashlib.sha256()
    h.update(previous.encode())
    h.update(canonical(request, since=since))
    return h.hexdigest()
