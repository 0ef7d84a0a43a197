-- What the HTTP API, the console, the MCP server and `toren jobs list` read without folding
-- journals, and the credentials they accept.

-- An actor's summary (Actor.summarize), written by every step that emits an event, in the
-- step's own statement: a run's agent, status, cost and the like.
ALTER TABLE toren.actors ADD COLUMN summary jsonb;
CREATE INDEX actors_by_kind ON toren.actors (kind, created_at DESC, actor_id);

-- API tokens: `trn_<id>_<secret>`; only a SHA-256 of the secret is kept.
CREATE TABLE toren.tokens (
    id            text PRIMARY KEY,
    name          text NOT NULL,
    secret_sha256 bytea NOT NULL,
    created_at    timestamptz NOT NULL DEFAULT now(),
    revoked_at    timestamptz,
    last_used_at  timestamptz
);

-- Console sessions: a browser that signed in with a token holds a cookie whose SHA-256 is
-- kept here with the CSRF token its writes must carry.
CREATE TABLE toren.sessions (
    id_sha256   bytea PRIMARY KEY,
    token_id    text NOT NULL REFERENCES toren.tokens (id) ON DELETE CASCADE,
    csrf        text NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT now(),
    expires_at  timestamptz NOT NULL
);
CREATE INDEX sessions_expiry ON toren.sessions (expires_at);
