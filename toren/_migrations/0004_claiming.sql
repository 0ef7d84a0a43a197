-- Claiming whose cost does not grow with sleeping actors: mail to be handled at once and mail
-- for later are indexed apart (see toren/_leases.py, _CLAIMABLE). A message is for later when
-- it was made visible after it was created (a durable timer, a delayed send).
CREATE INDEX mailbox_immediate ON toren.mailbox (actor_id) WHERE visible_at <= created_at;
CREATE INDEX mailbox_delayed ON toren.mailbox (visible_at) WHERE visible_at > created_at;
