"""The SQLite backend: one connection in WAL mode with synchronous=FULL (a committed row survives a crash). `db` is
a path or a `file:` URI; the URI may cap the file's size with `max_page_count=N` (pages of 4 KiB by default)."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

from rolemrc.serve.store.backend import Backend, StoreError, Transaction

BUSY_TIMEOUT_S = 5.0   # how long a write waits for another process's lock before db_locked
ERROR_CODES = {sqlite3.SQLITE_FULL: "db_full", sqlite3.SQLITE_BUSY: "db_locked", sqlite3.SQLITE_LOCKED: "db_locked",
               sqlite3.SQLITE_IOERR: "db_unavailable", sqlite3.SQLITE_CANTOPEN: "db_unavailable",
               sqlite3.SQLITE_READONLY: "db_unavailable"}


class SqliteBackend(Backend):
    def __init__(self, db: str) -> None:
        super().__init__(db)
        uri = db.startswith("file:")
        query = parse_qs(urlsplit(db).query) if uri else {}
        if not uri:
            Path(db).parent.mkdir(parents=True, exist_ok=True)
        with self._translated():
            self._db = sqlite3.connect(db, uri=uri, check_same_thread=False, isolation_level=None,
                                       timeout=BUSY_TIMEOUT_S)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=FULL")
            self._db.execute("PRAGMA foreign_keys=ON")
            if "max_page_count" in query:
                self._db.execute(f"PRAGMA max_page_count={int(query['max_page_count'][0])}")

    @contextmanager
    def _translated(self) -> Iterator[None]:
        try:
            yield
        except sqlite3.OperationalError as exc:
            code = ERROR_CODES.get(exc.sqlite_errorcode & 0xFF)
            if code is None:
                raise
            raise StoreError(code, f"the database {self.name} cannot take the write ({code}): {exc}") from exc

    @contextmanager
    def transaction(self, exclusive: bool = False) -> Iterator[Transaction]:
        # deferred: reads never wait (WAL); a write takes the lock at its first statement, waiting BUSY_TIMEOUT_S
        with self._lock, self._translated():
            self._db.execute("BEGIN IMMEDIATE" if exclusive else "BEGIN")
            try:
                yield Transaction(self._db.cursor())
            except BaseException:
                if self._db.in_transaction:
                    self._db.execute("ROLLBACK")
                raise
            try:
                self._db.execute("COMMIT")
            except sqlite3.OperationalError:
                if self._db.in_transaction:
                    self._db.execute("ROLLBACK")
                raise

    def _probe(self) -> str | None:
        """Takes the write lock for a moment (waiting 0.1 s) and checks the page cap."""
        try:
            self._db.execute("PRAGMA busy_timeout=100")
            self._db.execute("BEGIN IMMEDIATE")
            self._db.execute("ROLLBACK")
            pages, cap, free = (self._db.execute(f"PRAGMA {p}").fetchone()[0]
                                for p in ("page_count", "max_page_count", "freelist_count"))
            return "db_full" if pages >= cap and free == 0 else None
        except sqlite3.OperationalError as exc:
            return ERROR_CODES.get(exc.sqlite_errorcode & 0xFF, "db_unavailable")
        finally:
            self._db.execute(f"PRAGMA busy_timeout={int(BUSY_TIMEOUT_S * 1000)}")

    def close(self) -> None:
        with self._lock:
            self._db.close()
