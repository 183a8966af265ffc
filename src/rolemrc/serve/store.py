"""The A/B log: SQLite in WAL mode with synchronous=FULL, so a committed row survives a crash. The server writes it;
`rolemrc.ab.report` reads it."""

from __future__ import annotations

import json
import os
import sqlite3
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from rolemrc.core.errors import RolemrcError

SCHEMA = """
CREATE TABLE IF NOT EXISTS experiments (
  id TEXT PRIMARY KEY, description TEXT NOT NULL, arms TEXT NOT NULL, created REAL NOT NULL);
CREATE TABLE IF NOT EXISTS requests (
  id TEXT PRIMARY KEY, experiment TEXT NOT NULL REFERENCES experiments(id), arm TEXT NOT NULL, user TEXT,
  model TEXT NOT NULL, restraint TEXT, endpoint TEXT NOT NULL, messages TEXT NOT NULL, response TEXT NOT NULL,
  finish_reason TEXT, latency_s REAL NOT NULL, prompt_tokens INTEGER NOT NULL, completion_tokens INTEGER NOT NULL,
  metadata TEXT, started REAL NOT NULL, finished REAL NOT NULL);
CREATE INDEX IF NOT EXISTS requests_by_experiment ON requests(experiment, arm);
CREATE TABLE IF NOT EXISTS restraints (name TEXT PRIMARY KEY, spec TEXT NOT NULL, created REAL NOT NULL);
CREATE TABLE IF NOT EXISTS idempotency (
  experiment TEXT NOT NULL, key TEXT NOT NULL, response TEXT, PRIMARY KEY (experiment, key));
"""
REQUEST_FIELDS = ("id", "experiment", "arm", "user", "model", "restraint", "endpoint", "messages", "response",
                  "finish_reason", "latency_s", "prompt_tokens", "completion_tokens", "metadata", "started", "finished")
JSON_FIELDS = ("messages", "metadata")


class StoreError(RolemrcError):
    """The database cannot take a write: `code` db_full | db_locked | db_unavailable (answered with a 503)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


@contextmanager
def _coded() -> Iterator[None]:
    """SQLite's operational errors as StoreErrors."""
    try:
        yield
    except sqlite3.OperationalError as exc:
        text = str(exc)
        code = "db_full" if "full" in text else "db_locked" if "locked" in text or "busy" in text else "db_unavailable"
        raise StoreError(code, f"the A/B database cannot take the write: {text}") from exc


class Store:
    """Experiments and their request log. Thread-safe; every write is its own committed transaction."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None, timeout=30)
        self._db.row_factory = sqlite3.Row
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.execute("PRAGMA foreign_keys=ON")
        self._db.executescript(SCHEMA)

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def add_experiment(self, exp_id: str, description: str, arms: list[dict[str, Any]], created: float) -> bool:
        """False when the id is taken."""
        with self._lock:
            try:
                self._db.execute("INSERT INTO experiments VALUES (?, ?, ?, ?)",
                                 (exp_id, description, json.dumps(arms), created))
            except sqlite3.IntegrityError:
                return False
        return True

    def experiment(self, exp_id: str) -> dict[str, Any] | None:
        with self._lock:
            row = self._db.execute("SELECT * FROM experiments WHERE id = ?", (exp_id,)).fetchone()
            if row is None:
                return None
            counts = dict(self._db.execute("SELECT arm, COUNT(*) FROM requests WHERE experiment = ? GROUP BY arm",
                                           (exp_id,)).fetchall())
        return {"id": row["id"], "description": row["description"], "arms": json.loads(row["arms"]),
                "created": row["created"], "requests": counts}

    def add_restraint(self, name: str, spec: dict[str, Any], created: float) -> None:
        """Keep a restraint registered while serving (the first spec under a name stays)."""
        with self._lock:
            self._db.execute("INSERT OR IGNORE INTO restraints VALUES (?, ?, ?)", (name, json.dumps(spec), created))

    def delete_restraint(self, name: str) -> bool:
        """Forget a restraint registered while serving; False when there was none by that name."""
        with self._lock:
            return self._db.execute("DELETE FROM restraints WHERE name = ?", (name,)).rowcount > 0

    def delete_experiment(self, exp_id: str) -> bool:
        """Delete an experiment and its logged requests in one transaction; False when there was none."""
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                self._db.execute("DELETE FROM requests WHERE experiment = ?", (exp_id,))
                deleted = self._db.execute("DELETE FROM experiments WHERE id = ?", (exp_id,)).rowcount > 0
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")
        return deleted

    def experiments_using(self, restraint: str) -> list[str]:
        """The experiments with an arm on `restraint` (by the arm's `restraint` or a `model+restraint` id)."""
        with self._lock:
            rows = self._db.execute("SELECT id, arms FROM experiments ORDER BY id").fetchall()
        return [row["id"] for row in rows if any(arm.get("restraint") == restraint
                                                 or arm["model"].partition("+")[2] == restraint
                                                 for arm in json.loads(row["arms"]))]

    def restraints(self) -> dict[str, dict[str, Any]]:
        """name -> spec of the restraints registered while serving, oldest first."""
        with self._lock:
            rows = self._db.execute("SELECT name, spec FROM restraints ORDER BY created, name").fetchall()
        return {row["name"]: json.loads(row["spec"]) for row in rows}

    def log_request(self, rows: list[dict[str, Any]], idempotency: tuple[str, str] | None = None,
                    response: dict | None = None) -> None:
        """Insert every row of one request, and with `idempotency` (experiment, key) mark the key done with
        `response`, in one transaction (committed and fsynced before returning)."""
        values = [[json.dumps(row.get(f)) if f in JSON_FIELDS else row.get(f) for f in REQUEST_FIELDS] for row in rows]
        with self._lock, _coded():
            try:
                self._db.execute("BEGIN IMMEDIATE")
                self._db.executemany(f"INSERT INTO requests ({', '.join(REQUEST_FIELDS)}) VALUES "
                                     f"({', '.join('?' * len(REQUEST_FIELDS))})", values)
                if idempotency is not None:
                    self._db.execute("INSERT OR REPLACE INTO idempotency VALUES (?, ?, ?)",
                                     (*idempotency, json.dumps(response)))
                self._db.execute("COMMIT")
            except BaseException:
                if self._db.in_transaction:
                    self._db.execute("ROLLBACK")
                raise

    def claim(self, experiment: str, key: str) -> dict[str, Any] | None:
        """None when this call claimed `key` now; else its record {"status": running | done, "response"}."""
        with self._lock, _coded():
            if self._db.execute("INSERT OR IGNORE INTO idempotency VALUES (?, ?, NULL)", (experiment, key)).rowcount:
                return None
            (response,) = self._db.execute("SELECT response FROM idempotency WHERE experiment = ? AND key = ?",
                                           (experiment, key)).fetchone()
        return {"status": "running", "response": None} if response is None else {"status": "done",
                                                                                "response": json.loads(response)}

    def release_claim(self, experiment: str, key: str) -> None:
        """Drop a claim whose request never reached the engine."""
        with self._lock, _coded():
            self._db.execute("DELETE FROM idempotency WHERE experiment = ? AND key = ? AND response IS NULL",
                             (experiment, key))

    def requests(self, exp_id: str) -> list[dict[str, Any]]:
        with self._lock:
            rows = self._db.execute("SELECT * FROM requests WHERE experiment = ? ORDER BY started, id",
                                    (exp_id,)).fetchall()
        out = []
        for row in rows:
            item = dict(row)
            for f in JSON_FIELDS:
                item[f] = json.loads(item[f]) if item[f] is not None else None
            out.append(item)
        return out
