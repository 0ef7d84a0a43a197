"""The key pairing codes are hashed with, so that the journal holds nothing a code can be tested
against; and the issued code a ``/pair CODE`` names (:func:`issued_code`).

A pairing code has about 50 bits. Recorded as its plain SHA-256, anyone who reads the channel's
journal (a copy, a backup, an export) could find an unused code offline in reasonable time and
pair a chat of their own. So a code is recorded as HMAC-SHA256 under a key that is not in the
journal:

- ``TOREN_PAIRING_KEY`` (or ``TOREN_PAIRING_KEY_FILE``), at least 32 characters, when it is set.
  Every process that issues codes (``toren channels pair``) or checks them (the workers that run
  the bots) must then have the same one.
- Otherwise a random 32-byte key kept in Postgres, in ``toren.pairing_key`` (a table of its own,
  never the journal): the first process that needs it creates it (``INSERT ... ON CONFLICT DO
  NOTHING``, then a read, so processes starting together agree), and every process of the fleet
  reads the same one without configuration.

A code's request carries the key's id (an HMAC of a fixed label, not the key), so a worker whose
key differs refuses to record a code nobody could use, and says why. The key is never logged,
shown (``repr`` leaves it out) or journaled.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from collections.abc import Mapping

import asyncpg
import attrs

from toren._core.errors import ConfigError
from toren.channels._events import CodeIssued
from toren.channels._state import ChannelState

KEY_VAR = "TOREN_PAIRING_KEY"
MIN_KEY_CHARS = 32
_KEY_BYTES = 32
_ID_LABEL = b"toren pairing key id"


@attrs.frozen
class PairingKey:
    """A key to hash pairing codes with."""

    secret: bytes = attrs.field(repr=False)

    def digest(self, code: str) -> str:
        """How ``code`` is recorded and looked up: HMAC-SHA256 of it, trimmed and upper-cased
        (a code typed in lower case on a phone still pairs), in hex."""
        normal = code.strip().upper().encode()
        return hmac.new(self.secret, normal, hashlib.sha256).hexdigest()

    @property
    def id(self) -> str:
        """Which key this is, safe to send and show: it tells keys apart, never the key."""
        return hmac.new(self.secret, _ID_LABEL, hashlib.sha256).hexdigest()[:16]


async def pairing_key(
    db: asyncpg.Pool | asyncpg.Connection, env: Mapping[str, str] | None = None
) -> PairingKey:
    """The key of this process: ``TOREN_PAIRING_KEY`` from ``env`` (default: ``os.environ``),
    else the fleet's key in ``toren.pairing_key``, created on first use.

    Raises:
        ConfigError: ``TOREN_PAIRING_KEY`` is shorter than 32 characters (its value is not
            shown).
    """
    env = os.environ if env is None else env
    configured = env.get(KEY_VAR, "")
    if configured:
        if len(configured) < MIN_KEY_CHARS:
            raise ConfigError(
                f"{KEY_VAR} must be at least {MIN_KEY_CHARS} characters (its value is not shown)",
                hint="Generate one: python -c 'import secrets; print(secrets.token_urlsafe(32))'; "
                "or unset it everywhere to use the key Toren keeps in the database.",
            )
        return PairingKey(configured.encode())
    found = await db.fetchval("SELECT secret FROM toren.pairing_key WHERE id = 1")
    if found is None:
        # Two processes may get here at once: one insert wins, and both read the winner's key.
        await db.execute(
            "INSERT INTO toren.pairing_key (id, secret) VALUES (1, $1) ON CONFLICT (id) DO NOTHING",
            secrets.token_bytes(_KEY_BYTES),
        )
        found = await db.fetchval("SELECT secret FROM toren.pairing_key WHERE id = 1")
    return PairingKey(bytes(found))


def issued_code(state: ChannelState, digest: str, now: float) -> CodeIssued | None:
    """The code whose keyed hash is ``digest``, if it is issued, unused and unexpired. A code
    recorded before keyed hashes (plain SHA-256, ``keyed`` false) never matches: it counts as
    expired."""
    issued = state.codes.get(digest)
    if issued is None or not issued.keyed or issued.expires_at <= now:
        return None
    return issued
