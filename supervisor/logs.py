"""Structured logs: one JSON object per line on stderr (journald keeps it as is).

Libraries that use stdlib logging (aiohttp, asyncio) are rendered the same way, so the
stream stays one JSON object per line even when they report an error.
"""

from __future__ import annotations

import json
import logging
import sys
from datetime import datetime, timezone

import structlog

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}


class _JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out = {
            "event": record.getMessage(),
            "logger": record.name,
            "level": record.levelname.lower(),
            "timestamp": datetime.fromtimestamp(record.created, timezone.utc).isoformat().replace("+00:00", "Z"),
        }
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out)


class _LossTolerant:
    """The log stream, minus its failures: when its reader goes away (a terminal closed, the
    process reading a pipe killed) writes fail with EPIPE, and a log line must never be what
    stops the daemon from supervising, or from stopping its engines at shutdown. Lines that
    cannot be written are dropped and counted."""

    def __init__(self, stream) -> None:
        self._stream = stream
        self.dropped = 0

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except (OSError, ValueError):  # EPIPE and friends; ValueError: the file was closed
            self.dropped += 1
            return 0

    def flush(self) -> None:
        try:
            self._stream.flush()
        except (OSError, ValueError):
            pass


def configure(level: str = "info", stream=None) -> None:
    stream = _LossTolerant(stream or sys.stderr)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(sort_keys=False),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(_LEVELS.get(level, logging.INFO)),
        logger_factory=structlog.WriteLoggerFactory(stream),
        cache_logger_on_first_use=True,
    )
    handler = logging.StreamHandler(stream)
    handler.setFormatter(_JsonFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(max(_LEVELS.get(level, logging.INFO), logging.INFO))
