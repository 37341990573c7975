"""vime.trainer.trace: the Chrome trace file, the long-tail summary, and real daemon events in it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import pytest

from vime.supervisor.client import SupervisorClient
from vime.harness.local_daemon import Daemon, free_port, write_config
from vime.trainer.trace import (
    DAEMON_PID, TRAINER_PID, DaemonEventRecorder, Tracer, format_summary, long_tail_summary, percentile,
    save_summary,
)

T0 = 1_718_000_000.0  # a wall-clock time


def req(engine, sent, first, finished, tokens=8, **kw):
    return {"engine": engine, "text": "x", "token_ids": list(range(tokens)), "finish_reason": "length",
            "timings": {"sent": T0 + sent, "first_token": None if first is None else T0 + first,
                        "finished": None if finished is None else T0 + finished}, **kw}


def load(path: Path) -> dict:
    doc = json.loads(path.read_text(encoding="utf-8"))
    assert set(doc) >= {"traceEvents", "displayTimeUnit"} and doc["displayTimeUnit"] == "ms"
    return doc


REQUIRED = {"X": {"name", "ph", "ts", "dur", "pid", "tid"}, "i": {"name", "ph", "ts", "pid", "tid", "s"},
            "M": {"name", "ph", "pid", "tid", "args"}}


def check_fields(events: list[dict]) -> None:
    for ev in events:
        assert ev["ph"] in REQUIRED, ev
        assert REQUIRED[ev["ph"]] <= set(ev), ev
        assert isinstance(ev["ts"], int) and ev["ts"] >= 0, ev
        if ev["ph"] == "X":
            assert isinstance(ev["dur"], int) and ev["dur"] >= 0, ev
        if ev["ph"] == "M":
            assert ev["name"] in ("process_name", "thread_name", "process_sort_index", "thread_sort_index"), ev


def check_nesting(events: list[dict]) -> None:
    """For any two X spans on one (pid, tid): disjoint, or one contains the other."""
    tracks = defaultdict(list)
    for ev in events:
        if ev["ph"] == "X":
            tracks[(ev["pid"], ev["tid"])].append((ev["ts"], ev["ts"] + ev["dur"], ev["name"]))
    for key, spans in tracks.items():
        for i, (a0, a1, an) in enumerate(spans):
            for b0, b1, bn in spans[i + 1:]:
                disjoint = a1 <= b0 or b1 <= a0
                nested = (a0 <= b0 and b1 <= a1) or (b0 <= a0 and a1 <= b1)
                assert disjoint or nested, f"partial overlap on {key}: {an} [{a0},{a1}] vs {bn} [{b0},{b1}]"


def names(events, ph="M"):
    """{(pid, tid): thread name} and {pid: process name}."""
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e["ph"] == ph and e["name"] == "thread_name"}
    procs = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == ph and e["name"] == "process_name"}
    return threads, procs


def test_check_nesting_catches_partial_overlap():
    # The checker used below is not vacuous.
    bad = [{"ph": "X", "ts": 0, "dur": 10, "pid": 1, "tid": 1, "name": "a"},
           {"ph": "X", "ts": 5, "dur": 10, "pid": 1, "tid": 1, "name": "b"}]
    with pytest.raises(AssertionError, match="partial overlap"):
        check_nesting(bad)
    check_nesting([bad[0], {**bad[1], "tid": 2}])


def test_trace_file(tmp_path):
    tr = Tracer()
    tr.add_round(7, T0 + 0.0, T0 + 10.0, epoch=3)
    # engine-0: three requests that overlap each other (concurrent on one engine).
    results = [req("engine-0", 0.5, 1.0, 4.0), req("engine-0", 1.0, 1.5, 3.0), req("engine-0", 2.0, 2.2, 6.0),
               req("engine-1", 0.5, 0.7, 1.5, tokens=3),
               # a re-sent request: attempt 1 on engine-1 failed, attempt 2 on engine-0 answered;
               # its attempt records overlap each other slightly and the first token falls in attempt 2.
               req("engine-0", 3.0, 5.0, 9.0, tokens=20, attempts=[
                   {"engine": "engine-1", "sent": T0 + 3.0, "finished": T0 + 4.1, "error": "connection reset"},
                   {"engine": "engine-0", "sent": T0 + 4.0, "finished": T0 + 9.0}]),
               # a failed request with no finish time
               req("engine-1", 2.0, None, None, tokens=0, error="timeout")]
    for r in results:
        tr.add_request(r, round=7)
    tr.add_span("train step 7", T0 + 10.5, T0 + 12.0, track="train", loss=0.5)
    tr.add_daemon_event({"event": "round_start", "round": 7, "epoch": 3, "ts": T0 - 0.01})
    tr.add_daemon_event({"event": "transition", "engine": "engine-1", "from_state": "RUNNING",
                         "to_state": "EXITED", "reason": "exit status -9", "incarnation": 1, "ts": T0 + 4.05})
    tr.add_daemon_event({"event": "detection", "engine": "engine-1", "kind": "exit", "reason": "x", "ts": T0 + 4.05})
    tr.add_daemon_event({"event": "transition", "engine": "engine-1", "from_state": "EXITED",
                         "to_state": "STARTING", "reason": "restart", "incarnation": 2, "ts": T0 + 10.2})
    tr.add_daemon_event({"event": "round_end", "round": 7, "epoch": 3, "ts": T0 + 10.0})
    tr.add_daemon_event({"event": "keepalive"})  # dropped
    path = tr.write(tmp_path / "out" / "trace.json")

    doc = load(path)
    evs = doc["traceEvents"]
    check_fields(evs)
    check_nesting(evs)
    assert doc["otherData"]["origin_unix_s"] == pytest.approx(T0 - 0.01)
    threads, procs = names(evs)
    assert procs == {TRAINER_PID: "trainer", DAEMON_PID: "vime-supervisor daemon"}
    assert set(threads.values()) == {
        "rounds", "requests engine-0", "requests engine-0 [2]", "requests engine-0 [3]", "requests engine-1",
        "train", "fleet", "engine-1"}

    xs = [e for e in evs if e["ph"] == "X"]
    track = {e["name"]: threads[(e["pid"], e["tid"])] for e in xs}
    assert track["round 7"] == "rounds" and track["train step 7"] == "train"
    rnd = next(e for e in xs if e["name"] == "round 7")
    assert (rnd["ts"], rnd["dur"], rnd["args"]["epoch"]) == (10_000, 10_000_000, 3)
    # Request spans: sent to finished in microseconds since the origin, on their engine's lanes.
    r0 = next(e for e in xs if e["name"] == "request 0 (round 7)")
    assert (r0["ts"], r0["dur"]) == (510_000, 3_500_000)
    assert r0["args"]["tokens"] == 8 and r0["args"]["engine"] == "engine-0" and r0["args"]["round"] == 7
    req_lanes = {threads[(e["pid"], e["tid"])] for e in xs if e["name"].startswith("request ")
                 and e["args"]["engine"] == "engine-0"}
    assert req_lanes == {"requests engine-0", "requests engine-0 [2]", "requests engine-0 [3]"}
    # Children: phases of a plain request; attempts of the re-sent one, phases inside attempt 2.
    r4 = next(e for e in xs if e["name"] == "request 4 (round 7)")
    kids = sorted((e for e in xs if (e["pid"], e["tid"]) == (r4["pid"], r4["tid"])
                   and r4["ts"] <= e["ts"] and e["ts"] + e["dur"] <= r4["ts"] + r4["dur"] and e is not r4),
                  key=lambda e: e["ts"])
    assert [k["name"] for k in kids] == ["attempt 1 (engine-1)", "attempt 2 (engine-0)", "queue+prefill", "decode"]
    assert kids[0]["args"]["outcome"] == "connection reset" and r4["args"]["attempts"] == 2
    assert r4["args"]["attempt_outcomes"] == ["engine-1: connection reset", "engine-0: ?"]
    assert kids[1]["ts"] == kids[0]["ts"] + kids[0]["dur"]  # the overlap was clamped
    # The unfinished request is drawn up to its last known time and marked.
    r5 = next(e for e in xs if e["name"] == "request 5 (round 7)")
    assert r5["args"]["unfinished"] is True and r5["args"]["error"] == "timeout"

    # Daemon events: instants on pid 2, engine events on the engine's track, fleet events on "fleet".
    inst = [e for e in evs if e["ph"] == "i"]
    assert {e["pid"] for e in inst} == {DAEMON_PID}
    assert not [e for e in evs if e["pid"] == DAEMON_PID and e["ph"] == "X" and e["cat"] != "daemon.state"]
    where = {e["name"]: threads[(e["pid"], e["tid"])] for e in inst}
    assert where == {"round_start 7": "fleet", "round_end 7": "fleet", "RUNNING -> EXITED": "engine-1",
                     "detection: exit": "engine-1", "EXITED -> STARTING": "engine-1"}
    t = next(e for e in inst if e["name"] == "RUNNING -> EXITED")
    assert t["args"]["reason"] == "exit status -9" and t["ts"] == 4_060_000
    # State spans from the transitions: EXITED until the restart, STARTING until the end of the trace.
    states = sorted((e for e in xs if e["pid"] == DAEMON_PID), key=lambda e: e["ts"])
    assert [(s["name"], s["ts"], s["ts"] + s["dur"]) for s in states] == [
        ("EXITED", 4_060_000, 10_210_000), ("STARTING", 10_210_000, 12_010_000)]


def test_rollout_client_results(tmp_path):
    """vime.trainer.rollout.RolloutResult as it is: top-level times, attempt_sent for the answering
    attempt, attempts as (engine, outcome) records without times."""
    rollout = pytest.importorskip("vime.trainer.rollout")
    from vime.trainer.dumps import Sample

    def result(i, engine, sent, attempt_sent, first, fin, attempts):
        return rollout.RolloutResult(
            request_id=f"r{i}", text="abc", finish_reason="length", engine=engine, url="http://x",
            token_ids=[1, 2, 3], logprobs=[-0.1, -0.2, -0.3], prompt_token_ids=[7, 8], n_tokens=3,
            attempts=[rollout.Attempt(e, o) for e, o in attempts], sent=T0 + sent,
            attempt_sent=T0 + attempt_sent, first_token=T0 + first, finished=T0 + fin, epoch=1,
            weight_version=4)

    results = [result(0, "engine-0", 0.0, 0.0, 0.5, 2.0, [("engine-0", "ok")]),
               result(1, "engine-1", 0.0, 1.0, 1.25, 3.0, [("engine-0", "refused"), ("engine-1", "ok")]),
               result(2, "engine-1", 0.5, 2.0, 2.5, 4.0,
                      [("engine-0", "died"), ("engine-0", "timeout"), ("engine-1", "ok")])]
    tr = Tracer()
    for r in results:
        tr.add_request(r, round=2)
    evs = load(tr.write(tmp_path / "t.json"))["traceEvents"]
    check_fields(evs)
    check_nesting(evs)
    xs = [e for e in evs if e["ph"] == "X"]
    r1 = next(e for e in xs if e["name"] == "request 1 (round 2)")
    assert (r1["ts"], r1["dur"]) == (0, 3_000_000) and r1["args"]["attempts"] == 2
    assert r1["args"]["attempt_outcomes"] == ["engine-0: refused", "engine-1: ok"]
    inside = sorted(((e["name"], e["ts"], e["ts"] + e["dur"]) for e in xs if e["tid"] == r1["tid"]
                     and e is not r1 and r1["ts"] <= e["ts"] <= e["ts"] + e["dur"] <= r1["ts"] + r1["dur"]),
                    key=lambda x: (x[1], -x[2]))
    assert inside == [("attempt 1 (re-sent)", 0, 1_000_000), ("attempt 2 (engine-1)", 1_000_000, 3_000_000),
                      ("queue+prefill", 1_000_000, 1_250_000), ("decode", 1_250_000, 3_000_000)]
    r2 = next(e for e in xs if e["name"] == "request 2 (round 2)")
    assert {e["name"] for e in xs if e["tid"] == r2["tid"] and e["ts"] >= r2["ts"]} >= {
        "attempts 1-2 (re-sent)", "attempt 3 (engine-1)"}
    s = long_tail_summary(results)
    # ttft from the answering attempt's send; latency from the first send (retries included)
    assert [x["latency_s"] for x in s["slowest"]] == pytest.approx([3.5, 3.0, 2.0])
    assert s["ttft_s"]["max"] == pytest.approx(0.5) and s["ttft_s"]["min"] == pytest.approx(0.25)
    sample = Sample.from_rollout(results[1], prompt="p", reward=1.0)
    assert (sample.prompt_token_ids, sample.output_token_ids, sample.attempts, sample.weight_version) == (
        [7, 8], [1, 2, 3], 2, 4)
    assert sample.timings == {"sent": T0, "attempt_sent": T0 + 1.0, "first_token": T0 + 1.25, "finished": T0 + 3.0}
    assert sample.metadata == {"request_id": "r1"}


def test_rounds_context_and_monotonic_times(tmp_path):
    tr = Tracer()
    with tr.round(3):
        time.sleep(0.25)
        m = time.monotonic()
        tr.add_request({"engine": "e", "sent": m - 0.2, "first_token": m - 0.1, "finished": m, "n_tokens": 4})
    with tr.span("publish v4", track="weights"):
        pass
    evs = load(tr.write(tmp_path / "t.json"))["traceEvents"]
    check_fields(evs)
    check_nesting(evs)
    xs = {e["name"]: e for e in evs if e["ph"] == "X"}
    # The request (monotonic clock) lands inside the round (wall clock): the clocks were aligned.
    rnd, r = xs["round 3"], xs["request 0 (round 3)"]
    assert rnd["ts"] - 2000 <= r["ts"] and r["ts"] + r["dur"] <= rnd["ts"] + rnd["dur"] + 2000
    assert r["dur"] == pytest.approx(200_000, abs=2) and r["args"]["tokens"] == 4
    assert "publish v4" in xs


def test_many_concurrent_requests_stay_well_nested(tmp_path):
    import random

    rng = random.Random(5)
    tr = Tracer()
    for i in range(300):
        sent = rng.uniform(0, 20)
        first = sent + rng.expovariate(5)
        fin = first + rng.expovariate(0.5)
        attempts = rng.choice([1, 2, [{"engine": "e0", "sent": T0 + sent, "finished": T0 + sent + 0.3},
                                      {"engine": "e1", "sent": T0 + sent + 0.2, "finished": T0 + fin}]])
        tr.add_request(req(f"e{i % 3}", sent, first, fin, attempts=attempts), round=i // 100)
    for n in range(3):
        tr.add_round(n, T0 + n * 7, T0 + n * 7 + 7.5)  # rounds overlapping a little: a second lane
    evs = load(tr.write(tmp_path / "t.json"))["traceEvents"]
    check_fields(evs)
    check_nesting(evs)
    assert sum(1 for e in evs if e["ph"] == "X" and e["name"].startswith("request ")) == 300


def test_percentiles_on_known_data():
    xs = list(range(1, 101))  # 1..100
    assert percentile(xs, 50) == 50.5
    assert percentile(xs, 90) == pytest.approx(90.1)
    assert percentile(xs, 99) == pytest.approx(99.01)
    assert percentile(xs, 100) == 100 and percentile(xs, 0) == 1
    assert percentile([3.0], 99) == 3.0 and percentile([], 50) is None
    np = pytest.importorskip("numpy")
    data = [0.3, 9.1, 0.2, 0.25, 4.0, 0.31, 0.29]
    for q in (50, 90, 99):
        assert percentile(data, q) == pytest.approx(float(np.percentile(data, q)))


def test_long_tail_summary(tmp_path):
    # 100 requests with latencies 0.1 .. 10.0 s; the slowest five are on engine-2.
    results = []
    for i in range(100):
        lat = (i + 1) / 10
        results.append(req("engine-2" if i >= 95 else f"engine-{i % 2}", 0.0, 0.05, lat, tokens=i))
    results.append(req("engine-1", 1.0, None, None, error="timeout"))  # failed: no latency
    s = long_tail_summary(results, top=3, round=12)
    assert (s["round"], s["count"], s["completed"], s["failed"]) == (12, 101, 100, 1)
    lat = s["latency_s"]
    assert lat["p50"] == pytest.approx(5.05) and lat["p90"] == pytest.approx(9.01)
    assert lat["p99"] == pytest.approx(9.901) and lat["max"] == pytest.approx(10.0)
    assert s["ttft_s"]["p50"] == pytest.approx(0.05)
    assert [(r["index"], r["engine"]) for r in s["slowest"]] == [(99, "engine-2"), (98, "engine-2"), (97, "engine-2")]
    assert s["slowest"][0]["latency_s"] == pytest.approx(10.0) and s["slowest"][0]["tokens"] == 99
    assert s["per_engine"]["engine-2"]["count"] == 5
    assert s["per_engine"]["engine-1"] == {"count": 48, "completed": 47, "p50": pytest.approx(4.8),
                                           "max": pytest.approx(9.4)}
    text = format_summary(s)
    assert text.startswith("round 12: 101 requests (100 completed, 1 failed)")
    assert "p99    9.901s" in text and "max   10.000s" in text
    row = next(line for line in text.splitlines() if line.strip().startswith("1 "))
    assert row.split()[:4] == ["1", "99", "engine-2", "10.000s"]
    # save_summary: JSON or the text table.
    j = json.loads(save_summary([s], tmp_path / "s.json").read_text())
    assert j["rounds"][0]["latency_s"]["max"] == pytest.approx(10.0)
    assert save_summary(s, tmp_path / "s.txt").read_text() == text
    # A Tracer summarises per round.
    tr = Tracer()
    for i, r in enumerate(results):
        tr.add_request(r, round=1 if i < 50 else 2)
    rounds = tr.summaries(top=2)
    assert [(x["round"], x["count"]) for x in rounds] == [(1, 50), (2, 51)]
    assert rounds[1]["slowest"][0]["engine"] == "engine-2"
    assert "round 2: 51 requests" in tr.save_summary(tmp_path / "all.txt").read_text()


# -- real daemon events -----------------------------------------------------------------------


def test_recorder_stamps_events_without_ts_and_skips_keepalives():
    import threading

    class Stream:  # the shape of SupervisorClient.events()/close(), for the recorder's own logic
        def __init__(self):
            self.closed = threading.Event()

        def events(self, keepalives=False):
            assert keepalives is True
            yield {"event": "hello", "routable": [], "round": None}
            yield {"event": "keepalive"}
            yield {"event": "transition", "engine": "e0", "from_state": "STARTING", "to_state": "RUNNING",
                   "reason": "ready", "incarnation": 1, "ts": T0}
            self.closed.wait(10)

        def close(self):
            self.closed.set()

    before = time.time()
    rec = DaemonEventRecorder(Stream()).start()
    rec.wait_for(lambda e: e["event"] == "transition", 5)
    rec.stop()
    assert rec.error is None and not rec._thread.is_alive()
    assert [e["event"] for e in rec.events] == ["hello", "transition"]
    assert rec.events[0]["ts"] >= before  # stamped on receipt
    assert [e["event"] for e in rec.tracer.daemon_events] == ["hello", "transition"]



def test_records_real_daemon_transitions(tmp_path):
    """A real daemon with an attached engine whose port nobody listens on: STARTING, then EXITED
    after first_wait (3 s). DaemonEventRecorder records them from the control socket."""
    run = tempfile.mkdtemp(prefix="vime-trace-", dir="/tmp")  # short: a Unix socket path is <108 bytes
    cfg = write_config(
        tmp_path / "supervisor.toml",
        supervisor={"runtime_dir": run, "log_dir": str(tmp_path / "logs"), "stop_timeout": 2.0},
        health_check={"first_wait": 3.0, "interval": 1.0, "timeout": 0.5},
        engines=[{"name": "ghost", "url": f"http://127.0.0.1:{free_port()}"}],
    )
    d = Daemon(cfg)
    tracer = Tracer()
    rec = None
    try:
        client = SupervisorClient(os.path.join(run, "supervisor.sock"), connect_timeout=30)
        client.status()  # waits (retrying) until the socket answers
        rec = DaemonEventRecorder(client, tracer).start()
        assert rec.events and rec.events[0]["event"] == "hello"
        ev = rec.wait_for(lambda e: e.get("event") == "transition" and e.get("engine") == "ghost"
                          and e.get("from_state") == "STARTING" and e.get("to_state") == "EXITED", 30)
        assert ev["incarnation"] >= 1 and isinstance(ev["ts"], float)
        # The daemon's own log has the same transition.
        d.transition("ghost", "EXITED", 10)
        with tracer.round(1):
            client.start_round(1)
            tracer.add_request({"engine": "ghost", "sent": time.time() - 0.01, "finished": time.time(),
                                "error": "connection refused"})
            client.end_round(1)
        rec.wait_for(lambda e: e.get("event") == "round_end" and e.get("round") == 1, 10)
    finally:
        if rec is not None:
            rec.stop()
        try:
            d.terminate(20)
        except subprocess.TimeoutExpired:
            d.kill()
        shutil.rmtree(run, ignore_errors=True)
    assert rec.error is None
    assert rec._thread is not None and not rec._thread.is_alive()  # stop() ended the reader

    evs = load(tracer.write(tmp_path / "trace.json"))["traceEvents"]
    check_fields(evs)
    check_nesting(evs)
    threads, procs = names(evs)
    assert procs[DAEMON_PID] == "vime-supervisor daemon"
    ghost = [e for e in evs if e["ph"] == "i" and threads.get((e["pid"], e["tid"])) == "ghost"]
    assert ghost and {e["pid"] for e in ghost} == {DAEMON_PID}
    trans = [e for e in ghost if e["args"]["event"] == "transition"]
    assert any(e["name"] == "STARTING -> EXITED" and e["args"]["to_state"] == "EXITED" for e in trans)
    assert any(e["name"] == "detection: exit" for e in ghost)
    fleet = {e["name"] for e in evs if e["ph"] == "i" and threads.get((e["pid"], e["tid"])) == "fleet"}
    assert {"hello", "round_start 1", "round_end 1"} <= fleet
    # The state spans on the daemon's ghost track include EXITED.
    assert any(e["ph"] == "X" and e["pid"] == DAEMON_PID and e["name"] == "EXITED" for e in evs)
    # The trainer's request to the ghost is on the trainer's side, not the daemon's.
    r = [e for e in evs if e["ph"] == "X" and e["name"].startswith("request ")]
    assert len(r) == 1 and r[0]["pid"] == TRAINER_PID and threads[(TRAINER_PID, r[0]["tid"])] == "requests ghost"
