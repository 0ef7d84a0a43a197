-- Runs counted by status as their status changes, so that `/metrics` reads a few rows instead
-- of counting every run at every scrape (toren/_http/metrics.py reads toren.run_status_counts).
--
-- A status change appends a row to toren.run_status_changes (the run's status before and after;
-- NULL when the run did not exist before or does not after). Appending takes no lock that
-- another transaction can hold, so counting never makes two steps wait for each other or
-- deadlock, however many runs one transaction changes and in whatever order. (Counters updated
-- in place would: a step that spawns a child and parks locks `running` then `parked`, another
-- run resuming locks `parked` then `running`; and each lock would be held until its
-- transaction commits, a caller's long transaction included.) Every 64th change, the
-- transaction that appends it folds the changes into toren.run_counts, one row per status, if
-- no other transaction is folding (a try-lock: a fold never waits either). So a scrape reads
-- one row per status plus the changes not yet folded, whatever the number of runs.
--
-- The counts are those of `SELECT run_status, count(*) FROM toren.actors WHERE kind =
-- 'toren.run' GROUP BY run_status`, exactly, at every snapshot: changes are rows written in the
-- transaction that changes the status, and a fold moves them in one statement. A fold skipped
-- (another one holds the lock, or the transaction is not read committed) leaves the changes for
-- the next one; nothing is lost, a scrape only reads a few more rows meanwhile.

CREATE TABLE toren.run_counts (
    status  text PRIMARY KEY,
    n       bigint NOT NULL
);

-- No index: it is appended to and emptied whole (its id only paces the folds).
CREATE TABLE toren.run_status_changes (
    id          bigint GENERATED ALWAYS AS IDENTITY,
    old_status  text,
    new_status  text
);

CREATE VIEW toren.run_status_counts AS
SELECT status, sum(n)::bigint AS n
FROM (
    SELECT status, n FROM toren.run_counts
    UNION ALL
    SELECT d.status, d.n
    FROM toren.run_status_changes c,
         LATERAL (VALUES (c.old_status, -1), (c.new_status, 1)) AS d(status, n)
    WHERE d.status IS NOT NULL
) AS counted
GROUP BY status
HAVING sum(n) <> 0;

-- Move every change this transaction sees into toren.run_counts. Returns false, having done
-- nothing, when another transaction is folding (it holds the lock until it commits), and in a
-- repeatable read or serializable transaction (a spawn inside a caller's transaction): its
-- snapshot may still see changes a later fold moved, and deleting them again would fail the
-- caller's transaction with a serialization error.
CREATE FUNCTION toren.fold_run_status_changes() RETURNS boolean
LANGUAGE plpgsql AS $$
BEGIN
    IF current_setting('transaction_isolation') <> 'read committed' THEN
        RETURN false;
    END IF;
    IF NOT pg_try_advisory_xact_lock(x'746F7263'::bigint) THEN  -- "torc"
        RETURN false;
    END IF;
    WITH moved AS (
        DELETE FROM toren.run_status_changes RETURNING old_status, new_status
    ), delta AS (
        SELECT d.status, sum(d.n) AS n
        FROM moved c, LATERAL (VALUES (c.old_status, -1), (c.new_status, 1)) AS d(status, n)
        WHERE d.status IS NOT NULL
        GROUP BY d.status
    )
    INSERT INTO toren.run_counts AS r (status, n)
    SELECT status, n FROM delta ORDER BY status
    ON CONFLICT (status) DO UPDATE SET n = r.n + excluded.n;
    RETURN true;
END
$$;

CREATE FUNCTION toren.count_run_status() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    was text;
    became text;
    change_id bigint;
BEGIN
    IF TG_OP = 'TRUNCATE' THEN
        DELETE FROM toren.run_status_changes;
        DELETE FROM toren.run_counts;
        RETURN NULL;
    END IF;
    IF TG_OP <> 'INSERT' THEN
        IF OLD.kind = 'toren.run' THEN
            was := OLD.run_status;
        END IF;
    END IF;
    IF TG_OP <> 'DELETE' THEN
        IF NEW.kind = 'toren.run' THEN
            became := NEW.run_status;
        END IF;
    END IF;
    INSERT INTO toren.run_status_changes (old_status, new_status) VALUES (was, became)
    RETURNING id INTO change_id;
    IF change_id % 64 = 0 THEN
        PERFORM toren.fold_run_status_changes();
    END IF;
    RETURN NULL;
END
$$;

-- Held until this migration commits: see the count at the end.
LOCK TABLE toren.actors IN SHARE ROW EXCLUSIVE MODE;

-- The WHEN clauses keep the cost off every other write: a step whose run keeps its status (most
-- steps), a lease renewal or a claim queues no trigger call at all. (Postgres counts run_status
-- as updated whenever the summary is set, that is by every step that records an event; UPDATE
-- OF spares only the writes that leave the summary alone, and WHEN, evaluated on the row in
-- hand, spares the rest.)
CREATE TRIGGER run_counts_insert AFTER INSERT ON toren.actors
    FOR EACH ROW WHEN (NEW.kind = 'toren.run')
    EXECUTE FUNCTION toren.count_run_status();
CREATE TRIGGER run_counts_update AFTER UPDATE OF run_status, kind ON toren.actors
    FOR EACH ROW
    WHEN ((OLD.kind = 'toren.run' OR NEW.kind = 'toren.run')
          AND (OLD.run_status IS DISTINCT FROM NEW.run_status OR OLD.kind <> NEW.kind))
    EXECUTE FUNCTION toren.count_run_status();
CREATE TRIGGER run_counts_delete AFTER DELETE ON toren.actors
    FOR EACH ROW WHEN (OLD.kind = 'toren.run')
    EXECUTE FUNCTION toren.count_run_status();
CREATE TRIGGER run_counts_truncate AFTER TRUNCATE ON toren.actors
    FOR EACH STATEMENT EXECUTE FUNCTION toren.count_run_status();

-- The runs that exist now, counted once the triggers count every later change: no run is
-- written between this count and the commit (the lock, taken before the triggers were created,
-- waited for writers in flight and holds off new ones; reads go on). One pass over the runs.
INSERT INTO toren.run_counts (status, n)
SELECT run_status, count(*) FROM toren.actors WHERE kind = 'toren.run' GROUP BY run_status;
