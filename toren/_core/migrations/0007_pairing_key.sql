-- The key pairing codes are hashed with (HMAC-SHA256, toren/channels/pairing.py) when
-- TOREN_PAIRING_KEY is not set: 32 random bytes, made by the first process that needs them
-- (INSERT ... ON CONFLICT DO NOTHING, then a read) and shared by every process of the fleet.
-- A table of its own, never the journal: whoever reads a channel's journal (a copy, a backup,
-- an export) holds code hashes but not the key to test guesses against them.

CREATE TABLE toren.pairing_key (
    id          smallint PRIMARY KEY CHECK (id = 1),
    secret      bytea NOT NULL CHECK (octet_length(secret) >= 32),
    created_at  timestamptz NOT NULL DEFAULT now()
);
