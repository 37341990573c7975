"""The long soak's growth report (harness/growth.py) on synthetic series: a flat series with
noise passes, a leak beyond its bound fails, a daemon restart that resets the RSS is not read as
a fall (or a rise), the warm-up is skipped, and the retention rules are checked exactly; the
descriptors sampled leave the live HTTP pools out (real sockets)."""

from __future__ import annotations

import os
import random
import socket
import threading

import pytest

from vime.harness import growth
from vime.harness.growth import MIB, fit, judge, report
from vime.harness.soak import least_fds, outbound_connections, proc_sample

from support.polling import wait_until

LIMITS = {"log_keep": 3, "log_keep_bytes": 1 << 20, "incidents_keep": 5, "incidents_keep_bytes": 1 << 20}


def series(minutes: float = 120, every_s: float = 60, *, rss_per_h: float = 0.0, fds_per_h: float = 0.0,
           restart_at_s: float | None = None, seed: int = 0, warm_rise_mib: float = 0.0) -> list[dict]:
    """Samples as the soak writes them: flat with noise, plus the given growth; a daemon
    restart at restart_at_s gives a new pid and RSS back at its base."""
    rng = random.Random(seed)
    out, t, pid, started = [], 0.0, 100, 0.0
    while t <= minutes * 60:
        if restart_at_s is not None and t >= restart_at_s and pid == 100:
            pid, started = 200, t
            restarted = True
        else:
            restarted = False
        age_h = (t - started) / 3600
        warm = warm_rise_mib * MIB * min(1.0, (t - started) / 300)  # fills in its first 5 minutes
        out.append({
            "t": t, "daemon_pid": pid, "daemon_started": started, "daemon_restarted": restarted,
            "daemon_rss": 60 * MIB + warm + rss_per_h * MIB * age_h + rng.gauss(0, 0.3 * MIB),
            "daemon_fds": 40 + int(fds_per_h * age_h) + rng.randint(0, 3),
            "daemon_threads": 9, "loop_lag_ms": 3 + rng.random() * 4,
            "journal_bytes": 900 + rng.randint(0, 20), "daemon_log_bytes": 2000 * t,
            "engines_rss": 2000 * MIB + rng.gauss(0, 20 * MIB),
            "engine_logs_bytes": 50_000, "incidents_bytes": 10_000, "log_bytes": 2000 * t + 60_000,
            "engine_log_files_max": 2, "engine_old_logs_bytes_max": 40_000, "incident_dirs": 1,
        })
        t += every_s
    return out


def row(rep: dict, key: str) -> dict:
    return next(r for r in rep["quantities"] if r["key"] == key)


def test_flat_series_passes():
    rep = report(series(seed=1), warmup_s=600, limits=LIMITS)
    assert rep["ok"], growth.format_report(rep)
    rss = row(rep, "daemon_rss")
    assert abs(rss["slope per h"]) < 0.5 and rss["se per h"] < 0.5 and rss["samples used"] == 111
    assert row(rep, "daemon_threads")["slope per h"] == 0
    # daemon.log grows by design (2000 B/s = 6.9 MiB/h): reported, within its bound.
    assert row(rep, "daemon_log_bytes")["slope per h"] == pytest.approx(2000 * 3600 / MIB)
    assert row(rep, "log_bytes")["verdict"] == "reported"


def test_a_leak_beyond_its_bound_fails():
    rep = report(series(rss_per_h=10.0, seed=2), warmup_s=600, limits=LIMITS)
    assert not rep["ok"]
    rss = row(rep, "daemon_rss")
    assert rss["slope per h"] == pytest.approx(10.0, abs=0.5) and not rss["ok"]
    assert rss["verdict"].startswith("GROWS")
    # both halves see it: a leak, not a step
    assert rss["first half per h"] == pytest.approx(10.0, abs=2) and rss["second half per h"] == pytest.approx(10.0, abs=2)
    assert all(r["ok"] for r in rep["quantities"] if r["key"] != "daemon_rss")


def test_an_fd_leak_fails():
    rep = report(series(fds_per_h=12.0, seed=3), warmup_s=600, limits=LIMITS)
    fds = row(rep, "daemon_fds")
    assert not fds["ok"] and fds["slope per h"] == pytest.approx(12.0, abs=1.5)


def test_growth_within_its_bound_passes():
    rep = report(series(rss_per_h=2.0, seed=4), warmup_s=600, limits=LIMITS)
    rss = row(rep, "daemon_rss")
    assert rss["ok"] and rss["slope per h"] == pytest.approx(2.0, abs=0.5)


def test_a_daemon_restart_is_a_new_segment_not_a_fall_or_a_rise():
    """A leaking daemon killed at 60 min: its RSS drops back to the base. One line through all
    samples would see a smaller slope (the drop hides the leak); the fit by incarnation sees it."""
    samples = series(rss_per_h=10.0, restart_at_s=3600, seed=5)
    f = fit(samples, "daemon_rss", warmup_s=600, per_daemon=True)
    assert f is not None and f.incarnations == 2
    assert f.slope / MIB == pytest.approx(10.0, abs=0.7)
    one_line = fit(samples, "daemon_rss", warmup_s=600, per_daemon=False)
    assert one_line is not None and one_line.slope / MIB < 6
    rep = report(samples, warmup_s=600, limits=LIMITS)
    assert rep["daemon pids"] == [100, 200] and rep["daemon restarts at s"] == [3600.0]
    assert not row(rep, "daemon_rss")["ok"]
    # and a flat daemon restarted (a bigger base after the restart) is no growth
    flat = series(restart_at_s=3600, seed=6)
    for s in flat:
        if s["daemon_pid"] == 200:
            s["daemon_rss"] += 30 * MIB
    assert row(report(flat, warmup_s=600, limits=LIMITS), "daemon_rss")["ok"]


def test_the_warm_up_is_skipped():
    """RSS that rises 20 MiB in its first 5 minutes, then stays: growth only if the warm-up
    is counted. After a daemon restart the warm-up is skipped again."""
    samples = series(warm_rise_mib=20, restart_at_s=3600, seed=7)
    assert row(report(samples, warmup_s=600, limits=LIMITS), "daemon_rss")["ok"]
    counted = row(report(samples, warmup_s=0, limits=LIMITS), "daemon_rss")
    assert counted["slope per h"] > 4
    assert growth.warmup_for(2 * 3600) == 600 and growth.warmup_for(12 * 60) == 180


def test_too_few_samples_is_no_pass():
    ok, verdict = judge(growth.QUANTITIES[0], fit(series(minutes=2), "daemon_rss", warmup_s=600))
    assert not ok and "too few" in verdict


def test_retention_rules_are_checked_exactly():
    samples = series(minutes=30, seed=8)
    assert all(r["ok"] for r in report(samples, warmup_s=600, limits=LIMITS)["retention"])
    samples[20]["engine_log_files_max"] = 4  # one engine kept 4 logs with log_keep = 3
    samples[21]["incidents_bytes"] = (1 << 20) + 1
    rep = report(samples, warmup_s=600, limits=LIMITS)
    bad = {r["rule"] for r in rep["retention"] if not r["ok"]}
    assert bad == {"log_keep", "incidents_keep_bytes"} and not rep["ok"]
    # 0 is no limit
    assert all(r["ok"] for r in report(samples, warmup_s=600, limits={})["retention"])


def test_the_table_says_each_verdict():
    text = growth.format_report(report(series(rss_per_h=10.0, seed=9), warmup_s=600, limits=LIMITS))
    assert "daemon RSS" in text and "GROWS" in text and "growth verdict: FAIL" in text
    assert "FAIL" not in growth.format_report(report(series(seed=10), warmup_s=600, limits=LIMITS)).replace(
        "growth verdict: FAIL", "")


def test_the_fds_judged_leave_out_live_outbound_connections_only():
    """outbound_connections on this process with real sockets: a connection it made is left out
    while live and counted once its peer has closed it (a leak looks like that); a connection it
    accepted is counted, as is the listener. Read by the sockets' own inodes, so that other
    descriptors of the test process opening or closing meanwhile do not matter."""
    def inode(s: socket.socket) -> str:
        return str(os.fstat(s.fileno()).st_ino)

    for family, host in ((socket.AF_INET, "127.0.0.1"), (socket.AF_INET6, "::1")):
        with socket.socket(family) as srv:
            srv.bind((host, 0))
            srv.listen(8)
            made = [socket.create_connection(srv.getsockname()[:2]) for _ in range(3)]
            accepted = [srv.accept()[0] for _ in range(3)]
            try:
                left_out, per_peer = outbound_connections(os.getpid())
                assert {inode(c) for c in made} <= left_out, family
                assert not ({inode(a) for a in accepted} | {inode(srv)}) & left_out, family
                assert max(per_peer.values()) >= 3
                for a in accepted:
                    a.close()
                # The made ones go to CLOSE_WAIT: counted again.
                wait_until(lambda: not {inode(c) for c in made} & outbound_connections(os.getpid())[0], 5,
                           "the made connections counted once their peer closed")
            finally:
                for c in made:
                    c.close()
    sample = proc_sample(os.getpid())
    assert sample["daemon_fds"] == sample["daemon_fds_all"] - sample["daemon_tcp_out"]


def test_the_fds_judged_are_the_least_of_the_reads():
    """A descriptor held at one read only (a spawn's pipes, a connection being made) is not
    counted; one held at every read (a leak) is; a read of a process gone is skipped."""
    reads = [{"daemon_rss": 1, "daemon_fds": 300, "daemon_fds_all": 800}, {"daemon_rss": 2, "daemon_fds": 290},
             {"daemon_rss": 3, "daemon_fds": None}]
    assert least_fds(reads) == {"daemon_rss": 1, "daemon_fds": 290, "daemon_fds_all": 800, "daemon_fds_max": 300}
    assert least_fds([{"daemon_fds": None}]) == {"daemon_fds": None, "daemon_fds_max": None}
    # From /proc: a descriptor this process holds at the first read only (closed 0.5 s later,
    # the reads 1.5 s apart: margins for a loaded host) is in the most, not in the judged least.
    fd = os.open(os.devnull, os.O_RDONLY)
    closer = threading.Timer(0.5, os.close, (fd,))
    closer.start()
    try:
        sample = proc_sample(os.getpid(), reads=3, gap=1.5)
    finally:
        closer.join()
    assert sample["daemon_fds_max"] - sample["daemon_fds"] >= 1, sample
