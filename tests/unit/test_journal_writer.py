"""The journal's writer (in-process, a real Fleet and real files): an awaited write leaves the
fsyncs to one writer thread, the loop free meanwhile; requests that come while it writes are
coalesced into one write of the newest; a synchronous flush (a bus listener, close) never
leaves an older snapshot on disk after a newer one; a full disk is logged, never raised; close
leaves the last snapshot on disk and no thread. The slow disk is a write_atomic that sleeps
(monkeypatched here, in the test only). The daemon-level checks (a spawned pid journaled, a
reload, a kill -9 adopting from the journal) are tests/daemon/test_restart_faults.py's."""

from __future__ import annotations

import asyncio
import errno
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from structlog.testing import capture_logs

from vime.supervisor import journal
from vime.supervisor.config import Config
from vime.supervisor.fleet import Fleet

WRITE_S = 0.02  # one slow write: json.dump and two fsyncs on a contended disk


@pytest.fixture
def writer(tmp_path):
    fleet = Fleet(Config(engines=(), state_dir=str(tmp_path), log_dir=str(tmp_path), runtime_dir=str(tmp_path)))
    return journal.JournalWriter(fleet, tmp_path / "journal.json")


def at(w: journal.JournalWriter, n: int) -> None:
    """The fleet changes: its snapshot now names checkpoint /ck/n."""
    w.fleet.policy.checkpoint = f"/ck/{n}"


def n_of(data: dict[str, Any]) -> int:
    return int(data["checkpoint"].rsplit("/", 1)[1])


@pytest.fixture
def slow_disk(monkeypatch):
    """write_atomic taking WRITE_S; `written` the snapshots' numbers in the order they reached
    the disk, `inside` set while a write runs, `threads` the names of the threads that wrote."""
    real = journal.write_atomic

    class Disk:
        written: list[int] = []
        threads: list[str] = []
        inside = threading.Event()

        @staticmethod
        def write(path: Path, data: dict[str, Any]) -> None:
            Disk.inside.set()
            time.sleep(WRITE_S)
            real(path, data)
            Disk.written.append(n_of(data))
            Disk.threads.append(threading.current_thread().name)
            Disk.inside.clear()

    monkeypatch.setattr(journal, "write_atomic", Disk.write)
    return Disk


def journal_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("vime-journal")]


async def test_an_awaited_write_is_on_disk_when_it_returns_and_close_leaves_no_thread(writer):
    at(writer, 1)
    await writer.write()
    assert journal.load(writer.path)["checkpoint"] == "/ck/1" and writer.writes == 1
    assert journal_threads()  # written by the writer thread
    at(writer, 2)
    await writer.close()
    assert journal.load(writer.path)["checkpoint"] == "/ck/2"  # the final write: the fleet as it is
    assert journal_threads() == []
    at(writer, 3)
    await writer.write()  # after close: written on the caller's thread, no thread started again
    assert journal.load(writer.path)["checkpoint"] == "/ck/3" and journal_threads() == []


async def test_writes_requested_meanwhile_coalesce_into_the_newest(writer, slow_disk):
    """Ten runners spawn while the first one's pid is written: one more write, of the newest,
    and each returns only once a snapshot at least as new as its own is on disk."""
    seen: dict[int, int] = {}

    async def persist(n: int) -> None:
        at(writer, n)
        await writer.write()
        seen[n] = n_of(journal.load(writer.path))

    await asyncio.gather(*(persist(n) for n in range(1, 11)))
    assert slow_disk.written == [1, 10]
    assert all(on_disk >= n for n, on_disk in seen.items()), seen
    assert set(slow_disk.threads) != {threading.current_thread().name}  # not the loop's thread
    await writer.close()


async def test_a_sync_flush_never_leaves_an_older_snapshot_after_a_newer_one(writer, slow_disk):
    """The thread is writing 1 and 2 is queued for it when the bus listener flushes 3: the flush
    waits for 1, writes 3, and 2 (older) is never written after it."""
    at(writer, 1)
    first = asyncio.create_task(writer.write())
    for _ in range(2000):  # until the thread is inside the write of 1
        if slow_disk.inside.is_set():
            break
        await asyncio.sleep(0.001)
    assert slow_disk.inside.is_set() and not first.done(), "the write of 1 never ran on the thread"
    at(writer, 2)
    second = asyncio.create_task(writer.write())
    await asyncio.sleep(0)  # 2 is handed to the thread
    at(writer, 3)
    writer.on_membership(frozenset())  # not started: a listener only while started
    assert slow_disk.written == []
    writer._writing = True  # as start() leaves it, without its periodic task
    writer.on_membership(frozenset())  # the epoch moved: on disk before this returns
    # 2 is skipped, or (the thread took the lock first) written before 3, never after it
    assert slow_disk.written in ([1, 3], [1, 2, 3])
    written = list(slow_disk.written)
    await asyncio.gather(first, second)
    assert slow_disk.written == written and n_of(journal.load(writer.path)) == 3
    await writer.close()  # the final flush: the fleet as it is (3 again)
    assert slow_disk.written == written + [3]


async def test_a_full_disk_is_logged_and_never_raised_into_the_runner(writer, monkeypatch):
    real = journal.write_atomic

    def full(path: Path, data: dict[str, Any]) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(journal, "write_atomic", full)
    at(writer, 1)
    with capture_logs() as logs:
        await writer.write()  # returns: the engine keeps running
        writer.flush()
    failed = [e for e in logs if e["event"] == "journal.write_failed"]
    assert len(failed) == 2 and "No space left" in failed[0]["error"] and failed[0]["log_level"] == "error"
    assert writer.writes == 0 and not writer.path.exists()
    monkeypatch.setattr(journal, "write_atomic", real)  # space again: the next write goes through
    at(writer, 2)
    await writer.write()
    assert journal.load(writer.path)["checkpoint"] == "/ck/2"
    await writer.close()


async def test_the_loop_stays_responsive_while_64_spawns_persist_on_a_slow_disk(writer, slow_disk):
    """64 runners spawn 5 ms apart, each awaiting its pid on disk (20 ms a write): the writes
    run on the thread, so a ticker on the loop is never held up for anything like a write
    (synchronously they held the loop 64 x 20 ms)."""
    gaps: list[float] = []
    stop = asyncio.Event()

    async def ticker() -> None:
        last = time.monotonic()
        while not stop.is_set():
            await asyncio.sleep(0.002)
            now = time.monotonic()
            gaps.append(now - last)
            last = now

    async def spawn(n: int) -> float:
        await asyncio.sleep(0.005 * n)
        at(writer, n)
        t0 = time.monotonic()
        await writer.write()
        assert n_of(journal.load(writer.path)) >= n
        return time.monotonic() - t0

    tick = asyncio.create_task(ticker())
    waits = await asyncio.gather(*(spawn(n) for n in range(1, 65)))
    stop.set()
    await tick
    await writer.close()
    assert max(gaps) < 0.1, f"the loop was held {max(gaps) * 1000:.0f} ms"
    assert 1 < len(slow_disk.written) < 64  # coalesced, and more than one write
    assert max(waits) < 0.5  # each spawn waited for a write or two, not for the queue
