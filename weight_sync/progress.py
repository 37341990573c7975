"""A chain push's progress, rank by rank: which receiver stopped, judged by its own reports.

Every receiving rank of a chain push (gloo_engine) runs a `Reporter`: a thread that writes, every
`report_period(window)`, a `Report` (a tick that always moves, and its relay's chunk counters)
under ``<progress_key>/<rank>`` in the trainer's TCPStore (the group's rendezvous store), and a
last one marked done when its receive ends, however it ends. The trainer (broadcast.FleetSender)
reads them into a `ProgressWatch` and judges:

* a rank whose report has not moved for a stall window is stopped (SIGSTOP, a wedged host):
  only it is condemned;
* a rank that keeps reporting is alive, however slow (a busy CPU) and whatever its counters say
  (starved by a stopped upstream, or backed up behind a stopped downstream): never condemned;
  its answer is awaited (up to the attempt's end).

A stopped rank cannot report, so this tells the stopped one from the neighbours whose hops stall
because of it, which a hop's own timeout cannot (both sides of a dead hop see the same silence).
The judgement is pure (times are the trainer's clock when it saw a report change); the store
I/O is at the edges, and a store gone (the push torn down) only ends the reports.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any


def report_period(window_s: float) -> float:
    """How often a rank reports: four times a window (so one late report never looks like a
    stop), at most once a second, at least every 50 ms."""
    return max(0.05, min(1.0, window_s / 4))


@dataclass(frozen=True)
class Report:
    """One rank's report: `tick` moves every report; `received`/`forwarded` count chunks;
    `longest_wait_s` is its relay's longest wait for one chunk so far (its margin to the window)."""

    tick: int
    received: int = 0
    forwarded: int = 0
    longest_wait_s: float = 0.0
    done: bool = False

    def encode(self) -> bytes:
        return (f"{self.tick} {self.received} {self.forwarded} {self.longest_wait_s:.3f} "
                f"{int(self.done)}").encode()

    @classmethod
    def decode(cls, raw: bytes) -> "Report":
        tick, received, forwarded, wait, done = raw.decode().split()
        return cls(int(tick), int(received), int(forwarded), float(wait), done == "1")


STORE_TIMEOUT_S = 2.0  # a reporter's store client: a set on a store gone fails within this


class Reporter:
    """Engine side: reports `counters()` (received, forwarded, longest_wait_s) under `key` in
    `store` (a client with a short timeout: STORE_TIMEOUT_S) every period until `stop()`, which
    writes the last report, marked done. A failing store (the trainer tore the push down) ends
    the reports quietly: it is no fault of ours."""

    def __init__(self, store: Any, key: str, counters: Callable[[], tuple[int, int, float]],
                 window_s: float) -> None:
        self._store, self._key, self._counters = store, key, counters
        self._period = report_period(window_s)
        self._tick = 0
        self._halt = threading.Event()
        self._lock = threading.Lock()  # one set at a time (the thread's, or stop()'s last)
        self._thread = threading.Thread(target=self._run, name="vime-chain-report", daemon=True)

    def start(self) -> "Reporter":
        self._write(False)
        self._thread.start()
        return self

    def _write(self, done: bool, wait: float = -1) -> bool:
        if not self._lock.acquire(timeout=wait):  # a set stuck on a dead store: skip the last
            return False
        try:
            if self._store is None:
                return False
            self._tick += 1
            try:
                self._store.set(self._key, Report(self._tick, *self._counters(), done=done).encode())
            except Exception:  # noqa: BLE001 - the store is gone with the push: stop reporting
                self._store = None
                return False
            return True
        finally:
            self._lock.release()

    def _run(self) -> None:
        while not self._halt.wait(self._period) and self._write(False):
            pass

    def stop(self) -> None:
        """The last report, marked done. Never holds its caller (the receive's answer) longer
        than a period and the store's timeout: a dead store only loses the report."""
        self._halt.set()
        self._write(True, wait=self._period + 1.0)
        self._store = None


@dataclass
class _Seen:
    report: Report
    changed_at: float  # the watcher's clock when this report was first seen


@dataclass
class ProgressWatch:
    """Trainer side: the reports of the ranks of one chain push (rank -> the URL it belongs to),
    and the judgement. `observe` one report (None: none yet) at the watcher's time `now`."""

    ranks: dict[int, str]
    window_s: float
    seen: dict[int, _Seen] = field(default_factory=dict)
    # The longest a rank that then reported again went without a new report: a live rank's
    # margin to the window (what the window's default is measured against).
    longest_silence_s: float = 0.0

    def observe(self, rank: int, raw: bytes | None, now: float) -> None:
        if raw is None:
            return
        try:
            report = Report.decode(raw)
        except (ValueError, UnicodeDecodeError):
            return  # not ours: judged as silent
        last = self.seen.get(rank)
        if last is None or last.report != report:
            if last is not None:
                self.longest_silence_s = max(self.longest_silence_s, now - last.changed_at)
            self.seen[rank] = _Seen(report, now)

    def stopped(self, now: float) -> list[int]:
        """Ranks that reported and then went a whole window without a new report, not done."""
        return sorted(r for r, s in self.seen.items()
                      if not s.report.done and now - s.changed_at >= self.window_s)

    def stopped_urls(self, now: float) -> set[str]:
        return {self.ranks[r] for r in self.stopped(now) if r in self.ranks}

    def reporting(self, url: str) -> bool:
        """Every rank of `url` reported: its fate is the reports' to judge."""
        mine = [r for r, u in self.ranks.items() if u == url]
        return bool(mine) and all(r in self.seen for r in mine)

    def longest_wait_s(self) -> float:
        """The longest any rank waited for one chunk (its reports so far)."""
        return max((s.report.longest_wait_s for s in self.seen.values()), default=0.0)

    def describe(self, ranks: Iterable[int]) -> str:
        return ", ".join(f"rank {r} ({self.ranks.get(r, '?')}): {self.seen[r].report.received} chunks "
                         f"in, {self.seen[r].report.forwarded} on" for r in ranks if r in self.seen)


def read_reports(store: Any, key: str, watch: ProgressWatch, now: float | None = None) -> None:
    """Read every rank's report from `store` into `watch` (a store gone: nothing new)."""
    now = time.monotonic() if now is None else now
    for rank in watch.ranks:
        k = f"{key}/{rank}"
        try:
            raw = store.get(k) if store.check([k]) else None
        except Exception:  # noqa: BLE001 - the store closed under us: judge on what was seen
            return
        watch.observe(rank, raw, now)
