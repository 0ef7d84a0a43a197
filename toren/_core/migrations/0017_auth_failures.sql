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
