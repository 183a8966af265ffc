"""The A/B log and what replicas share: experiments, restraints registered while serving, the request rows, each
arm's row count and idempotency keys. `Store.open(db)` picks SQLite (a path, or a `file:` URI) or PostgreSQL (a
`postgresql://` URL); both run the same SQL (schema.py) and every write is one committed transaction, so an
acknowledged row survives a crash. The server writes it; `rolemrc.ab.report` reads it."""

from __future__ import annotations

import json
import secrets
import time
from collections import Counter
from typing import Any, NamedTuple

from rolemrc.serve.store.backend import Backend, StoreError, Transaction
from rolemrc.serve.store.schema import COLUMNS, INSERT_REQUEST, JSON_FIELDS, MIGRATIONS, REQUEST_FIELDS

__all__ = ["Claim", "Store", "StoreError", "is_url"]
POSTGRES = ("postgresql://", "postgres://")
RELEASE = ("DELETE FROM idempotency WHERE experiment = ? AND caller = ? AND key = ? AND token = ?"
           " AND status = 'running'")


def bump_generation(tx: Transaction) -> int:
    """Count one more change to the restraints (in the transaction making it): the new generation."""
    tx.execute("UPDATE restraints_generation SET generation = generation + 1")
    return tx.execute("SELECT generation FROM restraints_generation")[0]["generation"]


class Claim(NamedTuple):
    """An idempotency key held by one request: whose key it is and the fencing token its commit must still match."""

    experiment: str
    caller: str
    key: str
    token: str


def is_url(db: str) -> bool:
    """Whether `db` is a PostgreSQL URL or a SQLite `file:` URI (taken as written), not a path."""
    return db.startswith((*POSTGRES, "file:"))


class Store:
    """Experiments, restraints and the request log over one backend. Thread-safe; a `StoreError` (code db_full,
    db_locked or db_unavailable) when the database cannot take a write or answer."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self.name = backend.name
        self._migrate()

    @classmethod
    def open(cls, db: str) -> Store:
        if db.startswith(POSTGRES):
            from rolemrc.serve.store.postgres import PostgresBackend

            return cls(PostgresBackend(db))
        from rolemrc.serve.store.sqlite import SqliteBackend

        return cls(SqliteBackend(db))

    def _migrate(self) -> None:
        """Bring the schema to the last version, one migration per transaction (serialised across replicas)."""
        with self.backend.transaction(exclusive=True) as tx:
            tx.execute("CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL)")
        while True:
            with self.backend.transaction(exclusive=True) as tx:
                rows = tx.execute("SELECT version FROM schema_version")
                version = rows[0]["version"] if rows else 0
                if version >= len(MIGRATIONS):
                    return
                for statement in MIGRATIONS[version]:
                    tx.execute(statement)
                tx.execute("DELETE FROM schema_version")
                tx.execute("INSERT INTO schema_version (version) VALUES (?)", (version + 1,))

    def close(self) -> None:
        self.backend.close()

    def health(self) -> str | None:
        """None when a write could commit now; else why not (a StoreError code)."""
        return self.backend.health()

    def add_experiment(self, exp_id: str, description: str, arms: list[dict[str, Any]], created: float, *,
                       reveal_arm: bool = True) -> bool:
        """False when the id is taken. `reveal_arm`: whether its responses say which arm served them."""
        with self.backend.transaction() as tx:
            return tx.execute_count("INSERT INTO experiments (id, description, arms, created, reveal_arm)"
                                    " VALUES (?, ?, ?, ?, ?) ON CONFLICT DO NOTHING",
                                    (exp_id, description, json.dumps(arms), created, int(reveal_arm))) == 1

    def experiment(self, exp_id: str) -> dict[str, Any] | None:
        with self.backend.transaction() as tx:
            rows = tx.execute("SELECT id, description, arms, created, reveal_arm FROM experiments WHERE id = ?",
                              (exp_id,))
        return {**rows[0], "arms": json.loads(rows[0]["arms"]), "reveal_arm": bool(rows[0]["reveal_arm"])} if rows else None

    def arm_counts(self, exp_id: str) -> dict[str, int]:
        """Logged rows per arm (kept by `log_request`, never counted)."""
        with self.backend.transaction() as tx:
            rows = tx.execute("SELECT arm, requests FROM arm_counts WHERE experiment = ? ORDER BY arm", (exp_id,))
        return {row["arm"]: row["requests"] for row in rows}

    def delete_experiment(self, exp_id: str) -> bool:
        """Drop an experiment with its rows, counts and idempotency keys; False when there is none."""
        with self.backend.transaction() as tx:
            for table in ("requests", "arm_counts", "idempotency"):
                tx.execute(f"DELETE FROM {table} WHERE experiment = ?", (exp_id,))
            return tx.execute_count("DELETE FROM experiments WHERE id = ?", (exp_id,)) == 1

    def add_restraint(self, name: str, spec: dict[str, Any], created: float) -> tuple[bool, int, dict[str, Any]]:
        """Keep a restraint registered while serving, unless the name holds one already (the first spec under a name
        stays until it is deleted): (whether this call inserted it, the version the name holds, its spec). Atomic across
        replicas: of two concurrent registrations of a name the database keeps one. A new row's version is the bumped
        `restraints_generation`, so a name deleted and registered again never has a version it had before."""
        with self.backend.transaction() as tx:
            while True:   # the row found in conflict may be deleted before it is read: then insert again
                if tx.execute_count("INSERT INTO restraints (name, spec, created, version) VALUES (?, ?, ?, 0)"
                                    " ON CONFLICT DO NOTHING", (name, json.dumps(spec), created)) == 1:
                    version = bump_generation(tx)
                    tx.execute("UPDATE restraints SET version = ? WHERE name = ?", (version, name))
                    return True, version, spec
                rows = tx.execute("SELECT version, spec FROM restraints WHERE name = ?", (name,))
                if rows:
                    return False, rows[0]["version"], json.loads(rows[0]["spec"])

    def restraint(self, name: str) -> dict[str, Any] | None:
        """The spec registered under `name`, if any."""
        found = self.versioned_restraint(name)
        return found[1] if found else None

    def versioned_restraint(self, name: str) -> tuple[int, dict[str, Any]] | None:
        """(version, spec) of the restraint registered under `name`, if any."""
        with self.backend.transaction() as tx:
            rows = tx.execute("SELECT version, spec FROM restraints WHERE name = ?", (name,))
        return (rows[0]["version"], json.loads(rows[0]["spec"])) if rows else None

    def restraint_versions(self, known: int | None = None) -> tuple[int, dict[str, int] | None]:
        """(restraints_generation, name -> version of every registered restraint); the versions are None when the
        generation is still `known` (nothing was registered or deleted since): one single-row read then."""
        with self.backend.transaction() as tx:   # the generation first: rows read after it are at least as new
            generation = tx.execute("SELECT generation FROM restraints_generation")[0]["generation"]
            if generation == known:
                return generation, None
            rows = tx.execute("SELECT name, version FROM restraints")
        return generation, {row["name"]: row["version"] for row in rows}

    def versioned_restraints(self) -> tuple[int, dict[str, tuple[int, dict[str, Any]]]]:
        """(restraints_generation, name -> (version, spec) of every registered restraint, oldest first)."""
        with self.backend.transaction() as tx:
            generation = tx.execute("SELECT generation FROM restraints_generation")[0]["generation"]
            rows = tx.execute("SELECT name, version, spec FROM restraints ORDER BY created, name")
        return generation, {row["name"]: (row["version"], json.loads(row["spec"])) for row in rows}

    def restraints(self) -> dict[str, dict[str, Any]]:
        """name -> spec of the restraints registered while serving, oldest first."""
        with self.backend.transaction() as tx:
            rows = tx.execute("SELECT name, spec FROM restraints ORDER BY created, name")
        return {row["name"]: json.loads(row["spec"]) for row in rows}

    def experiments_using(self, restraint: str) -> list[str]:
        """The experiments with an arm on `restraint` (by the arm's `restraint` or a `model+restraint` id)."""
        with self.backend.transaction() as tx:
            rows = tx.execute("SELECT id, arms FROM experiments ORDER BY id")
        return [row["id"] for row in rows if any(arm.get("restraint") == restraint
                                                 or arm["model"].partition("+")[2] == restraint
                                                 for arm in json.loads(row["arms"]))]

    def delete_restraint(self, name: str, version: int | None = None) -> bool:
        """Delete the restraint registered under `name` (only while it has `version`, if given), bumping
        `restraints_generation` in the same transaction; False when there is none."""
        with self.backend.transaction() as tx:
            if version is None:
                deleted = tx.execute_count("DELETE FROM restraints WHERE name = ?", (name,))
            else:
                deleted = tx.execute_count("DELETE FROM restraints WHERE name = ? AND version = ?", (name, version))
            if deleted:
                bump_generation(tx)
            return deleted == 1

    def claim(self, experiment: str, caller: str, key: str, body: str,
              stale_after_s: float = float("inf")) -> Claim | dict[str, Any]:
        """Claim the idempotency key `key` of `caller` in `experiment` for a request whose body hashes to `body`: a
        `Claim` (with a fresh fencing token) when this call holds the key now, else the key's record {"status":
        "running" | "done", "body": the hash it was first sent with, "response": the JSON body stored, or None}.
        Atomic across replicas. A claim still `running` after `stale_after_s` (its replica died mid-request) is
        taken over by a request with the same body, under a new token: the old holder's commit no longer matches."""
        now, token = time.time(), secrets.token_hex(16)
        with self.backend.transaction() as tx:
            if tx.execute_count("INSERT INTO idempotency (experiment, caller, key, body, token, status, response,"
                                " created) VALUES (?, ?, ?, ?, ?, 'running', NULL, ?)"
                                " ON CONFLICT (experiment, caller, key) DO UPDATE"
                                " SET token = excluded.token, created = excluded.created"
                                " WHERE idempotency.status = 'running' AND idempotency.created < ?"
                                " AND idempotency.body = excluded.body",
                                (experiment, caller, key, body, token, now, now - stale_after_s)) == 1:
                return Claim(experiment, caller, key, token)
            row = tx.execute("SELECT status, body, response FROM idempotency"
                             " WHERE experiment = ? AND caller = ? AND key = ?", (experiment, caller, key))[0]
        return {"status": row["status"], "body": row["body"],
                "response": json.loads(row["response"]) if row["response"] else None}

    def release_claim(self, claim: Claim) -> None:
        """Drop a claim still held under its token (so a retry runs); a key done or taken over stays."""
        with self.backend.transaction() as tx:
            tx.execute(RELEASE, claim)

    def log_request(self, rows: list[dict[str, Any]], claim: Claim | None = None,
                    response: dict[str, Any] | None = None) -> bool:
        """Insert the rows of one request, add them to their arms' counts and, with the `claim` of its idempotency
        key, settle that key: done with `response` (a final answer, replayed to retries), or freed when `response`
        is None (an outcome that tells its client to retry); one transaction, committed (and on SQLite fsynced)
        before returning. The key is settled only while `claim`'s token still holds it: False when another request
        took it over (the rows are written all the same: the request ran; the key keeps the taker's answer)."""
        values = [[json.dumps(row.get(f)) if f in JSON_FIELDS else row.get(f) for f in REQUEST_FIELDS] for row in rows]
        counts = Counter((row["experiment"], row["arm"]) for row in rows)
        with self.backend.transaction() as tx:
            for value in values:
                tx.execute(INSERT_REQUEST, value)
            for (experiment, arm), n in counts.items():
                tx.execute("INSERT INTO arm_counts (experiment, arm, requests) VALUES (?, ?, ?) ON CONFLICT"
                           " (experiment, arm) DO UPDATE SET requests = arm_counts.requests + excluded.requests",
                           (experiment, arm, n))
            if claim is None:
                return True
            if response is None:
                return tx.execute_count(RELEASE, claim) == 1
            return tx.execute_count("UPDATE idempotency SET status = 'done', response = ?"
                                    " WHERE experiment = ? AND caller = ? AND key = ? AND token = ?"
                                    " AND status = 'running'", (json.dumps(response), *claim)) == 1

    def requests(self, exp_id: str) -> list[dict[str, Any]]:
        """An experiment's rows, oldest first, JSON fields decoded."""
        with self.backend.transaction() as tx:
            rows = tx.execute(f"SELECT {COLUMNS} FROM requests"
                              " WHERE experiment = ? ORDER BY started, id", (exp_id,))
        return [row | {f: json.loads(row[f]) if row[f] is not None else None for f in JSON_FIELDS} for row in rows]
