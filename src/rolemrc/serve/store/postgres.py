"""The PostgreSQL backend (psycopg 3): one connection, reconnected on the next call after it is lost, so replicas
share experiments, restraints, arm counts, idempotency keys and the request log."""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager

import psycopg
from psycopg import errors

from rolemrc.serve.store.backend import Backend, StoreError, Transaction

CONNECT_TIMEOUT_S = 3
LOCK_TIMEOUT = "5s"        # a write waiting this long for a row or table lock is db_locked
STATEMENT_TIMEOUT = "15s"  # a statement running this long is cancelled (db_locked)
# a silent peer (a hung socket, a dead host) is noticed within seconds, not at the kernel's 2 h keepalive: libpq's
# keepalives, and a cap on unacknowledged writes (TCP_USER_TIMEOUT, ms)
KEEPALIVES = {"keepalives": 1, "keepalives_idle": 10, "keepalives_interval": 5, "keepalives_count": 3,
              "tcp_user_timeout": 15000}
MIGRATION_LOCK = 0x726F6C65   # the advisory lock that serialises replicas' migrations


def redacted(url: str) -> str:
    """A PostgreSQL URL or keyword DSN as messages show it: its password, in the authority or as a parameter, masked."""
    url = re.sub(r"//([^:/@]+):[^@]*@", r"//\1:***@", url)
    return re.sub(r"(password\s*=\s*)('[^']*'|[^&\s]*)", r"\1***", url, flags=re.IGNORECASE)


class PostgresBackend(Backend):
    def __init__(self, url: str) -> None:
        super().__init__(redacted(url))
        self.url = url
        self._conn: psycopg.Connection | None = None

    def _connection(self) -> psycopg.Connection:
        if self._conn is None or self._conn.closed:
            self._conn = psycopg.connect(self.url, autocommit=True, connect_timeout=CONNECT_TIMEOUT_S, **KEEPALIVES,
                                         options=f"-c lock_timeout={LOCK_TIMEOUT} -c statement_timeout={STATEMENT_TIMEOUT}")
        return self._conn

    def _drop(self) -> None:
        if self._conn is not None:
            self._conn.close()
        self._conn = None

    @contextmanager
    def _translated(self) -> Iterator[None]:
        try:
            yield
        except errors.DiskFull as exc:
            raise StoreError("db_full", f"the database {self.name} is full: {exc}") from exc
        except (errors.LockNotAvailable, errors.QueryCanceled) as exc:
            raise StoreError("db_locked", f"the database {self.name} is locked: {exc}") from exc
        except (psycopg.OperationalError, psycopg.InterfaceError) as exc:
            self._drop()
            raise StoreError("db_unavailable", f"the database {self.name} is unavailable: {exc}") from exc

    @contextmanager
    def transaction(self, exclusive: bool = False) -> Iterator[Transaction]:
        with self._lock, self._translated():
            conn = self._connection()
            with conn.transaction(), conn.cursor() as cursor:
                tx = Transaction(cursor, "%s")
                if exclusive:
                    tx.execute("SELECT pg_advisory_xact_lock(?)", (MIGRATION_LOCK,))
                yield tx

    def _probe(self) -> str | None:
        """`SELECT 1` (reconnecting when the connection was lost)."""
        try:
            with self._translated():
                self._connection().execute("SELECT 1")
        except StoreError as exc:
            return exc.code
        return None

    def close(self) -> None:
        with self._lock:
            self._drop()
