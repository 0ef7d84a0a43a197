-- Snapshots that cost what changed: the long sequences of an actor's state (a run's calls and
-- messages) are stored in chunks written once, so a snapshot writes only what was added since
-- the last one and an activation reads bytes, decoding a chunk only when something reads it.
-- A snapshot (toren.snapshots) names its chunks; chunks no snapshot names are deleted with the
-- next snapshot. Snapshots and chunks go with their actor.

DELETE FROM toren.snapshots s
WHERE NOT EXISTS (SELECT 1 FROM toren.actors a WHERE a.actor_id = s.actor_id);

ALTER TABLE toren.snapshots
    ADD FOREIGN KEY (actor_id) REFERENCES toren.actors (actor_id) ON DELETE CASCADE;

CREATE TABLE toren.snapshot_chunks (
    actor_id    text NOT NULL REFERENCES toren.actors (actor_id) ON DELETE CASCADE,
    key         text NOT NULL,
    data        bytea NOT NULL,
    PRIMARY KEY (actor_id, key)
);
