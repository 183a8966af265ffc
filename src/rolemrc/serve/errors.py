"""Serve's errors: a malformed serve config (`ServeConfigError`, for the CLI), and API errors carried as exceptions and
rendered in OpenAI's error shape (`ApiError`, for HTTP clients)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from rolemrc.core.errors import RolemrcError

if TYPE_CHECKING:
    from fastapi.responses import JSONResponse

log = logging.getLogger("rolemrc.serve")
TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error", 413: "invalid_request_error",
         422: "invalid_request_error", 429: "rate_limit_error", 500: "server_error", 502: "upstream_error",
         503: "service_unavailable", 504: "timeout_error"}


class ServeConfigError(RolemrcError, ValueError):
    """The serve config is malformed."""


class ApiError(Exception):
    """An error answered with `status` and {"error": {message, type, param, code}}."""

    def __init__(self, status: int, message: str, *, code: str | None = None, param: str | None = None,
                 type: str | None = None, retry_after: int | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param
        self.retry_after = retry_after   # seconds, sent as `Retry-After`
        self.type = type or TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")

    def reworded(self, message: str) -> ApiError:
        """The same error saying `message`."""
        return ApiError(self.status, message, code=self.code, param=self.param, type=self.type,
                        retry_after=self.retry_after)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        from fastapi.responses import JSONResponse

        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else {}
        if self.retry_after is not None:
            headers["Retry-After"] = str(self.retry_after)
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def database_refused(exc: RolemrcError) -> ApiError:
    """The A/B database could not take a write or answer (a `store.StoreError`): 503 with its code, retry in 1 s. The
    database's own words (its host, its tables, what it said) go to the server's log, not to the client."""
    code = getattr(exc, "code", None)
    log.error("the A/B database refused: %s", exc)
    return ApiError(503, f"the A/B database cannot take the request now ({code}); retry", code=code, retry_after=1)
