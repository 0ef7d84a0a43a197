-- A cancelled run has a status of its own, `cancelled` (it was `failed`, with error class
-- `cancelled`). The journal does not change: a cancel still records `run.failed` of class
-- `cancelled`, and the fold reads it as cancelled. What changes is the summary each run's row
-- keeps (what lists, filters and `/metrics` read): the rows of runs cancelled before this
-- migration say so too. Their run_status column follows (it is generated from the summary),
-- and the triggers of migration 0006 move their counts from `failed` to `cancelled` as they
-- count any other status change. Snapshots of a run's state stored before this version are set
-- aside by their version (toren.runs.SNAPSHOT_VERSION), so a worker folds such a run again.
UPDATE toren.actors
SET summary = summary || '{"status": "cancelled"}'::jsonb
WHERE kind = 'toren.run'
  AND run_status = 'failed'
  AND summary->>'error_class' = 'cancelled';
