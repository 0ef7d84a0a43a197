-- Costs that stay flat as data grows (claims, lists).

-- Claiming whose cost does not grow with sleeping actors: mail to be handled at once and mail
-- for later are indexed apart (see toren/_leases.py, _CLAIMABLE). A message is for later when
-- it was made visible after it was created (a durable timer, a delayed send).
CREATE INDEX mailbox_immediate ON toren.mailbox (actor_id) WHERE visible_at <= created_at;
CREATE INDEX mailbox_delayed ON toren.mailbox (visible_at) WHERE visible_at > created_at;

-- Listing runs by status or by agent, newest first (toren/_listing.py), without a scan. The
-- status is a stored column of its own, computed from the summary: an index on an expression of
-- the summary would make every step's summary update a non-HOT one (new entries in every index
-- of the table); a column whose value did not change keeps the update HOT.
ALTER TABLE toren.actors
    ADD COLUMN run_status text GENERATED ALWAYS AS (coalesce(summary->>'status', 'running')) STORED;
CREATE INDEX actors_runs_by_status ON toren.actors (run_status, created_at DESC, actor_id DESC)
    WHERE kind = 'toren.run';
CREATE INDEX actors_runs_by_route ON toren.actors (route, created_at DESC, actor_id DESC)
    WHERE kind = 'toren.run';
