-- What a token may do (scopes), for how long (expiry), and on which agents' runs; names that
-- identify one live token.

-- Tokens made before scopes existed keep every scope; `toren tokens create` always says which.
ALTER TABLE toren.tokens
    ADD COLUMN scopes text[] NOT NULL DEFAULT ARRAY['read', 'operate', 'approve'],
    ADD COLUMN agents text[],  -- NULL: any agent; else writes only to runs of these agents
    ADD COLUMN expires_at timestamptz;  -- NULL: never
ALTER TABLE toren.tokens ALTER COLUMN scopes SET DEFAULT ARRAY['read'];
ALTER TABLE toren.tokens ADD CONSTRAINT tokens_scopes_known
    CHECK (scopes <@ ARRAY['read', 'operate', 'approve'] AND cardinality(scopes) > 0);

-- Names were free text: a later live token that shares a name gets its id appended.
UPDATE toren.tokens t SET name = t.name || '-' || t.id
WHERE t.revoked_at IS NULL AND EXISTS (
    SELECT 1 FROM toren.tokens o
    WHERE o.name = t.name AND o.revoked_at IS NULL
      AND (o.created_at, o.id) < (t.created_at, t.id)
);
CREATE UNIQUE INDEX tokens_live_name ON toren.tokens (name) WHERE revoked_at IS NULL;
