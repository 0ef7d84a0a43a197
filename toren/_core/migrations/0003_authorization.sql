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

-- Names were free text: an empty one becomes "token <id>", a long one is cut to 100 characters,
-- and a live token whose name an older live token holds gets its id appended (again, until the
-- name is free).
UPDATE toren.tokens SET name = 'token ' || id WHERE name = '';
UPDATE toren.tokens SET name = left(name, 100) WHERE length(name) > 100;
CREATE TEMPORARY TABLE kept (id text PRIMARY KEY) ON COMMIT DROP;
DO $$
DECLARE
    t record;
    wanted text;
BEGIN
    FOR t IN SELECT id, name FROM toren.tokens WHERE revoked_at IS NULL ORDER BY created_at, id
    LOOP
        wanted := t.name;
        WHILE EXISTS (
            SELECT 1 FROM toren.tokens o
            WHERE o.name = wanted AND o.revoked_at IS NULL AND o.id <> t.id
              AND o.id IN (SELECT id FROM pg_temp.kept)
        ) LOOP
            wanted := wanted || '-' || t.id;
        END LOOP;
        UPDATE toren.tokens SET name = wanted WHERE id = t.id;
        INSERT INTO pg_temp.kept VALUES (t.id);
    END LOOP;
END
$$;
CREATE UNIQUE INDEX tokens_live_name ON toren.tokens (name) WHERE revoked_at IS NULL;
