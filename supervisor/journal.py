"""The daemon's journal: what a restarted daemon needs so that nothing is lost.

The current round, the weight version and its checkpoint, and for each engine its pid (with
the process's start time, so a recycled pid is never adopted), port, incarnation, restarts and
verified weight version. Written atomically (temp file, fsync, rename) whenever it changes,
coalesced. Killed with -9 and started again, the daemon re-adopts engines that still run and
knows the current version, so no engine serves stale weights.
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from typing import Any

import structlog

from .states import State

log = structlog.get_logger("vime.journal")
FORMAT = 1


class JournalError(Exception):
    pass


def snapshot(fleet: Any) -> dict[str, Any]:
    engines = {}
    for r in fleet.runners.values():
        proc = r.proc
        entry: dict[str, Any] = {
            "state": r.fsm.state.value,
            "incarnation": r.fsm.incarnation,
            "restarts": r.fsm.restarts,
            # Only a version the daemon verified counts: RUNNING/SUSPECT engines' versions.
            "verified_version": r.fsm.weight_version if r.fsm.state in (State.RUNNING, State.SUSPECT) else None,
            "retired": r.retired,
        }
        if proc is not None and proc.returncode is None and proc.start_time is not None:
            entry.update(pid=proc.pid, start_time=proc.start_time, port=r.spec.port, log_path=str(proc.log_path))
        engines[r.name] = entry
    return {
        "format": FORMAT,
        "daemon_pid": os.getpid(),
        "round": fleet.round,
        "round_open": fleet.round_open,
        "weight_version": fleet.current_version,
        "checkpoint": fleet.checkpoint,
        "engines": engines,
    }


def write_atomic(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    dirfd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dirfd)  # the rename itself survives a power cut
    finally:
        os.close(dirfd)


def load(path: Path) -> dict[str, Any] | None:
    """The journal, or None if there is none. JournalError if it cannot be trusted."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    except OSError as e:
        raise JournalError(f"cannot read {path}: {e}") from None
    try:
        data = json.loads(text)
    except ValueError as e:
        raise JournalError(f"{path} is not valid JSON ({e})") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("engines"), dict):
        raise JournalError(f"{path} is not a format-{FORMAT} journal")
    v = data.get("weight_version")
    if v is not None and not isinstance(v, int):
        raise JournalError(f"{path}: weight_version must be an integer, got {v!r}")
    return data


class JournalWriter:
    """Writes the journal when the fleet changed, at most every `min_interval` seconds."""

    def __init__(self, fleet: Any, path: Path, min_interval: float = 0.1):
        self.fleet = fleet
        self.path = path
        self.min_interval = min_interval
        self._dirty = asyncio.Event()
        self._task: asyncio.Task | None = None
        self.writes = 0

    def mark(self) -> None:
        self._dirty.set()

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="journal")

    async def _run(self) -> None:
        while True:
            await self._dirty.wait()
            self._dirty.clear()
            self.flush()
            await asyncio.sleep(self.min_interval)

    def flush(self) -> None:
        try:
            write_atomic(self.path, snapshot(self.fleet))
            self.writes += 1
        except OSError as e:  # a full disk must not take the daemon down; say so loudly
            log.error("journal.write_failed", path=str(self.path), error=str(e))

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        self.flush()
