"""The key pairing codes are hashed with: a keyed hash (HMAC-SHA256) whose key is not in the
journal; ``TOREN_PAIRING_KEY``, else one random key kept in Postgres and shared by the fleet.
Codes recorded before keyed hashes (plain SHA-256) count as expired."""

from __future__ import annotations

import hashlib

import anyio
import pytest

from toren import Client, ConfigError
from toren.channels import (
    ChannelState,
    CodeIssued,
    PairingKey,
    fold,
    issued_code,
    pairing_key,
    pending_codes,
    telegram_principal,
)

pytestmark = pytest.mark.anyio

CODE = "K7MPQ2RX9T"
KEY = PairingKey(b"a-pairing-key-for-tests-32-bytes")
WHO = telegram_principal(7, "ann")


def test_a_code_hash_depends_on_the_key_and_never_shows_it() -> None:
    other = PairingKey(b"another-pairing-key-of-32-bytes!")
    assert KEY.digest(CODE) != other.digest(CODE)  # a hash made with another key never matches
    assert KEY.digest(CODE) != hashlib.sha256(CODE.encode()).hexdigest()
    assert KEY.digest(f" {CODE.lower()}\n") == KEY.digest(CODE)  # as typed on a phone
    assert KEY.id != other.id
    assert KEY.secret.decode() not in repr(KEY)


def test_a_code_recorded_before_keyed_hashes_counts_as_expired() -> None:
    old = CodeIssued(
        code_hash=hashlib.sha256(CODE.encode()).hexdigest(), expires_at=100.0, by=WHO, at=1.0
    )
    state = fold(ChannelState(), old)
    assert pending_codes(state, now=2.0) == 0
    assert issued_code(state, old.code_hash, now=2.0) is None
    assert issued_code(state, KEY.digest(CODE), now=2.0) is None
    new = CodeIssued(code_hash=KEY.digest(CODE), expires_at=100.0, by=WHO, at=1.0, keyed=True)
    state = fold(state, new)
    assert pending_codes(state, now=2.0) == 1
    assert issued_code(state, KEY.digest(CODE), now=2.0) == new
    assert issued_code(state, KEY.digest(CODE), now=100.0) is None  # expired


async def test_processes_without_a_configured_key_share_one_made_once(client: Client) -> None:
    keys: list[PairingKey] = []

    async def first_use() -> None:
        keys.append(await pairing_key(client.pool, env={}))

    async with anyio.create_task_group() as tg:  # processes starting together
        for _ in range(5):
            tg.start_soon(first_use)
    assert len({k.secret for k in keys}) == 1
    assert len(keys[0].secret) == 32
    assert await client.pool.fetchval("SELECT count(*) FROM toren.pairing_key") == 1
    assert await pairing_key(client.pool, env={}) == keys[0]  # and it stays


async def test_a_configured_key_is_used_and_a_short_one_refused_unshown(client: Client) -> None:
    configured = "x" * 32
    key = await pairing_key(client.pool, env={"TOREN_PAIRING_KEY": configured})
    assert key == PairingKey(configured.encode())
    assert await client.pool.fetchval("SELECT count(*) FROM toren.pairing_key") == 0
    short = "sk-too-short-to-be-a-key"
    with pytest.raises(ConfigError, match="at least 32 characters") as refused:
        await pairing_key(client.pool, env={"TOREN_PAIRING_KEY": short})
    assert short not in str(refused.value)
