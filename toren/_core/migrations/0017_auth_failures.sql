-- Failed authentications per client address (issue 33, item 3), shared by every API server
-- process on this database, so that `failed_auth_per_minute` holds for the fleet and not per
-- process (toren/_surfaces/http/guard.py). One row per failure, kept a minute; `kind` keeps
-- the counts of bearer tokens and console sign-ins (`http`), Telegram's webhook (`webhook`)
-- and the MCP server (`mcp`) apart. `address` is the client address as bytes (it may come
-- from a proxy's X-Forwarded-For: any text). UNLOGGED: a failure costs no WAL flush, and what
-- a crash or a failover forgets is at most a minute of counts.
CREATE UNLOGGED TABLE toren.auth_failures (
    kind     text NOT NULL,
    address  bytea NOT NULL,
    at       timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE INDEX auth_failures_address ON toren.auth_failures (kind, address, at DESC);
CREATE INDEX auth_failures_at ON toren.auth_failures (at);

-- An attempt of `address` (toren/_surfaces/http/guard.py): under a lock of its own address (a
-- transaction-level advisory lock; the class is "tora"), so that attempts racing from any
-- process are counted one after another. Blocked (`p_limit` failures within the last minute):
-- the seconds until the oldest of them that counts is a minute old, and nothing is written.
-- Otherwise it is counted as a failure at once, before its credential is checked (the caller
-- deletes it, by `counted_at`, if the credential passes), with a few expired rows of any
-- address swept. A VOLATILE function: each statement sees what committed before the lock.
CREATE FUNCTION toren.auth_attempt(p_kind text, p_address bytea, p_limit integer)
RETURNS TABLE (retry_after double precision, counted_at timestamptz)
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    oldest timestamptz;
BEGIN
    PERFORM pg_advisory_xact_lock(1953460833, hashtext(p_kind || ':' || encode(p_address, 'hex')));
    SELECT f.at INTO oldest FROM toren.auth_failures f
    WHERE f.kind = p_kind AND f.address = p_address AND f.at > clock_timestamp() - interval '1 minute'
    ORDER BY f.at DESC OFFSET p_limit - 1 LIMIT 1;
    IF oldest IS NOT NULL THEN
        RETURN QUERY SELECT
            greatest(extract(epoch FROM oldest + interval '1 minute' - clock_timestamp()), 0.001)::float8,
            NULL::timestamptz;
        RETURN;
    END IF;
    DELETE FROM toren.auth_failures WHERE ctid IN (
        SELECT ctid FROM toren.auth_failures WHERE at <= clock_timestamp() - interval '1 minute'
        LIMIT 100 FOR UPDATE SKIP LOCKED
    );
    RETURN QUERY INSERT INTO toren.auth_failures (kind, address) VALUES (p_kind, p_address)
        RETURNING NULL::float8, auth_failures.at;
END
$$;
