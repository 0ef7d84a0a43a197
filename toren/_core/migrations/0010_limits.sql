-- Concurrency limits shared by every worker (see toren/_core/limits.py).
--
-- A limit is a name and a cap. An actor lists the limits it must hold to run (actors.limits, in
-- the order it takes them; NULL for an actor without limits, which pays nothing). It holds a
-- permit of each (toren.permits) while it runs; when a limit is full it waits in that limit's
-- queue (toren.limit_queue, first come first served). Meanwhile its user mail is out of every
-- claim's sight (visible_at 'infinity'; a waiting actor costs a sweep nothing), and shown again
-- (visible_at = created_at) when a permit is handed to it. An actor that stops running gives its
-- permits back in its step, and each one goes at once to the head of its queue, whose mail is
-- shown and who is woken: no poll loop looks at waiting actors.
CREATE TABLE toren.limits (
    name  text PRIMARY KEY,
    cap   integer NOT NULL CHECK (cap > 0)
);

CREATE TABLE toren.permits (
    name        text NOT NULL,
    actor_id    text NOT NULL REFERENCES toren.actors (actor_id) ON DELETE CASCADE,
    granted_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (name, actor_id)
);
CREATE INDEX permits_actor ON toren.permits (actor_id);

CREATE TABLE toren.limit_queue (
    name       text NOT NULL,
    actor_id   text NOT NULL REFERENCES toren.actors (actor_id) ON DELETE CASCADE,
    seq        bigint GENERATED ALWAYS AS IDENTITY,
    queued_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (name, actor_id)
);
CREATE UNIQUE INDEX limit_queue_order ON toren.limit_queue (name, seq);
CREATE INDEX limit_queue_actor ON toren.limit_queue (actor_id);

ALTER TABLE toren.actors ADD COLUMN limits text[];

-- The user mail of actor p, due now, hidden while it waits in a queue (its system mail, a
-- cancel, stays in sight).
CREATE FUNCTION toren.hide_mail(p text) RETURNS void
LANGUAGE sql AS $$
    UPDATE toren.mailbox SET visible_at = 'infinity'
    WHERE actor_id = p AND lane <> 0 AND visible_at <= now();
$$;

-- ... and shown again, as mail to be handled at once, when it leaves the queue.
CREATE FUNCTION toren.show_mail(p text) RETURNS void
LANGUAGE sql AS $$
    UPDATE toren.mailbox SET visible_at = created_at
    WHERE actor_id = p AND visible_at = 'infinity';
$$;

-- Gives the permits of limit n to the heads of its queue while it has room, and wakes them.
-- The caller holds n's row lock (FOR UPDATE): every statement that changes permits does.
CREATE FUNCTION toren.hand_on(n text) RETURNS integer
LANGUAGE plpgsql AS $$
DECLARE
    room  integer;
    head  text;
    given integer := 0;
BEGIN
    SELECT cap - (SELECT count(*) FROM toren.permits p WHERE p.name = n) INTO room
    FROM toren.limits WHERE name = n;
    room := coalesce(room, 2147483647);  -- no cap (the limit's row is gone): no bound
    WHILE given < room LOOP
        head := NULL;
        DELETE FROM toren.limit_queue q
        WHERE q.name = n
          AND q.seq = (SELECT min(h.seq) FROM toren.limit_queue h WHERE h.name = n)
        RETURNING q.actor_id INTO head;
        EXIT WHEN head IS NULL;
        INSERT INTO toren.permits (name, actor_id) VALUES (n, head) ON CONFLICT DO NOTHING;
        PERFORM toren.show_mail(head);
        PERFORM pg_notify('toren_mail', head);
        given := given + 1;
    END LOOP;
    RETURN given;
END $$;

-- Takes the permits actor p lacks, in the order it lists them: each if the limit has room and
-- no one waits ahead of p, else p joins (or keeps its place in) that limit's queue and the
-- answer is false. Permits it took stay with it (a narrower limit is listed, and so taken,
-- first: an actor waiting on its agent's cap already holds its key's).
CREATE FUNCTION toren.take_permits(p text) RETURNS boolean
LANGUAGE plpgsql AS $$
DECLARE
    needs text[];
    n     text;
    cap_n integer;
    mine  bigint;
BEGIN
    SELECT a.limits INTO needs FROM toren.actors a WHERE a.actor_id = p;
    IF needs IS NULL OR cardinality(needs) = 0 THEN
        RETURN true;
    END IF;
    IF NOT EXISTS (SELECT 1 FROM unnest(needs) AS u(name)
                   WHERE NOT EXISTS (SELECT 1 FROM toren.permits h
                                     WHERE h.name = u.name AND h.actor_id = p)) THEN
        RETURN true;  -- the common case: it holds them all
    END IF;
    -- Row locks in the order of names, the one order of every statement that locks limits.
    PERFORM 1 FROM toren.limits l WHERE l.name = ANY(needs) ORDER BY l.name FOR UPDATE;
    FOREACH n IN ARRAY needs LOOP
        CONTINUE WHEN EXISTS (SELECT 1 FROM toren.permits h WHERE h.name = n AND h.actor_id = p);
        cap_n := NULL;
        mine := NULL;
        SELECT l.cap INTO cap_n FROM toren.limits l WHERE l.name = n;
        SELECT q.seq INTO mine FROM toren.limit_queue q WHERE q.name = n AND q.actor_id = p;
        IF cap_n IS NULL
           OR ((SELECT count(*) FROM toren.permits h WHERE h.name = n) < cap_n
               AND NOT EXISTS (SELECT 1 FROM toren.limit_queue q
                               WHERE q.name = n AND (mine IS NULL OR q.seq < mine))) THEN
            INSERT INTO toren.permits (name, actor_id) VALUES (n, p) ON CONFLICT DO NOTHING;
            DELETE FROM toren.limit_queue q WHERE q.name = n AND q.actor_id = p;
        ELSE
            INSERT INTO toren.limit_queue (name, actor_id) VALUES (n, p) ON CONFLICT DO NOTHING;
            PERFORM toren.hide_mail(p);
            RETURN false;
        END IF;
    END LOOP;
    PERFORM toren.show_mail(p);  -- mail hidden while it waited (none in the common case)
    RETURN true;
END $$;

-- Actor p no longer runs: its permits and its places in queues go, and each limit it held or
-- waited on is handed on. Returns how many waiting actors were given a permit.
CREATE FUNCTION toren.release_permits(p text) RETURNS integer
LANGUAGE plpgsql AS $$
DECLARE
    names text[];
    n     text;
    given integer := 0;
BEGIN
    SELECT array_agg(DISTINCT s.name ORDER BY s.name) INTO names FROM (
        SELECT h.name FROM toren.permits h WHERE h.actor_id = p
        UNION ALL
        SELECT q.name FROM toren.limit_queue q WHERE q.actor_id = p) AS s;
    IF names IS NULL THEN
        RETURN 0;
    END IF;
    PERFORM 1 FROM toren.limits l WHERE l.name = ANY(names) ORDER BY l.name FOR UPDATE;
    DELETE FROM toren.permits h WHERE h.actor_id = p;
    -- An actor that stops running while it waits (a run cancelled in the queue) leaves it for
    -- good: the mail it waited with stays out of sight (a cancelled run's start is not handled).
    DELETE FROM toren.limit_queue q WHERE q.actor_id = p;
    FOREACH n IN ARRAY names LOOP
        given := given + toren.hand_on(n);
    END LOOP;
    RETURN given;
END $$;
