-- Retention (issue 32): what is kept of a run once its journal is pruned, and what each prune
-- removed.
--
-- A pruned run leaves one row in toren.run_audit, written in the transaction that deletes its
-- actor row and journal (toren/runs/prune.py): who started it and how, each decision, its
-- receipt, how it ended and where its journal was archived, if it was. The row outlives the
-- journal: the API and the CLI show a pruned run from it, the costs surface sums it with the
-- live runs, and a start retried with the run's idempotency key finds it (its run id is the
-- key's) and answers with the pruned run instead of starting a second one. A row is deleted
-- only when its run is restored into the journal (`toren jobs restore --into-journal`: the
-- journal is the record again, and a later prune writes a new row). Not a kernel table: the run kind reads and writes it (toren/runs/audit.py).
CREATE TABLE toren.run_audit (
    run_id       text PRIMARY KEY,
    root_id      text NOT NULL,        -- the run at the top of its tree (itself for a root)
    parent       text,                 -- the run that started it by a cross-agent call
    agent        text NOT NULL,
    version      text NOT NULL DEFAULT '',
    args         jsonb NOT NULL,       -- as spawned: start digest, concurrency key, schedule...
    started_by   jsonb,                -- the principal of run.started (how: its via)
    decisions    jsonb NOT NULL DEFAULT '[]',
    receipt      jsonb NOT NULL,       -- Receipt's fields, decimals as strings
    status       text NOT NULL CHECK (status IN ('completed', 'failed', 'cancelled')),
    error_class  text,
    error        text,
    created_at   timestamptz NOT NULL, -- the run's row's creation
    ended_at     timestamptz,          -- its last event
    pruned_at    timestamptz NOT NULL DEFAULT now(),
    archive      jsonb,                -- toren._core.archive.ArchiveRef.to_json(), or NULL
    -- the ranges archived before `archive` as the run went on (a long conversation's journal
    -- truncated behind its snapshot: toren.journal_archives), oldest first
    earlier_archives jsonb NOT NULL DEFAULT '[]',
    events       integer NOT NULL
);
CREATE INDEX run_audit_by_agent ON toren.run_audit (agent, created_at);
CREATE INDEX run_audit_by_day ON toren.run_audit (created_at);

-- One row per prune batch that removed something (what `/metrics` and `toren jobs prune
-- --stats` show as the last prune).
CREATE TABLE toren.prune_log (
    id        bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    agent     text NOT NULL,
    at        timestamptz NOT NULL DEFAULT now(),
    runs      integer NOT NULL,
    events    bigint NOT NULL,
    bytes     bigint NOT NULL,     -- the journal rows' stored size (pg_column_size of data)
    archived  integer NOT NULL,    -- runs whose journal was archived first
    skipped   integer NOT NULL,    -- candidates left for a later batch (locked, changed)
    took      double precision NOT NULL  -- seconds, the whole batch
);

-- A tree's actors are found by their parent (a run's child runs and its sandbox): without an
-- index each level of the search would read every actor. Parents are never updated, so a
-- step's update of its row stays HOT.
CREATE INDEX actors_parent ON toren.actors (parent) WHERE parent IS NOT NULL;
