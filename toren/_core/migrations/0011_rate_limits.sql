-- Provider rate limits shared by every worker (see toren/_core/rates.py).
--
-- A rate limit is a name (a model, "anthropic/claude-sonnet-4-6", or a provider, "anthropic")
-- and caps per minute; it is declared in each worker's settings, not stored. Each call under a
-- limit adds one request and its reserved tokens to the limit's row for the current minute of
-- the worker's clock (win = floor(clock / 60), computed by the worker and passed in, so a
-- test's clock controls it). A row is written only by calls under its limit; a worker with no
-- limits declared writes none. Rows untouched for an hour are deleted by housekeeping
-- (touched_at is the database's time: the windows' own numbers may be a test clock's).
CREATE TABLE toren.rate_windows (
    name        text NOT NULL,
    win         bigint NOT NULL,
    requests    integer NOT NULL,
    tokens      bigint NOT NULL,
    -- the caps the last call counted against (declared in settings; shown to operators)
    requests_cap  integer,
    tokens_cap    bigint,
    touched_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (name, win)
);

-- A provider's 429 with retry-after R: no call under the limit until blocked_until (the
-- worker's clock + R), on any worker. Written only on a 429.
CREATE TABLE toren.rate_blocks (
    name           text PRIMARY KEY,
    blocked_until  timestamptz NOT NULL,
    noted_at       timestamptz NOT NULL DEFAULT now()
);
