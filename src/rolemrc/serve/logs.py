"""Structured logs: one JSON object per line on stderr."""

from __future__ import annotations

import json
import logging
import time
from typing import Any

RESERVED = set(logging.LogRecord("", 0, "", 0, "", None, None).__dict__) | {"message", "asctime", "color_message"}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {"ts": round(record.created, 3), "level": record.levelname.lower(),
                               "logger": record.name, "msg": record.getMessage()}
        out.update({k: v for k, v in record.__dict__.items() if k not in RESERVED})
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def log_config(level: str = "info") -> dict[str, Any]:
    """A logging dictConfig for uvicorn and rolemrc, all in JSON."""
    handler = {"class": "logging.StreamHandler", "formatter": "json", "stream": "ext://sys.stderr"}
    loggers = {name: {"handlers": ["json"], "level": level.upper(), "propagate": False}
               for name in ("rolemrc", "uvicorn", "uvicorn.error")}
    loggers["uvicorn.access"] = {"handlers": [], "level": "WARNING", "propagate": False}
    return {"version": 1, "disable_existing_loggers": False, "formatters": {"json": {"()": JsonFormatter}},
            "handlers": {"json": handler}, "loggers": loggers}


def elapsed_ms(start: float) -> float:
    return round((time.perf_counter() - start) * 1000, 2)
