"""Retention: engine logs (one file per incarnation) and incident folders must not fill the disk
over a week-long job (docs/operations.md).

Each has a rule, a count and a byte total (0: no limit), applied oldest first, never to the live
incarnation's log nor the incident just written. `to_remove` is the rule, pure; `prune_logs` and
`prune_incidents` read the disk, apply it and log what they could not remove, never raising.
"""

from __future__ import annotations

import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

import structlog

from ..config import Config

log = structlog.get_logger("vime.retention")

# <stamp>-<engine>-<incarnation>, as postmortem.capture names them; nothing else there is ours.
_INCIDENT = re.compile(r"\d{8}T\d{6}-.+-\d+")


@dataclass(frozen=True)
class Item:
    """One log file or incident folder: its name, its size in bytes, and its age as a sortable key
    (larger: newer): an incarnation number for a log, a (time stamp, name) for an incident."""

    name: str
    size: int
    order: int | tuple[str, ...]


@dataclass(frozen=True)
class Rule:
    keep: int = 0  # at most this many items; 0: no limit
    keep_bytes: int = 0  # at most this many bytes in all; 0: no limit


def log_rule(cfg: Config) -> Rule:
    return Rule(cfg.log_keep, cfg.log_keep_bytes)


def incidents_rule(cfg: Config) -> Rule:
    return Rule(cfg.incidents_keep, cfg.incidents_keep_bytes)


def to_remove(items: Sequence[Item], rule: Rule, live: Iterable[str] = (), room: int = 0) -> list[str]:
    """The names to remove, oldest first, until the rest is within the rule. A live item is
    never removed but counts toward both limits (it is on the disk all the same), so when it
    alone is over the byte limit everything older goes and it stays. `room`: items about to be
    added, counted against `keep` as if there already."""
    keep_live = set(live)
    count = len(items) + room
    total = sum(i.size for i in items)
    out: list[str] = []
    for item in sorted(items, key=lambda i: i.order):
        over = (rule.keep and count > rule.keep) or (rule.keep_bytes and total > rule.keep_bytes)
        if not over:
            break
        if item.name in keep_live:
            continue
        out.append(item.name)
        count -= 1
        total -= item.size
    return out


def engine_logs(log_dir: str | os.PathLike[str], engine: str) -> list[Item]:
    """`<engine>.<incarnation>.log` of one engine (not those of an engine whose name extends it:
    e.0.1.log is engine e.0's, not e's)."""
    pattern = re.compile(re.escape(engine) + r"\.(\d+)\.log")
    items = []
    with os.scandir(log_dir) as it:
        for entry in it:
            m = pattern.fullmatch(entry.name)
            if m is None or not entry.is_file(follow_symlinks=False):
                continue
            try:
                size = entry.stat(follow_symlinks=False).st_size
            except FileNotFoundError:
                continue
            items.append(Item(entry.name, size, int(m.group(1))))
    return items


def _folder_size(path: str) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except FileNotFoundError:
                pass
    return total


def incident_folders(root: str | os.PathLike[str]) -> list[Item]:
    items = []
    with os.scandir(root) as it:
        for entry in it:
            if _INCIDENT.fullmatch(entry.name) and entry.is_dir(follow_symlinks=False):
                # The name starts with its UTC time stamp; the name breaks a tie within a second.
                items.append(Item(entry.name, _folder_size(entry.path), (entry.name[:15], entry.name)))
    return items


def prune_logs(log_dir: str, engine: str, live: Path | None, rule: Rule) -> list[str]:
    """Remove `engine`'s oldest logs beyond `rule`, never `live`; returns the names removed."""
    if not rule.keep and not rule.keep_bytes:
        return []
    try:
        names = to_remove(engine_logs(log_dir, engine), rule, [live.name] if live is not None else [])
    except OSError as e:
        log.error("retention.failed", what="engine logs", engine=engine, error=str(e))
        return []
    removed = []
    for name in names:
        try:
            os.unlink(os.path.join(log_dir, name))
            removed.append(name)
        except FileNotFoundError:
            pass
        except OSError as e:
            log.error("retention.failed", what="engine log", engine=engine, file=name, error=str(e))
    if removed:
        log.info("retention.removed", what="engine logs", engine=engine, files=removed)
    return removed


def prune_incidents(root: Path, live: Iterable[Path], rule: Rule, room: int = 0) -> list[str]:
    """Remove the oldest incident folders beyond `rule`, never one of `live`; `room`: folders
    about to be written, made room for."""
    if not rule.keep and not rule.keep_bytes:
        return []
    try:
        found = incident_folders(root)
        # The live ones read after the scan (a capture marks its folder live before creating it,
        # so any folder the scan saw being written is among them); a copy taken in one step.
        names = to_remove(found, rule, [p.name for p in frozenset(live)], room)
    except OSError as e:
        log.error("retention.failed", what="incidents", error=str(e))
        return []
    removed = []
    for name in names:
        try:
            _remove_tree(root / name)
            removed.append(name)
        except OSError as e:
            log.error("retention.failed", what="incident", folder=name, error=str(e))
    if removed:
        log.info("retention.removed", what="incidents", folders=removed)
    return removed


def _remove_tree(path: Path) -> None:
    try:
        shutil.rmtree(path)
    except FileNotFoundError:  # removed meanwhile: what was wanted
        pass
