"""A chain push's progress reports (weight_sync.progress): the judgement of which rank stopped
(pure, on a clock the test sets), and the reporter over a real TCPStore."""

from __future__ import annotations

import time
from datetime import timedelta

import pytest

from vime.weight_sync.progress import (
    STORE_TIMEOUT_S,
    ProgressWatch,
    Report,
    Reporter,
    read_reports,
    report_period,
)

URLS = {1: "http://a", 2: "http://b", 3: "http://c", 4: "http://d"}


def test_a_report_round_trips_and_the_period_fits_the_window():
    r = Report(7, received=12, forwarded=11, longest_wait_s=0.25, done=True)
    assert Report.decode(r.encode()) == r
    assert report_period(7.0) == 1.0 and report_period(2.0) == 0.5 and report_period(0.1) == 0.05


def test_only_the_rank_whose_reports_stopped_is_judged_stopped():
    """Rank 3 stops at t=1. Rank 2 (backed up behind it: no chunk forwarded) and rank 4
    (starved: no chunk received) keep reporting, and rank 1 is slow (a report every 2.5 s,
    under the 3 s window): none of them is judged stopped, however long; rank 3 is, one window
    after its last report was seen, and not a moment before."""
    watch = ProgressWatch(dict(URLS), window_s=3.0)
    tick = {r: 0 for r in URLS}

    def report(rank: int, now: float, received: int, forwarded: int) -> None:
        tick[rank] += 1
        watch.observe(rank, Report(tick[rank], received, forwarded).encode(), now)

    t = 0.0
    while t <= 10.0:
        if t <= 1.0:
            report(3, t, 5, 5)
        report(2, t, 9, 5)  # backed up behind 3: its counters frozen, its reports not
        report(4, t, 5, 5)  # starved behind 3
        if t % 2.5 == 0:
            report(1, t, 9, 9)
        assert watch.stopped(t) == ([3] if t >= 4.0 else []), t
        t += 0.5
    assert watch.stopped_urls(10.0) == {"http://c"}
    assert watch.longest_silence_s == 2.5  # rank 1's, the slowest live one
    assert "rank 3 (http://c): 5 chunks in, 5 on" in watch.describe([3])


def test_a_rank_done_or_never_heard_from_is_not_judged_by_reports():
    watch = ProgressWatch({1: "http://a", 2: "http://a", 3: "http://b"}, window_s=1.0)
    watch.observe(1, Report(1, done=True).encode(), 0.0)
    watch.observe(2, b"not a report", 0.0)
    watch.observe(3, None, 0.0)
    assert watch.stopped(100.0) == []
    assert not watch.reporting("http://a")  # rank 2 never reported: /health judges this URL
    watch.observe(2, Report(1).encode(), 0.0)
    assert watch.reporting("http://a") and not watch.reporting("http://b")
    assert watch.stopped_urls(1.0) == {"http://a"}


def test_the_reporter_reports_through_a_tcpstore_until_stopped_and_then_says_done():
    import torch.distributed as dist

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                           timeout=timedelta(seconds=10))
    client = dist.TCPStore("127.0.0.1", server.port, is_master=False, wait_for_workers=False,
                           timeout=timedelta(seconds=STORE_TIMEOUT_S))
    counters = [0, 0, 0.0]
    rep = Reporter(client, "k/push/2", lambda: (counters[0], counters[1], counters[2]), window_s=0.2)
    watch = ProgressWatch({2: "http://b"}, window_s=0.2)
    rep.start()
    try:
        seen = []
        for i in range(6):
            counters[0] = i
            time.sleep(0.06)
            read_reports(server, "k/push", watch)
            seen.append(watch.seen[2].report)
        assert len({s.tick for s in seen}) >= 2 and seen[-1].received >= 4 and not seen[-1].done
    finally:
        rep.stop()
    read_reports(server, "k/push", watch)
    assert watch.seen[2].report.done


def test_a_reporter_whose_store_is_gone_ends_quietly_and_never_holds_its_caller():
    class Gone:
        sets = 0

        def set(self, key, value):
            Gone.sets += 1
            raise RuntimeError("connection reset")

    t0 = time.monotonic()
    rep = Reporter(Gone(), "k/push/2", lambda: (0, 0, 0.0), window_s=0.2)
    rep.start()
    time.sleep(0.2)
    rep.stop()
    assert Gone.sets == 1 and time.monotonic() - t0 < 1.0  # the first failure ended the reports


def test_reports_from_a_store_that_closed_leave_the_judgement_on_what_was_seen():
    class Gone:
        def check(self, keys):
            raise RuntimeError("connection reset")

    watch = ProgressWatch({1: "http://a"}, window_s=1.0)
    watch.observe(1, Report(1).encode(), 0.0)
    read_reports(Gone(), "k", watch, now=5.0)
    assert watch.stopped(5.0) == [1]


@pytest.mark.parametrize("bad", ["1 2", "x 1 2 0.1 0"])
def test_a_malformed_report_is_ignored(bad):
    watch = ProgressWatch({1: "http://a"}, window_s=1.0)
    watch.observe(1, bad.encode(), 0.0)
    assert watch.seen == {}
