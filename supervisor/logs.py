"""Structured logs: one JSON object per line on stderr, stdlib logging's (aiohttp, asyncio)
included.

Under systemd (JOURNAL_STREAM) each line starts with its sd-daemon priority (`<3>` error to
`<7>` debug), which journald strips and files the line under, so `journalctl -p warning` works
(docs/operations.md).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
from datetime import datetime, timezone
from typing import Any, MutableMapping, cast

import structlog

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}
# sd-daemon(3) priorities (syslog's), by structlog's level names (add_log_level: "exception" is
# "error", "warn" is "warning").
PRIORITIES = {"debug": 7, "info": 6, "warning": 4, "error": 3, "critical": 2}


def _priority_of(levelno: int) -> int:
    return 2 if levelno >= logging.CRITICAL else 3 if levelno >= logging.ERROR else \
        4 if levelno >= logging.WARNING else 6 if levelno >= logging.INFO else 7


def journal_stream(stream: Any, env: dict[str, str] | None = None) -> bool:
    """Whether `stream` is systemd's connection to the journal: JOURNAL_STREAM=<dev>:<inode>
    names it (systemd.exec(5)). The variable alone is not enough: a process started from a
    unit's shell inherits it while writing to a pipe or a file, which must stay plain."""
    want = (os.environ if env is None else env).get("JOURNAL_STREAM")
    if not want:
        return False
    try:
        st = os.fstat(stream.fileno())
    except (AttributeError, OSError, ValueError):  # no descriptor behind it, or closed
        return False
    return want == f"{st.st_dev}:{st.st_ino}"


def exit_fields(returncode: int) -> dict[str, Any]:
    """How a process ended, as fields: {"exit_code": 1} or {"signal": "SIGKILL"}."""
    if returncode >= 0:
        return {"exit_code": returncode}
    try:
        return {"signal": signal.Signals(-returncode).name}
    except ValueError:
        return {"signal": str(-returncode)}


class _JsonRenderer:
    """structlog's JSON, prefixed with the line's priority when the journal reads it."""

    def __init__(self, journald: bool):
        self.journald = journald
        self._json = structlog.processors.JSONRenderer(sort_keys=False)

    def __call__(self, logger: Any, name: str, event_dict: MutableMapping[str, Any]) -> str:
        line = cast(str, self._json(logger, name, event_dict))  # json.dumps, its default, makes str
        if not self.journald:
            return line
        return f"<{PRIORITIES.get(str(event_dict.get('level')), 6)}>{line}"


class _JsonFormatter(logging.Formatter):
    def __init__(self, journald: bool = False):
        super().__init__()
        self.journald = journald

    def format(self, record: logging.LogRecord) -> str:
        out = {
            "event": record.getMessage(),
            "logger": record.name,
            "level": record.levelname.lower(),
            "timestamp": datetime.fromtimestamp(record.created, timezone.utc).isoformat().replace("+00:00", "Z"),
        }
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        line = json.dumps(out)
        return f"<{_priority_of(record.levelno)}>{line}" if self.journald else line


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
    raw = stream or sys.stderr
    journald = journal_stream(raw)
    stream = _LossTolerant(raw)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            _JsonRenderer(journald),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(_LEVELS.get(level, logging.INFO)),
        logger_factory=structlog.WriteLoggerFactory(stream),
        cache_logger_on_first_use=True,
    )
    handler = logging.StreamHandler(stream)
    handler.setFormatter(_JsonFormatter(journald))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(max(_LEVELS.get(level, logging.INFO), logging.INFO))
