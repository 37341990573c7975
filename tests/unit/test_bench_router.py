"""bench/router.py's pure parts: reading GET /workers and the router's log, when an engine is
out of (and back in) the router, the request window of a fault, and the final table."""

from __future__ import annotations

import calendar
import time

import pytest

from support.bench_scripts import load_bench

A, B = "http://127.0.0.1:8001", "http://127.0.0.1:8002"


@pytest.fixture(scope="module")
def br():
    return load_bench("router")


def test_workers_answer_to_health_by_url(br):
    body = {"workers": [{"url": A + "/", "is_healthy": True}, {"url": B, "is_healthy": False},
                        {"url": "http://127.0.0.1:8003"}], "total": 3}
    assert br.parse_workers(body) == {A: True, B: False, "http://127.0.0.1:8003": True}
    assert br.parse_workers({}) == {}
    # SMG's entries carry a status: only `ready` is offered (a draining one gets nothing new).
    smg = {"workers": [{"id": "x", "url": A, "is_healthy": True, "status": "ready"},
                       {"id": "y", "url": B, "is_healthy": True, "status": "draining"},
                       {"id": "z", "url": "http://127.0.0.1:8003", "is_healthy": False, "status": "ready"}]}
    assert br.parse_workers(smg) == {A: True, B: False, "http://127.0.0.1:8003": False}


def test_out_is_the_first_poll_after_the_fault_not_offering_it(br):
    samples = [(9.0, {A: False, B: True}),  # before the fault: not counted
               (10.0, {A: True, B: True}), (10.02, {A: True, B: True}),
               (10.04, {A: False, B: True}),  # the router alone: listed, unhealthy
               (10.06, {B: True})]
    assert br.first_out(samples, A, 10.0) == 10.04
    assert br.first_out(samples[:3], A, 10.0) is None
    assert br.first_out([(10.01, {B: True})], A, 10.0) == 10.01  # absent: the daemon removed it


def test_listed_is_the_first_healthy_listing_after_running(br):
    samples = [(20.0, {A: True}), (30.0, {B: True}), (30.5, {A: False, B: True}), (30.51, {A: True, B: True})]
    assert br.first_listed(samples, A, 30.0) == 30.51
    assert br.first_listed(samples, A, 31.0) is None


LOG = (
    "\x1b[2m2026-11-26 01:54:16\x1b[0m \x1b[32m INFO\x1b[0m vllm_router_rs::server: Added worker: " + A + "\n"
    "\x1b[2m2026-11-26 01:54:17\x1b[0m \x1b[31mERROR\x1b[0m router.rs:2006: Failed to send typed request "
    f"worker_url={A} route=/v1/completions error=error sending request\n"
    "2026-11-26 01:54:18 ERROR router.rs:2006: Failed to send typed request "
    f"worker_url={B} route=/v1/completions error=x\n"
    "2026-11-26 01:54:19 ERROR router.rs:2006: Failed to send typed request "
    f"worker_url={A}/ route=/v1/completions error=x\n"
    "DEBUG: Server startup function called\n")


def test_failed_sends_from_the_router_log_in_utc(br):
    at = lambda s: float(calendar.timegm(time.strptime(s, "%Y-%m-%d %H:%M:%S")))  # noqa: E731
    assert br.failed_sends(LOG, A) == [at("2026-11-26 01:54:17"), at("2026-11-26 01:54:19")]
    assert br.failed_sends(LOG, B) == [at("2026-11-26 01:54:18")]
    assert br.failed_sends("", A) == []


SMG_LOG = (  # SMG 1.13.0's lines (module paths shortened): a request sent to a hung engine at 34 s fails at 47 s
    '2026-12-06 11:21:34  INFO http_request{method=POST path=/v1/completions request_id="cmpl-u"}: smg::request: '
    'started processing request\n'
    '2026-12-06 11:21:35  INFO http_request{method=POST path=/v1/completions request_id="cmpl-F"}: smg::request: '
    'started processing request\n'
    '2026-12-06 11:21:47 ERROR http_request{method=POST path=/v1/completions request_id="cmpl-F"}: router.rs:1367: '
    f'Failed to send typed request worker_url={A} route=/v1/completions error=error sending request\n'
    '2026-12-06 11:21:47 ERROR http_request{method=POST path=/v1/completions request_id="cmpl-u"}: router.rs:1367: '
    f'Failed to send typed request worker_url={B} route=/v1/completions error=error sending request\n'
    '2026-12-06 11:21:48 ERROR http_request{method=POST path=/v1/completions request_id="cmpl-u"}: router.rs:1367: '
    f'Failed to send typed request worker_url={A} route=/v1/completions error=error sending request\n'
    '2026-12-06 11:21:49 ERROR http_request{request_id="cmpl-unknown"}: router.rs:1367: '
    f'Failed to send typed request worker_url={A} route=/v1/completions error=x\n')


def test_a_failed_send_is_dated_by_its_requests_arrival_when_the_log_names_it(br):
    at = lambda s: float(calendar.timegm(time.strptime("2026-12-06 " + s, "%Y-%m-%d %H:%M:%S")))  # noqa: E731
    # cmpl-F: its first attempt, sent on arrival (34 s... 35 s), failed when the hung engine's
    # connection broke (47 s). cmpl-u: its first attempt went to B; the retry to A is dated by its
    # failure (48 s, a bound). An id the log never saw arrive: its failure stamp.
    assert br.failed_sends(SMG_LOG, A) == [at("11:21:35"), at("11:21:48"), at("11:21:49")]
    assert br.failed_sends(SMG_LOG, B) == [at("11:21:34")]
    assert br.sent_after(br.failed_sends(SMG_LOG, A), at("11:21:40") + 0.5) == 2  # 48 s and 49 s


def test_sent_after_counts_only_seconds_wholly_after_out(br):
    stamps = [100.0, 101.0, 102.0]
    assert br.sent_after(stamps, 100.5) == 2  # 100.0 covers [100, 101): it may be before 100.5
    assert br.sent_after(stamps, 101.0) == 2
    assert br.sent_after(stamps, 102.01) == 0
    assert br.sent_after(stamps, None) == 0


def test_window_counts_requests_from_the_fault_to_settle_after_out(br):
    done = [(9.0, 9.1, False, "before"), (10.1, 10.2, False, "e"), (10.5, 14.0, True, ""),
            (12.0, 12.1, True, ""), (13.5, 13.6, False, "after the window")]
    assert br.window(done, 10.0, 10.2, cap=300) == (3, 1, pytest.approx(3.5))  # to 13.2
    assert br.window(done, 10.0, None, cap=3.6) == (4, 2, pytest.approx(3.5))  # to the cap
    assert br.window([], 10.0, None, cap=5) == (0, 0, 0.0)


def test_throughput_counts_answers_ending_inside(br):
    done = [(0.0, 0.5, True, ""), (0.5, 1.5, True, ""), (1.5, 2.5, False, "x"), (2.5, 3.5, True, ""),
            (3.5, 4.5, True, "")]
    assert br.throughput(done, 1.0, 4.0) == pytest.approx(2 / 3)


def test_out_and_ratio_formats(br):
    assert br.fmt_out(None, 300) == "not within 300 s"
    assert br.fmt_out(0.0314, 300) == "0.031"
    assert br.fmt_ratio(3.0, 0.03, 300) == "100.0"
    assert br.fmt_ratio(None, 0.03, 300) == "> 10000"
    assert br.fmt_ratio(3.0, None, 300) == "-"


def test_table_compares_each_feed_with_the_daemon_fed_trial(br):
    res = br.Results(cap=300.0)
    T = br.Trial
    res.trials = [T("SIGSTOP", br.FEEDS[1], 0, None, 40, 30, 30.0, 0, 0),
                  T("kill -9", br.FEEDS[2], 0, 2.9, 100, 0, 0.3, 5, 0),
                  T("kill -9", br.FEEDS[0], 0, 0.029, 90, 1, 0.2, 1, 0),
                  T("SIGSTOP", br.FEEDS[0], 0, 2.5, 50, 0, 4.0, 0, 0),
                  T("kill -9", br.FEEDS[1], 0, 9.0, 10, 0, 0.3, 0, 0, kind="smg"),
                  T("kill -9", br.FEEDS[0], 0, 0.05, 10, 0, 0.2, 0, 0, kind="smg"),
                  T("drain", br.FEEDS[0], 0, 0.02, 10, 0, 0.1, 0, 0)]
    res.listed_ms = {"vllm-router": [12.0, 30.0], "smg": [50.0, 150.0]}
    res.direct, res.routed = {"vllm-router": [40.0, 44.0]}, {"vllm-router": [30.0, 33.0]}
    lines = br.table(res)
    rows = [x.split(None, 1) for x in lines if x.lstrip().startswith(("vllm-router", "smg"))
            and any(f in x for f in br.FEEDS) and "run" not in x.split()[1:3]]
    rows = [r for r in rows if r[1].split()[0] in ("kill", "SIGSTOP", "drain") and r[1].split()[-1].isdigit()][:7]
    # vllm-router first, then SMG; kill -9, SIGSTOP, drain; the daemon-fed trial first within a fault.
    assert [(k, r.split()[0]) for k, r in rows] == [
        ("vllm-router", "kill"), ("vllm-router", "kill"), ("vllm-router", "SIGSTOP"), ("vllm-router", "SIGSTOP"),
        ("vllm-router", "drain"), ("smg", "kill"), ("smg", "kill")]
    assert "daemon feeds the router" in rows[0][1] and "0.029" in rows[0][1] and " 1.0 " in rows[0][1]
    assert "router alone, 1 s" in rows[1][1] and "100.0" in rows[1][1] and "0/100" in rows[1][1]
    assert "not within 300 s" in rows[3][1] and "> 120" in rows[3][1] and "30/40" in rows[3][1]
    assert "router alone, defaults" in rows[6][1] and " 180.0 " in rows[6][1]  # against SMG's own fed trial
    assert any(x.startswith("vllm-router:") and "12 / 30 ms" in x and "median 21" in x and "goal: yes" in x
               for x in lines)
    assert any(x.startswith("smg:") and "50 / 150 ms" in x and "goal: no" in x for x in lines)
    assert lines[-1].split() == ["median", "42.0", "31.5", "0.75"]
    assert any(x.split()[:3] == ["smg", "kill", "-9"] and "detected" in x for x in lines)
    assert not any("drain run" in x and "detected" in x for x in lines)  # a stop is no fault to detect


def test_table_names_a_failed_phase(br):
    res = br.Results(cap=30.0, failures=["smg, router alone: TimeoutError: x"])
    assert br.table(res)[-1] == "FAILED smg, router alone: TimeoutError: x"


def test_a_daemon_fed_trial_never_out_or_sent_to_after_out_breaks_the_claim(br):
    T = br.Trial
    res = br.Results(cap=30.0)
    res.trials = [T("kill -9", br.FEEDS[0], 0, 0.9, 10, 0, 0.2, 1, 0),  # holds
                  T("SIGSTOP", br.FEEDS[0], 1, None, 10, 5, 30.0, 0, 0, kind="smg"),
                  T("drain", br.FEEDS[0], 2, 0.1, 10, 0, 0.2, 2, 1),
                  T("SIGSTOP", br.FEEDS[0], 2, 6.1, 10, 0, 12.0, 3, 3),  # failed when killed: a bound only
                  T("SIGSTOP", br.FEEDS[1], 0, None, 10, 5, 30.0, 0, 0, cap=90.0),  # the baseline: not counted
                  T("kill -9", br.FEEDS[2], 0, 2.0, 10, 0, 0.2, 9, 4)]
    assert br.broken_claims(res) == [
        "smg, SIGSTOP, run 2: the router still offered the engine after 30 s",
        "vllm-router, drain, run 3: the router's log has 1 send(s) to the engine after it was out"]
    assert br.broken_claims(br.Results(cap=30.0)) == []


def test_daemon_times_from_its_event_stream(br):
    events = [{"event": "transition", "engine": "engine-1", "to_state": "EXITED", "ts": 5.0},  # earlier fault
              {"event": "transition", "engine": "engine-0", "to_state": "EXITED", "ts": 10.01},
              {"event": "transition", "engine": "engine-1", "to_state": "EXITED", "ts": 10.02},
              {"event": "router", "action": "removed", "engine": "engine-1", "ts": 10.05},
              {"event": "router", "action": "added", "engine": "engine-1", "ts": 40.0}]
    det, rem = br.daemon_times(events, "engine-1", 10.0)
    assert (round(det, 3), round(rem, 3)) == (0.02, 0.05)
    assert br.daemon_times(events[:1], "engine-1", 10.0) == (None, None)


def test_medians_and_spreads_per_kind_fault_and_feed(br):
    """Three trials per cell: the median "out", its spread, a capped trial counted as the cap."""
    T = br.Trial
    res = br.Results(cap=300.0)
    res.trials = [T("kill -9", br.FEEDS[0], r, out, 30, f, 0.2, 0, 0) for r, (out, f) in
                  enumerate([(0.9, 1), (0.5, 0), (1.2, 2)])]
    res.trials += [T("kill -9", br.FEEDS[1], r, out, 30, 5, 9.0, 3, 0, cap=90.0) for r, out in
                   enumerate([None, 60.0, None])]
    res.trials += [T("SIGSTOP", br.FEEDS[2], r, out, 30, 0, 1.0, 0, 0, cap=90.0, kind="smg") for r, out in
                   enumerate([3.0, 2.0, 4.0])]
    lines = br.medians(res)
    fed = next(x for x in lines if "daemon feeds the router" in x)
    assert fed.split()[-5:] == ["0.900", "0.500", "to", "1.200", "3/90"], fed
    alone = next(x for x in lines if "router alone, defaults" in x)
    assert "> 90" in alone.split("60.000")[0] and alone.endswith("15/90"), alone  # median capped
    assert "60.000 to > 90" in alone, alone
    smg = next(x for x in lines if " smg " in x)
    assert "3.000" in smg and "2.000 to 4.000" in smg, smg
    assert any("over the trials of each cell: median and spread" in x for x in br.table(res))
    assert br.medians(br.Results(cap=1.0)) == []
