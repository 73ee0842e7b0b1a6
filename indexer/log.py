"""Structured, quiet-by-default logging: one JSON object per line on stderr."""

from __future__ import annotations

import logging
import sys
import time

import msgspec

# Record attributes that are not the caller's ``extra``; uvicorn adds a
# terminal-coloured copy of its message that has no place in JSON logs.
_STANDARD = set(vars(logging.makeLogRecord({}))) | {"message", "asctime", "color_message"}
_encode = msgspec.json.Encoder().encode


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "logger": record.name,
            "event": record.getMessage(),
        }
        entry.update((k, v) for k, v in vars(record).items() if k not in _STANDARD)
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return _encode(entry).decode()


def setup_logging(level: str = "WARNING") -> None:
    """Route every ``kvindex`` logger to stderr as JSON lines at ``level``."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # httpx logs every request at INFO: the load scraper's several a second
    # (indexer.loads) would drown the service's own lines
    logging.getLogger("httpx").setLevel(max(root.level, logging.WARNING))
    logging.Formatter.converter = time.gmtime
