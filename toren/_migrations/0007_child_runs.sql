-- Child runs (cross-agent calls) are found from their parent: a decision sent on a parent's
-- page goes to the child run that waits, and a run's page lists its children. Only actors that
-- have a parent are indexed.
CREATE INDEX IF NOT EXISTS actors_parent ON toren.actors (parent) WHERE parent IS NOT NULL;
