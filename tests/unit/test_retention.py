"""Retention of engine logs and incident folders (supervisor/engine/retention.py): the pure rule,
then the same rule applied to real files in a temporary folder."""

from __future__ import annotations

import os
from pathlib import Path

from vime.supervisor.engine import retention
from vime.supervisor.engine.retention import Item, Rule, prune_incidents, to_remove


def logs(*sizes: int) -> list[Item]:
    """e0.1.log .. e0.N.log with these sizes, incarnation 1 the oldest."""
    return [Item(f"e0.{n}.log", size, n) for n, size in enumerate(sizes, 1)]


def test_count_removes_the_oldest_first():
    assert to_remove(logs(1, 1, 1, 1, 1), Rule(keep=3)) == ["e0.1.log", "e0.2.log"]
    assert to_remove(logs(1, 1, 1), Rule(keep=3)) == []


def test_bytes_remove_the_oldest_until_the_rest_fits():
    # 100 + 50 + 30 + 20 = 200 bytes: over 60, the two oldest go and 50 bytes remain.
    assert to_remove(logs(100, 50, 30, 20), Rule(keep_bytes=60)) == ["e0.1.log", "e0.2.log"]
    assert to_remove(logs(100, 50, 30, 20), Rule(keep_bytes=200)) == []


def test_both_limits_hold_together():
    assert to_remove(logs(10, 10, 10, 10), Rule(keep=3, keep_bytes=15)) == ["e0.1.log", "e0.2.log", "e0.3.log"]
    assert to_remove(logs(1, 1, 100, 1), Rule(keep=3, keep_bytes=1000)) == ["e0.1.log"]


def test_zero_is_no_limit():
    assert to_remove(logs(*[10**9] * 50), Rule(0, 0)) == []


def test_the_live_log_is_never_removed_but_counts():
    # The live one is the newest and alone over the byte limit: every older one goes, it stays.
    assert to_remove(logs(1, 1, 500), Rule(keep_bytes=100), live=["e0.3.log"]) == ["e0.1.log", "e0.2.log"]
    # keep = 1: only the live one is left.
    assert to_remove(logs(1, 1, 1), Rule(keep=1), live=["e0.3.log"]) == ["e0.1.log", "e0.2.log"]
    # Live and not the newest (incarnations restarted from 1 after the journal was lost): it stays,
    # the oldest others go.
    assert to_remove(logs(1, 1, 1, 1), Rule(keep=2), live=["e0.1.log"]) == ["e0.2.log", "e0.3.log"]


def test_incarnations_are_ordered_as_numbers_not_as_names():
    items = [Item(f"engine-0.{n}.log", 1, n) for n in (10, 9, 11, 2, 100)]
    assert to_remove(items, Rule(keep=2)) == ["engine-0.2.log", "engine-0.9.log", "engine-0.10.log"]


def test_logs_on_disk_are_found_by_engine_and_incarnation(tmp_path):
    for name in ("e.9.log", "e.10.log", "e.0.3.log", "e.x.log", "other.1.log", "e.11.log.gz"):
        (tmp_path / name).write_text("x" * 10)
    (tmp_path / "e.12.log").mkdir()  # not a file: not a log of ours
    found = {i.name: i.order for i in retention.engine_logs(tmp_path, "e")}
    assert found == {"e.9.log": 9, "e.10.log": 10}  # e.0.3.log is engine e.0's
    assert {i.name for i in retention.engine_logs(tmp_path, "e.0")} == {"e.0.3.log"}


def test_prune_logs_removes_the_oldest_on_disk_and_keeps_the_live_one(tmp_path):
    for n in range(1, 13):
        (tmp_path / f"e0.{n}.log").write_text("x" * 100)
    (tmp_path / "e1.1.log").write_text("another engine's")
    live = tmp_path / "e0.12.log"
    removed = retention.prune_logs(str(tmp_path), "e0", live, Rule(keep=3, keep_bytes=0))
    assert removed == [f"e0.{n}.log" for n in range(1, 10)]
    assert sorted(os.listdir(tmp_path)) == ["e0.10.log", "e0.11.log", "e0.12.log", "e1.1.log"]
    live.write_text("x" * 10_000)  # the live log outgrows the byte limit on its own
    assert retention.prune_logs(str(tmp_path), "e0", live, Rule(keep=0, keep_bytes=1000)) == ["e0.10.log", "e0.11.log"]
    assert live.exists()


def test_prune_never_raises_into_supervision(tmp_path, monkeypatch):
    # A log_dir that is gone: logged, nothing removed, no exception.
    assert retention.prune_logs(str(tmp_path / "gone"), "e0", None, Rule(keep=1)) == []
    assert retention.prune_incidents(tmp_path / "gone", [], Rule(keep=1)) == []
    # A file that cannot be removed (EACCES, EROFS: what the disk says, root or not): logged,
    # and the next one is still removed.
    for n in (1, 2, 3):
        (tmp_path / f"e0.{n}.log").write_text("x")
    real_unlink = os.unlink

    def refuse_the_oldest(path, *a, **kw):
        if str(path).endswith("e0.1.log"):
            raise PermissionError(13, "Permission denied", str(path))
        return real_unlink(path, *a, **kw)

    monkeypatch.setattr(os, "unlink", refuse_the_oldest)
    assert retention.prune_logs(str(tmp_path), "e0", tmp_path / "e0.3.log", Rule(keep=1)) == ["e0.2.log"]
    assert sorted(os.listdir(tmp_path)) == ["e0.1.log", "e0.3.log"]


def incident(root: Path, stamp: str, engine: str, inc: int, size: int) -> Path:
    folder = root / f"{stamp}-{engine}-{inc}"
    folder.mkdir(parents=True)
    (folder / "incident.json").write_text("{}")
    (folder / "log_tail.txt").write_text("x" * size)
    return folder


def test_prune_incidents_oldest_first_across_engines_never_the_live_ones(tmp_path):
    root = tmp_path / "incidents"
    old = incident(root, "20260101T000000", "e1", 4, 1000)
    mid = incident(root, "20260101T000001", "e0", 2, 1000)
    new = incident(root, "20260102T000000", "e0", 3, 1000)
    writing = incident(root, "20260102T000000", "e1", 5, 0)  # same second, still being written
    (root / "notes").mkdir()  # not a folder the daemon wrote: never touched
    assert retention.prune_incidents(root, [new, writing], Rule(keep=2)) == [old.name, mid.name]
    assert sorted(p.name for p in root.iterdir()) == sorted([new.name, writing.name, "notes"])
    # Bytes: the folder's files summed; the newest stays even when it alone is over.
    assert retention.prune_incidents(root, [new], Rule(keep_bytes=10)) == [writing.name]
    assert new.exists()


def test_room_is_made_for_items_about_to_be_added():
    # An incident about to be written: with keep = 4 and 4 on disk, the oldest goes first, so
    # that the limit holds while the new one is written (not only after).
    assert to_remove(logs(1, 1, 1, 1), Rule(keep=4), room=1) == ["e0.1.log"]
    assert to_remove(logs(1, 1, 1), Rule(keep=4), room=1) == []
    # keep = 1: everything goes but the live ones; no limit: nothing.
    assert to_remove(logs(1, 1), Rule(keep=1), live=["e0.2.log"], room=1) == ["e0.1.log"]
    assert to_remove(logs(1, 1), Rule(keep=0), room=1) == []


def test_prune_incidents_makes_room_and_never_removes_a_folder_being_written(tmp_path):
    names = ["20260101T000000-e0-1", "20260101T000001-e1-1", "20260101T000002-e2-1"]
    for n in names:
        (tmp_path / n).mkdir()
    writing = {tmp_path / names[0], tmp_path / "20260101T000003-e3-1"}  # the oldest still written; one to come
    # keep = 2 and one about to be written: one may stay besides; the oldest is live, so the others go.
    assert prune_incidents(tmp_path, writing, Rule(keep=2), room=1) == names[1:]
    assert sorted(p.name for p in tmp_path.iterdir()) == names[:1]
