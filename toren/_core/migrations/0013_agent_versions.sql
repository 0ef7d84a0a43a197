-- When each agent version was first seen (issue 31): an agent's newest version is, of the
-- versions live workers serve, the one first seen latest, so an old worker that restarts
-- during a rolling deploy does not make the old version the newest again. A worker inserts its
-- agents' versions as it registers (ON CONFLICT DO NOTHING: a version seen before keeps its
-- time). Rows are never deleted: one per version ever deployed, and a version's time must
-- outlive the workers serving it (deleted, a restarted old worker would be seen anew).
CREATE TABLE toren.agent_versions (
    agent       text NOT NULL,
    version     text NOT NULL,
    first_seen  timestamptz NOT NULL DEFAULT clock_timestamp(),
    PRIMARY KEY (agent, version)
);

-- The versions registered workers publish now (a fleet upgraded in place), as first seen when
-- the earliest worker serving each started.
INSERT INTO toren.agent_versions (agent, version, first_seen)
SELECT c.agent, c.card->>'version', min(w.started_at)
FROM toren.workers w
CROSS JOIN LATERAL jsonb_each(CASE jsonb_typeof(w.stats->'agents')
                              WHEN 'object' THEN w.stats->'agents' ELSE '{}'::jsonb END)
    AS c(agent, card)
WHERE jsonb_typeof(c.card->'version') = 'string' AND c.card->>'version' <> ''
GROUP BY c.agent, c.card->>'version';
