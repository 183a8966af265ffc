"""The A/B log's schema: one ordered list of migrations shared by SQLite and PostgreSQL (SQL written once, with `?`
placeholders that the PostgreSQL backend translates), recorded in `schema_version`."""

from __future__ import annotations

# Migration i (1-based) brings the schema from version i-1 to i. Version 1 is the schema the first release wrote
# (without schema_version), so an old SQLite log migrates from 0: its CREATE ... IF NOT EXISTS statements are no-ops.
MIGRATIONS: tuple[tuple[str, ...], ...] = (
    (
        "CREATE TABLE IF NOT EXISTS experiments (id TEXT PRIMARY KEY, description TEXT NOT NULL, arms TEXT NOT NULL,"
        " created DOUBLE PRECISION NOT NULL)",
        "CREATE TABLE IF NOT EXISTS requests (id TEXT PRIMARY KEY,"
        " experiment TEXT NOT NULL REFERENCES experiments(id), arm TEXT NOT NULL, \"user\" TEXT, model TEXT NOT NULL,"
        " restraint TEXT, endpoint TEXT NOT NULL, messages TEXT NOT NULL, response TEXT NOT NULL, finish_reason TEXT,"
        " latency_s DOUBLE PRECISION NOT NULL, prompt_tokens INTEGER NOT NULL, completion_tokens INTEGER NOT NULL,"
        " metadata TEXT, started DOUBLE PRECISION NOT NULL, finished DOUBLE PRECISION NOT NULL)",
        "CREATE INDEX IF NOT EXISTS requests_by_experiment ON requests(experiment, arm)",
        "CREATE TABLE IF NOT EXISTS restraints (name TEXT PRIMARY KEY, spec TEXT NOT NULL,"
        " created DOUBLE PRECISION NOT NULL)",
    ),
    (
        "ALTER TABLE requests ADD COLUMN request_id TEXT",
        "ALTER TABLE requests ADD COLUMN idempotency_key TEXT",
        "ALTER TABLE requests ADD COLUMN error TEXT",
        "UPDATE requests SET request_id = id",
        "CREATE INDEX requests_by_request ON requests(request_id)",
        "CREATE TABLE arm_counts (experiment TEXT NOT NULL, arm TEXT NOT NULL, requests INTEGER NOT NULL,"
        " PRIMARY KEY (experiment, arm))",
        "INSERT INTO arm_counts (experiment, arm, requests) SELECT experiment, arm, COUNT(*) FROM requests"
        " GROUP BY experiment, arm",
        "CREATE TABLE idempotency (experiment TEXT NOT NULL, key TEXT NOT NULL, status TEXT NOT NULL, response TEXT,"
        " created DOUBLE PRECISION NOT NULL, PRIMARY KEY (experiment, key))",
    ),
    (
        # idempotency keys belong to their caller (the API key's id, else the client's address), remember the hash
        # of the request they were first sent with, and carry the fencing token of the request holding them. Keys
        # of the old table had no caller or body to match, so they are dropped: a retry across the upgrade runs.
        "DROP TABLE idempotency",
        "CREATE TABLE idempotency (experiment TEXT NOT NULL, caller TEXT NOT NULL, key TEXT NOT NULL,"
        " body TEXT NOT NULL, token TEXT NOT NULL, status TEXT NOT NULL, response TEXT,"
        " created DOUBLE PRECISION NOT NULL, PRIMARY KEY (experiment, caller, key))",
    ),
    (
        # restraints are versioned, so replicas agree on them: each row carries the generation its registration made,
        # and restraints_generation (one row) counts every registration and deletion, bumped in the transaction making
        # it, so a replica learns whether any name changed from one number. Rows kept before keep version 0.
        "ALTER TABLE restraints ADD COLUMN version BIGINT NOT NULL DEFAULT 0",
        "CREATE TABLE restraints_generation (generation BIGINT NOT NULL)",
        "INSERT INTO restraints_generation (generation) VALUES (0)",
    ),
    (
        # every request assigned to an arm is a row, refusals included (finish_reason `refused`): a failed row keeps
        # its error's code; a row says which caller sent it (a hash: `key:` + the API key's id, else `addr:` + the
        # client address's); an experiment says whether its responses reveal the arm. Older rows keep NULL.
        "ALTER TABLE requests ADD COLUMN error_code TEXT",
        "ALTER TABLE requests ADD COLUMN caller TEXT",
        "ALTER TABLE experiments ADD COLUMN reveal_arm INTEGER NOT NULL DEFAULT 1",
    ),
)
VERSION = len(MIGRATIONS)

REQUEST_FIELDS = ("id", "request_id", "experiment", "arm", "user", "model", "restraint", "endpoint", "messages",
                  "response", "finish_reason", "error", "error_code", "latency_s", "prompt_tokens", "completion_tokens",
                  "metadata", "idempotency_key", "caller", "started", "finished")
JSON_FIELDS = ("messages", "metadata")
COLUMNS = ", ".join(f'"{f}"' for f in REQUEST_FIELDS)   # each quoted: `user` is reserved in PostgreSQL
INSERT_REQUEST = f"INSERT INTO requests ({COLUMNS}) VALUES ({', '.join('?' * len(REQUEST_FIELDS))})"
