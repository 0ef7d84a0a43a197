-- The actor kernel: actors and their leases, journals, snapshots, mailboxes (with timers),
-- send-side dedupe keys, dead letters, ask() replies, the worker registry and restart windows.

CREATE TABLE toren.workers (
    worker_id      uuid PRIMARY KEY,
    lock_key       integer NOT NULL UNIQUE,      -- pg_advisory_lock(<namespace>, lock_key) held by the live worker
    name           text NOT NULL,
    version        text NOT NULL,
    deploy_label   text,
    host           text NOT NULL,
    pid            integer NOT NULL,
    started_at     timestamptz NOT NULL DEFAULT now(),
    heartbeat_at   timestamptz NOT NULL DEFAULT now(),
    draining       boolean NOT NULL DEFAULT false,
    stats          jsonb NOT NULL DEFAULT '{}'
);
CREATE SEQUENCE toren.worker_lock_keys AS integer START 1 CYCLE;

CREATE TABLE toren.actors (
    actor_id          text PRIMARY KEY,
    kind              text NOT NULL,
    args              jsonb NOT NULL DEFAULT '{}',
    route             text,                     -- only workers serving this route claim it
    parent            text,
    status            text NOT NULL DEFAULT 'live' CHECK (status IN ('live', 'failed', 'stopped')),
    failure           text,
    max_depth         integer NOT NULL DEFAULT 10000 CHECK (max_depth > 0),
    owner             uuid,
    epoch             bigint NOT NULL DEFAULT 0,
    lease_expires_at  timestamptz,
    created_at        timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX actors_owner ON toren.actors (owner) WHERE owner IS NOT NULL;

CREATE TABLE toren.journal (
    actor_id    text NOT NULL,
    seq         bigint NOT NULL CHECK (seq > 0),
    epoch       bigint NOT NULL,
    type        text NOT NULL,
    data        jsonb NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (actor_id, seq)
);

CREATE TABLE toren.snapshots (
    actor_id    text PRIMARY KEY,
    seq         bigint NOT NULL,
    version     integer NOT NULL,
    state       jsonb NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE toren.mailbox (
    id          bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    actor_id    text NOT NULL REFERENCES toren.actors (actor_id) ON DELETE CASCADE,
    lane        smallint NOT NULL DEFAULT 1,      -- 0: system, drained first; 1: user
    sender      text,
    kind        text NOT NULL,
    body        jsonb NOT NULL,
    dedupe_key  text,
    timer_name  text,                             -- set for durable timers: the key they were set under
    reply_to    uuid,                             -- correlation id of an ask()
    deliveries  integer NOT NULL DEFAULT 0,       -- raised when claimed, before handling
    attempts    integer NOT NULL DEFAULT 0,       -- raised when the handler raised
    last_error  text,
    visible_at  timestamptz NOT NULL DEFAULT now(),
    created_at  timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX mailbox_next ON toren.mailbox (actor_id, lane, id);
CREATE INDEX mailbox_visible ON toren.mailbox (actor_id, visible_at);
CREATE INDEX mailbox_timer ON toren.mailbox (actor_id, timer_name) WHERE timer_name IS NOT NULL;

CREATE TABLE toren.dedupe (
    actor_id    text NOT NULL,
    key         text NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (actor_id, key)
);
CREATE INDEX dedupe_age ON toren.dedupe (created_at);

CREATE TABLE toren.deadletters (
    id          bigint PRIMARY KEY,                -- the message's mailbox id
    actor_id    text NOT NULL,
    lane        smallint NOT NULL,
    sender      text,
    kind        text NOT NULL,
    body        jsonb NOT NULL,
    dedupe_key  text,
    reply_to    uuid,
    deliveries  integer NOT NULL,
    attempts    integer NOT NULL,
    error       text NOT NULL,
    created_at  timestamptz NOT NULL,
    dead_at     timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE toren.replies (
    correlation_id  uuid PRIMARY KEY,
    kind            text NOT NULL,
    body            jsonb NOT NULL,
    created_at      timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE toren.restart_windows (
    key       text PRIMARY KEY,
    restarts  timestamptz[] NOT NULL
);
