-- Journals that start after seq 1 (issue 32, item 4): a never-ending actor (a run that chats
-- for months) has the events behind its snapshot, older than its retention, archived to the
-- archive store and deleted. Each archived range is one row here, written in the transaction
-- that deletes its journal rows, so that the journal's rows and its archived ranges together
-- always cover seq 1 to the journal's end without a gap. A state rebuilt without a usable
-- snapshot reads the archives named here, then the journal's rows. The ranges go with their
-- actor (a pruned run's audit record keeps only its last archive).
CREATE TABLE toren.journal_archives (
    actor_id    text NOT NULL REFERENCES toren.actors (actor_id) ON DELETE CASCADE,
    first_seq   bigint NOT NULL CHECK (first_seq > 0),
    last_seq    bigint NOT NULL CHECK (last_seq >= first_seq),
    ref         jsonb NOT NULL,   -- toren._core.archive.ArchiveRef.to_json()
    created_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (actor_id, first_seq)
);
