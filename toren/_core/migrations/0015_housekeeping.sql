-- Housekeeping of what nothing deleted before (issue 32, item 5). Dead letters older than
-- `deadletter_keep_for` are archived a batch at a time and then deleted: this index finds them
-- without reading the whole table (toren/_core/deadletters.py). Revoked and expired tokens are
-- deleted by the housekeeping statement (toren/_core/workers.py); the tokens table is small.
CREATE INDEX deadletters_dead_at ON toren.deadletters (dead_at);
