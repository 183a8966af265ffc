"""What a store backend provides (transactions that run the shared SQL, a health check) and the one error it raises."""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Any

from rolemrc.core.errors import RolemrcError

CODES = ("db_full", "db_locked", "db_unavailable")
NUL_STORED = "\ufffd"
HEALTH_TTL_S = 1.0   # a health verdict is reused this long


class StoreError(RolemrcError):
    """The database cannot take a write or answer: `code` is db_full, db_locked or db_unavailable."""

    def __init__(self, code: str, message: str) -> None:
        assert code in CODES, code
        super().__init__(message)
        self.code = code


class Transaction:
    """One open transaction over a DB-API cursor; the shared SQL's `?` placeholders become the driver's."""

    def __init__(self, cursor: Any, placeholder: str = "?") -> None:
        self.cursor, self.placeholder = cursor, placeholder

    def execute(self, sql: str, params: Sequence[Any] = ()) -> list[dict[str, Any]]:
        """Run one statement: its rows as dicts (none for a write). A NUL in a text parameter (a model may generate
        one) is stored as U+FFFD on both backends, since PostgreSQL text cannot hold it."""
        params = [p.replace("\x00", NUL_STORED) if isinstance(p, str) else p for p in params]
        self.cursor.execute(sql.replace("?", self.placeholder), params)
        if self.cursor.description is None:
            return []
        names = [d[0] for d in self.cursor.description]
        return [dict(zip(names, row)) for row in self.cursor.fetchall()]

    def execute_count(self, sql: str, params: Sequence[Any] = ()) -> int:
        """Run one write: how many rows it changed."""
        self.execute(sql, params)
        return self.cursor.rowcount


class Backend(ABC):
    """One connection, used by one thread at a time (`_lock`)."""

    def __init__(self, name: str) -> None:
        self.name = name   # the database as messages name it (no password)
        self._lock = threading.Lock()
        self._checked: tuple[float, str | None] = (float("-inf"), None)

    @abstractmethod
    def transaction(self, exclusive: bool = False) -> AbstractContextManager[Transaction]:
        """A transaction committed on exit (rolled back on an error); `exclusive` serialises it with every other
        exclusive one (migrations). Raises StoreError for a full, locked or unreachable database."""

    def health(self) -> str | None:
        """None when a write could commit now, else a StoreError code; answered within about a second (db_locked
        when the connection stays busy that long) and reused for HEALTH_TTL_S."""
        checked, verdict = self._checked
        if time.monotonic() - checked < HEALTH_TTL_S:
            return verdict
        if not self._lock.acquire(timeout=1.0):
            verdict = "db_locked"
        else:
            try:
                verdict = self._probe()
            finally:
                self._lock.release()
        self._checked = (time.monotonic(), verdict)
        return verdict

    @abstractmethod
    def _probe(self) -> str | None:
        """`health`'s check, holding the lock."""

    @abstractmethod
    def close(self) -> None: ...
