-- Steps notify toren_journal only for actors someone follows. A follower (an event stream of
-- the API) sets watched_until on the actor's row before it reads the journal, and renews it
-- while it follows; a step whose actor is watched notifies in its commit. The step reads the
-- column from the row it locks as its fence, so a watch set while a step is in flight is seen
-- by that step or its events by the follower's read, never neither (see toren/_client.py).
-- Before, every step of a run notified: a commit that notifies takes a lock that serializes it
-- with every other notifying commit, their WAL flushes included.
ALTER TABLE toren.actors ADD COLUMN watched_until timestamptz;
